#include "ts/host_cpus.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "ts/cgroup.h"

namespace ts {

namespace {

// CPU indices in this thread's affinity mask (empty when unknown).
std::vector<int> affinity_cpus() {
    for (int ncpu = 1024; ncpu <= (1 << 16); ncpu *= 4) {
        cpu_set_t* set = CPU_ALLOC(ncpu);
        if (set == nullptr) return {};
        const size_t bytes = CPU_ALLOC_SIZE(ncpu);
        CPU_ZERO_S(bytes, set);
        if (sched_getaffinity(0, bytes, set) == 0) {
            std::vector<int> cpus;
            for (int i = 0; i < ncpu; ++i)
                if (CPU_ISSET_S(i, bytes, set)) cpus.push_back(i);
            CPU_FREE(set);
            return cpus;
        }
        CPU_FREE(set);  // EINVAL: the kernel's mask is larger; try a bigger set
    }
    return {};
}

// Distinct (package, core) pairs among `cpus`, from /proc/cpuinfo; 0 when it
// says nothing about cores (then every CPU counts as one).
int physical_among(const std::vector<int>& cpus) {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::set<int> wanted(cpus.begin(), cpus.end());
    std::set<std::pair<int, int>> cores;
    int processor = -1, package = 0;
    bool described = false;
    std::string line;
    while (std::getline(cpuinfo, line)) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        const std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
        const int value = std::atoi(line.c_str() + colon + 1);
        if (key == "processor") processor = value;
        else if (key == "physical id") package = value;
        else if (key == "core id") {
            described = true;
            if (wanted.count(processor)) cores.emplace(package, value);
        }
    }
    return described ? int(cores.size()) : 0;
}

}  // namespace

HostCpuInfo host_cpu_info(const std::string& root) {
    HostCpuInfo info;
    const std::vector<int> cpus = affinity_cpus();
    const int logical = std::max(1, int(std::thread::hardware_concurrency()));
    info.affinity = cpus.empty() ? logical : int(cpus.size());
    info.usable = info.affinity;
    const CgroupCpu quota = cgroup_cpu_quota(root);
    if (quota.version != 0) {
        info.quota = quota.cpus;
        info.quota_source = "cgroup v" + std::to_string(quota.version) + " " + quota.dir;
        // 1.5 CPUs of quota keep two threads busy part of the time: round up.
        info.usable = std::max(1, std::min(info.usable, int(std::ceil(quota.cpus - 1e-9))));
    }
    const int physical = cpus.empty() ? 0 : physical_among(cpus);
    info.physical = std::max(1, std::min(info.usable, physical > 0 ? physical : info.affinity));
    return info;
}

int usable_cores() { return host_cpu_info().usable; }

int physical_core_count() { return host_cpu_info().physical; }

int max_host_threads() { return kThreadsPerUsableCore * usable_cores(); }

}  // namespace ts
