// Pageable -> device copies through a ring of page-locked slots.
//
// The driver copies pageable memory synchronously and slowly (a fraction of the
// pinned link speed; measured: docs/pinned.md). Here all host cores fill slot
// i+1 while slot i crosses the link as an asynchronous DMA, so the copy runs
// at the slower of the host's memcpy rate and the link.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "host_memory.h"

namespace ts_pinned {

struct StagingStats {
    size_t copies = 0;      // copy_to_device calls
    size_t bytes = 0;       // bytes staged
    size_t slot_waits = 0;  // times the host waited for a slot still in flight
};

class StagingRing {
public:
    StagingRing(size_t slot_bytes, int slots);
    ~StagingRing();
    StagingRing(const StagingRing&) = delete;
    StagingRing& operator=(const StagingRing&) = delete;

    // Copies `bytes` from host `src` to `dst`. dst_on_device: dst is device
    // memory of `device`, copied on `stream` (returns once src has been read;
    // the device copy completes in stream order). Otherwise dst is host memory
    // and the copy is complete on return (the CPU path, used by tests).
    void copy(const void* src, void* dst, size_t bytes, bool dst_on_device, int device, uintptr_t stream);

    size_t slot_bytes() const { return slot_bytes_; }
    int slots() const { return static_cast<int>(slots_.size()); }
    StagingStats stats() const;

private:
    struct Slot {
        HostRegion region;
        void* event = nullptr;  // cudaEvent_t, created lazily on the slot's device
        int event_device = -1;
    };
    void wait_slot(Slot& slot);

    size_t slot_bytes_;
    std::vector<Slot> slots_;
    mutable std::mutex mutex_;  // one copy at a time uses the ring
    size_t next_ = 0;
    StagingStats stats_;
};

// The process-wide ring (8 slots of 16 MiB unless configured first).
StagingRing& default_staging_ring();
bool configure_default_staging_ring(size_t slot_bytes, int slots);

}  // namespace ts_pinned
