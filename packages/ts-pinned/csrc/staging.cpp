#include "staging.h"

#include <algorithm>
#include <cstring>

#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/thread_pool.h"

namespace ts_pinned {

namespace {

// All cores copy one slot's worth; 1 MiB pieces keep each core streaming.
void parallel_memcpy(void* dst, const void* src, size_t bytes) {
    constexpr int64_t kPiece = 1 << 20;
    int64_t pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
    ts::host_pool().parallel_for(pieces, 1, [&](int64_t begin, int64_t end) {
        size_t from = static_cast<size_t>(begin) * kPiece;
        size_t to = std::min(bytes, static_cast<size_t>(end) * kPiece);
        std::memcpy(static_cast<char*>(dst) + from, static_cast<const char*>(src) + from, to - from);
    });
}

}  // namespace

StagingRing::StagingRing(size_t slot_bytes, int slots) : slot_bytes_(round_up(slot_bytes, kAlignment)) {
    TS_CHECK_ARG(slot_bytes > 0 && slots >= 2, "a staging ring needs slot_bytes > 0 and at least 2 slots");
    slots_.resize(slots);
    for (auto& slot : slots_) slot.region = allocate_host(slot_bytes_, /*allow_pageable=*/true);
}

StagingRing::~StagingRing() {
    for (auto& slot : slots_) {
#ifdef TS_WITH_CUDA
        if (slot.event != nullptr) {
            cudaEventSynchronize(static_cast<cudaEvent_t>(slot.event));
            cudaEventDestroy(static_cast<cudaEvent_t>(slot.event));
        }
#endif
        free_host(slot.region);
    }
}

void StagingRing::wait_slot(Slot& slot) {
#ifdef TS_WITH_CUDA
    if (slot.event == nullptr) return;
    auto event = static_cast<cudaEvent_t>(slot.event);
    if (cudaEventQuery(event) == cudaErrorNotReady) {
        ++stats_.slot_waits;
        TS_CUDA_CHECK(cudaEventSynchronize(event));
    } else {
        cudaGetLastError();
    }
#endif
}

void StagingRing::copy(const void* src, void* dst, size_t bytes, bool dst_on_device, int device,
                       uintptr_t stream) {
    std::lock_guard<std::mutex> lock(mutex_);
#ifndef TS_WITH_CUDA
    if (dst_on_device) ts::cuda_unavailable("copy_to_device to a CUDA tensor");
#else
    std::unique_ptr<ts::CudaDeviceGuard> guard;
    if (dst_on_device) guard = std::make_unique<ts::CudaDeviceGuard>(device);
#endif
    ++stats_.copies;
    stats_.bytes += bytes;
    for (size_t offset = 0; offset < bytes; offset += slot_bytes_) {
        size_t length = std::min(slot_bytes_, bytes - offset);
        Slot& slot = slots_[next_];
        next_ = (next_ + 1) % slots_.size();
        wait_slot(slot);  // the DMA that last read this slot must be done
        const char* from = static_cast<const char*>(src) + offset;
        char* to = static_cast<char*>(dst) + offset;
        parallel_memcpy(slot.region.ptr, from, length);
        if (!dst_on_device) {
            std::memcpy(to, slot.region.ptr, length);
            continue;
        }
#ifdef TS_WITH_CUDA
        auto cuda_stream = reinterpret_cast<cudaStream_t>(stream);
        if (slot.event != nullptr && slot.event_device != device) {
            cudaEventDestroy(static_cast<cudaEvent_t>(slot.event));
            slot.event = nullptr;
        }
        if (slot.event == nullptr) {
            cudaEvent_t event;
            TS_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
            slot.event = event;
            slot.event_device = device;
        }
        TS_CUDA_CHECK(cudaMemcpyAsync(to, slot.region.ptr, length, cudaMemcpyHostToDevice, cuda_stream));
        TS_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(slot.event), cuda_stream));
#endif
    }
}

StagingStats StagingRing::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
}

namespace {
std::mutex ring_mutex;
// Never destroyed: freeing page-locked memory during static destruction can
// race the CUDA runtime's own teardown.
StagingRing* ring_instance = nullptr;
size_t ring_slot_bytes = 16u << 20;
int ring_slots = 8;
}  // namespace

StagingRing& default_staging_ring() {
    std::lock_guard<std::mutex> lock(ring_mutex);
    if (ring_instance == nullptr) ring_instance = new StagingRing(ring_slot_bytes, ring_slots);
    return *ring_instance;
}

bool configure_default_staging_ring(size_t slot_bytes, int slots) {
    TS_CHECK_ARG(slot_bytes > 0 && slots >= 2, "a staging ring needs slot_bytes > 0 and at least 2 slots");
    std::lock_guard<std::mutex> lock(ring_mutex);
    if (ring_instance != nullptr) return false;
    ring_slot_bytes = slot_bytes;
    ring_slots = slots;
    return true;
}

}  // namespace ts_pinned
