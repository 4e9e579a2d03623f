// A slab arena of page-locked host memory.
//
// Slabs are page-locked up front (reserve) or on demand up to a cap, then
// carved into aligned blocks with a best-fit free list that coalesces
// neighbours on free. A request the arena may not grow for is page-locked on
// its own and counted as a fallback, so callers never fail for lack of arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "host_memory.h"

namespace ts_pinned {

constexpr size_t kUnlimited = SIZE_MAX;
// Larger requests are refused before any arithmetic on them can overflow.
constexpr size_t kMaxRequest = SIZE_MAX / 4;

struct ArenaStats {
    size_t arena_bytes = 0;         // reserved in slabs
    size_t arena_used = 0;          // handed out from slabs (aligned sizes)
    size_t arena_slabs = 0;
    size_t arena_cap = 0;           // slabs may grow up to this (SIZE_MAX: no cap)
    size_t arena_fallbacks = 0;     // blocks page-locked on their own, ever
    size_t arena_largest_free = 0;  // largest block a request could get without growing
    size_t fallback_bytes = 0;      // live bytes in fallback blocks
    size_t pageable_fallbacks = 0;  // blocks that got pageable memory, ever
    size_t host_alloc_calls = 0;    // calls that page-locked (or allocated) host memory
    size_t live_blocks = 0;
    size_t slab_bytes = 0;          // size of the next slab
    bool pinned = false;            // whether slabs are page-locked (false without a GPU)
    std::map<std::string, size_t> by_tag;  // live requested bytes per tag
};

class Arena {
public:
    Arena(size_t slab_bytes, size_t cap_bytes);
    ~Arena();
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    // Reserves slabs until at least `bytes_now` are reserved; raises the cap to
    // `cap` when cap > 0 (never below what is reserved). Returns bytes reserved.
    size_t reserve(size_t bytes_now, size_t cap);

    // A block of at least `bytes` (aligned to kAlignment). allow_pageable: if
    // page-locking fails, hand out pageable memory instead of raising.
    void* allocate(size_t bytes, const std::string& tag, bool allow_pageable);
    // Whether the block at `ptr` is page-locked.
    bool is_pinned(void* ptr) const;
    void release(void* ptr);

    void set_slab_bytes(size_t bytes);
    // Returns wholly free slabs to the system (unlocked and freed), the latest
    // first, while more than `keep_bytes` are reserved. Slabs holding any block
    // stay. Returns the bytes released.
    size_t trim(size_t keep_bytes);
    ArenaStats stats() const;

    // Consistency check for tests: free and used ranges tile every slab, free
    // neighbours are coalesced. Throws on violation.
    void check_invariants() const;

private:
    // A trimmed slab keeps its index (blocks and the size index name slabs by
    // index) with an empty region; add_slab_locked reuses such a slot.
    struct Slab {
        HostRegion region;
        std::map<size_t, size_t> free_ranges;  // offset -> length
    };
    struct Block {
        int slab;  // -1: page-locked on its own
        size_t offset;
        size_t length;
        size_t requested;
        std::string tag;
        HostRegion standalone;
    };
    using FreeKey = std::tuple<size_t, int, size_t>;  // length, slab, offset

    bool add_slab_locked(size_t bytes);
    void insert_free_locked(int slab, size_t offset, size_t length);
    void erase_free_locked(int slab, size_t offset, size_t length);
    // Takes `length` bytes from the best-fitting free range; fills block.slab
    // and block.offset. nullptr when no free range is large enough.
    void* carve_locked(size_t length, Block& block);
    // Bytes of the slab to add for a request of `length`; 0 if the cap forbids.
    size_t growth_locked(size_t length) const;

    mutable std::mutex mutex_;
    std::vector<Slab> slabs_;
    std::set<FreeKey> free_by_size_;
    std::unordered_map<void*, Block> blocks_;
    size_t slab_bytes_;
    size_t cap_bytes_;
    size_t reserved_ = 0;
    size_t used_ = 0;
    size_t fallbacks_ = 0;
    size_t fallback_bytes_ = 0;
    size_t pageable_fallbacks_ = 0;
    size_t host_alloc_calls_ = 0;
    std::map<std::string, size_t> by_tag_;
};

}  // namespace ts_pinned
