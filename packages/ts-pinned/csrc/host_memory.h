// Raw host memory for the arena: page-locked through the CUDA driver when a
// GPU is present, ordinary aligned memory otherwise (CPU-only builds and
// machines), so every allocator path runs and is tested without a GPU.
#pragma once

#include <cstddef>
#include <string>

namespace ts_pinned {

constexpr size_t kAlignment = 512;  // DMA-friendly, >= any dtype, like torch's CUDA allocator

struct HostRegion {
    void* ptr = nullptr;
    size_t bytes = 0;
    bool pinned = false;  // page-locked (true) or pageable (false)
};

// True when this process can page-lock memory through CUDA.
bool page_locking_available();

// Allocates `bytes`, page-locked when page_locking_available(). When
// page-locking fails: with allow_pageable, returns pageable memory (pinned =
// false); otherwise throws MemoryError explaining the limit and how to raise it.
HostRegion allocate_host(size_t bytes, bool allow_pageable);

void free_host(const HostRegion& region);

// "memlock limit X, Y available": the limits that bound page-locking, for messages.
std::string describe_host_limits();

size_t round_up(size_t value, size_t multiple);

}  // namespace ts_pinned
