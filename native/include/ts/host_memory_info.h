// Host RAM as the kernel reports it (/proc/meminfo), for probes and messages.
#pragma once

#include <cstdint>

namespace ts {

struct HostMemoryInfo {
    uint64_t total = 0;      // MemTotal, bytes
    uint64_t available = 0;  // MemAvailable (MemFree where the kernel lacks it), bytes
};

// Zeros where /proc/meminfo cannot be read (non-Linux).
HostMemoryInfo host_memory_info();

}  // namespace ts
