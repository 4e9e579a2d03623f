// Host RAM for probes, budgets and messages: /proc/meminfo, bounded by the
// cgroup memory limit (v1 or v2) where one is set, since a container's limit
// is what gets the process killed and /proc/meminfo does not show it.
#pragma once

#include <cstdint>
#include <string>

namespace ts {

struct HostMemoryInfo {
    uint64_t total = 0;      // min(MemTotal, cgroup limit), bytes
    uint64_t available = 0;  // min(MemAvailable, cgroup room), bytes
    std::string source = "meminfo";  // what bounds `available`: "meminfo", "cgroup v1" or "cgroup v2"
    uint64_t meminfo_total = 0;      // MemTotal
    uint64_t meminfo_available = 0;  // MemAvailable (MemFree where the kernel lacks it)
    // The limiting cgroup (limit 0: none): room = limit - (usage - reclaimable).
    int cgroup_version = 0;
    uint64_t cgroup_limit = 0, cgroup_usage = 0, cgroup_reclaimable = 0;
    std::string cgroup_dir;
};

// `root` as in ts/cgroup.h: /proc/meminfo is read under it too. Zeros where
// nothing can be read (non-Linux).
HostMemoryInfo host_memory_info(const std::string& root = "");

}  // namespace ts
