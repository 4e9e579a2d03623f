#include "ts/host_memory_info.h"

#include <algorithm>
#include <fstream>
#include <string>

#include "ts/cgroup.h"

namespace ts {

HostMemoryInfo host_memory_info(const std::string& root_arg) {
    const std::string root = system_root(root_arg);
    HostMemoryInfo info;
    uint64_t free_bytes = 0;
    bool have_available = false;
    std::ifstream meminfo(root + "/proc/meminfo");
    std::string key, unit;
    uint64_t kib = 0;
    while (meminfo >> key >> kib) {
        std::getline(meminfo, unit);  // " kB" or nothing
        if (key == "MemTotal:") info.meminfo_total = kib * 1024;
        if (key == "MemFree:") free_bytes = kib * 1024;
        if (key == "MemAvailable:") {
            info.meminfo_available = kib * 1024;
            have_available = true;
        }
    }
    if (!have_available) info.meminfo_available = free_bytes;
    info.total = info.meminfo_total;
    info.available = info.meminfo_available;

    const CgroupMemory cg = cgroup_memory(root);
    if (cg.version != 0) {
        info.cgroup_version = cg.version;
        info.cgroup_limit = cg.limit;
        info.cgroup_usage = cg.usage;
        info.cgroup_reclaimable = cg.reclaimable;
        info.cgroup_dir = cg.dir;
        info.total = info.total ? std::min(info.total, cg.limit) : cg.limit;
        if (info.meminfo_total == 0 || cg.room < info.available) {
            info.available = cg.room;
            info.source = "cgroup v" + std::to_string(cg.version);
        }
    }
    info.available = std::min(info.available, info.total);
    return info;
}

}  // namespace ts
