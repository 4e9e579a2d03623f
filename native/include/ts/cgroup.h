// Control-group limits of this process (cgroup v1 and v2): the CPU quota and
// the memory limit that a container enforces but /proc/cpuinfo and
// /proc/meminfo do not show.
//
// Every reader takes a `root`: "" means the environment variable
// TS_CGROUP_ROOT when set, else "/". Files are read under it
// (<root>/proc/self/cgroup, <root>/sys/fs/cgroup/...), so tests point it at a
// fake tree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ts {

// `root` resolved as above, without a trailing slash ("" for "/").
std::string system_root(const std::string& root);

// Whole file into `out`; false when it cannot be read.
bool read_file(const std::string& path, std::string& out);

// The cgroup directories that govern `controller` ("cpu" or "memory") for this
// process, the process's own first, then each ancestor up to the hierarchy's
// root (limits of every ancestor apply too). version 0: none found.
struct CgroupDirs {
    int version = 0;
    std::vector<std::string> dirs;
};
CgroupDirs cgroup_dirs(const std::string& root, const std::string& controller);

// The tightest CPU quota on the way to the root, in CPUs (quota / period).
struct CgroupCpu {
    int version = 0;     // 0: no quota anywhere
    double cpus = 0;     // e.g. 1.5 for "150000 100000"
    std::string dir;     // where it was set
};
CgroupCpu cgroup_cpu_quota(const std::string& root = "");

// The memory limit that leaves the least room, with that level's usage.
// `reclaimable` is its inactive page cache (memory.stat inactive_file), which
// the kernel drops before it kills: room = limit - (usage - reclaimable).
struct CgroupMemory {
    int version = 0;  // 0: no limit anywhere
    uint64_t limit = 0, usage = 0, reclaimable = 0, room = 0;
    std::string dir;
};
CgroupMemory cgroup_memory(const std::string& root = "");

}  // namespace ts
