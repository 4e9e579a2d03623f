#include "host_memory.h"

#include <sys/resource.h>

#include <cstdlib>
#include <new>
#include <sstream>

#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/host_memory_info.h"

namespace ts_pinned {

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

bool page_locking_available() { return ts::cuda_device_present(); }

namespace {

std::string format_bytes(unsigned long long bytes) {
    std::ostringstream out;
    out.precision(3);
    out << double(bytes) / double(1ull << 30) << " GiB";
    return out.str();
}

void* aligned_pageable(size_t bytes) {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, kAlignment, bytes) != 0) return nullptr;
    return ptr;
}

}  // namespace

std::string describe_host_limits() {
    std::ostringstream out;
    rlimit limit{};
    if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0) {
        out << "memlock limit "
            << (limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited") : format_bytes(limit.rlim_cur));
    }
    ts::HostMemoryInfo info = ts::host_memory_info();
    if (info.total > 0) out << ", " << format_bytes(info.available) << " of RAM available";
    if (info.cgroup_version != 0) {
        out << " (cgroup v" << info.cgroup_version << " memory limit " << format_bytes(info.cgroup_limit) << ", "
            << format_bytes(info.cgroup_usage) << " used)";
    }
    return out.str();
}

HostRegion allocate_host(size_t bytes, bool allow_pageable) {
    HostRegion region;
    region.bytes = bytes;
#ifdef TS_WITH_CUDA
    if (page_locking_available()) {
        // Portable: pinned for every CUDA context in the process (torch's included).
        cudaError_t status = cudaHostAlloc(&region.ptr, bytes, cudaHostAllocPortable);
        if (status == cudaSuccess) {
            region.pinned = true;
            return region;
        }
        cudaGetLastError();
        region.ptr = nullptr;
        if (!allow_pageable) {
            ts::throw_memory_error(
                "page-locking ", format_bytes(bytes), " failed (", cudaGetErrorName(status),
                "; ", describe_host_limits(),
                "). Free host RAM, reserve less pinned memory, or raise the memlock limit "
                "(ulimit -l, /etc/security/limits.conf, or LimitMEMLOCK= for a systemd service).");
        }
    }
#endif
    region.ptr = aligned_pageable(bytes);
    if (region.ptr == nullptr) throw std::bad_alloc();
    region.pinned = false;
    return region;
}

void free_host(const HostRegion& region) {
    if (region.ptr == nullptr) return;
#ifdef TS_WITH_CUDA
    if (region.pinned) {
        cudaFreeHost(region.ptr);
        return;
    }
#endif
    std::free(region.ptr);
}

}  // namespace ts_pinned
