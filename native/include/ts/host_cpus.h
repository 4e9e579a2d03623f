// The CPUs this process may use: its affinity mask (taskset, cpusets) and its
// cgroup CPU quota (docker --cpus, Kubernetes limits), which
// std::thread::hardware_concurrency() and /proc/cpuinfo ignore.
#pragma once

#include <string>

namespace ts {

struct HostCpuInfo {
    int affinity = 1;      // logical CPUs in the affinity mask
    double quota = 0;      // CPUs the cgroup quota allows (0: no quota)
    std::string quota_source;  // "cgroup v2 <dir>", "cgroup v1 <dir>" or ""
    int usable = 1;        // min(affinity, ceil(quota)): threads that can run at once
    int physical = 1;      // physical cores among the affinity CPUs, at most `usable`
};

// `root` as in ts/cgroup.h (cgroup files only; the affinity is the kernel's).
HostCpuInfo host_cpu_info(const std::string& root = "");

// host_cpu_info().usable.
int usable_cores();

// The default size of the host pool: host_cpu_info().physical.
int physical_core_count();

// The most threads set_host_threads and per-call `threads=` accept: a few per
// usable core (more only oversubscribes; unbounded counts exhaust the
// machine's process table).
constexpr int kThreadsPerUsableCore = 4;
int max_host_threads();

}  // namespace ts
