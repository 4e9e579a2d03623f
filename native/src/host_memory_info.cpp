#include "ts/host_memory_info.h"

#include <fstream>
#include <string>

namespace ts {

HostMemoryInfo host_memory_info() {
    HostMemoryInfo info;
    uint64_t free_bytes = 0;
    bool have_available = false;
    std::ifstream meminfo("/proc/meminfo");
    std::string key, unit;
    uint64_t kib = 0;
    while (meminfo >> key >> kib) {
        std::getline(meminfo, unit);  // " kB" or nothing
        if (key == "MemTotal:") info.total = kib * 1024;
        if (key == "MemFree:") free_bytes = kib * 1024;
        if (key == "MemAvailable:") {
            info.available = kib * 1024;
            have_available = true;
        }
    }
    if (!have_available) info.available = free_bytes;
    return info;
}

}  // namespace ts
