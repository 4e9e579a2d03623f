#include "arena.h"

#include <algorithm>
#include <new>

#include "ts/errors.h"

namespace ts_pinned {

Arena::Arena(size_t slab_bytes, size_t cap_bytes) : slab_bytes_(slab_bytes), cap_bytes_(cap_bytes) {
    TS_CHECK_ARG(slab_bytes > 0, "slab_bytes must be positive, got 0");
    TS_CHECK_ARG(slab_bytes <= kMaxRequest, "slab_bytes (", slab_bytes, ") is larger than any host can hold");
}

Arena::~Arena() {
    // Blocks still alive at this point are owned by tensors that outlive the
    // arena object; their capsules hold a reference, so this only runs when
    // none is left.
    for (const auto& slab : slabs_) free_host(slab.region);
    for (const auto& [ptr, block] : blocks_) {
        if (block.slab < 0) free_host(block.standalone);
    }
}

bool Arena::add_slab_locked(size_t bytes) {
    bytes = round_up(bytes, kAlignment);
    if (cap_bytes_ != kUnlimited && reserved_ + bytes > cap_bytes_) return false;
    HostRegion region = allocate_host(bytes, /*allow_pageable=*/false);
    ++host_alloc_calls_;
    auto slot = std::find_if(slabs_.begin(), slabs_.end(), [](const Slab& s) { return s.region.ptr == nullptr; });
    int index;
    if (slot != slabs_.end()) {
        slot->region = region;
        index = static_cast<int>(slot - slabs_.begin());
    } else {
        slabs_.push_back(Slab{region, {}});
        index = static_cast<int>(slabs_.size()) - 1;
    }
    reserved_ += bytes;
    insert_free_locked(index, 0, bytes);
    return true;
}

size_t Arena::reserve(size_t bytes_now, size_t cap) {
    TS_CHECK_ARG(bytes_now <= kMaxRequest, "bytes_now (", bytes_now, " bytes) is larger than any host can hold");
    std::lock_guard<std::mutex> lock(mutex_);
    if (cap > 0) {
        TS_CHECK_ARG(cap >= bytes_now, "cap (", cap, " bytes) is below bytes_now (", bytes_now,
                     " bytes); pass a cap of at least bytes_now, or 0 to leave it unchanged");
        cap_bytes_ = std::max(cap, reserved_);
    }
    while (reserved_ < bytes_now) {
        // Slabs of at most slab_bytes, so reserving 1.5 slabs locks 1.5, not 2.
        // Rounded here (not only in add_slab_locked) so that lifting the cap
        // below lifts it by exactly the slab that is then added.
        size_t want = round_up(std::min(slab_bytes_, bytes_now - reserved_), kAlignment);
        // Reserving is an explicit request: it may lift the cap to bytes_now.
        size_t cap_before = cap_bytes_;
        if (cap_bytes_ != kUnlimited && reserved_ + want > cap_bytes_) cap_bytes_ = reserved_ + want;
        try {
            if (!add_slab_locked(want)) ts::throw_runtime_error("internal error: reserve could not add a slab");
        } catch (...) {
            cap_bytes_ = cap_before;  // what was reserved so far stays, within the old cap
            throw;
        }
    }
    return reserved_;
}

void Arena::insert_free_locked(int slab, size_t offset, size_t length) {
    slabs_[slab].free_ranges.emplace(offset, length);
    free_by_size_.emplace(length, slab, offset);
}

void Arena::erase_free_locked(int slab, size_t offset, size_t length) {
    slabs_[slab].free_ranges.erase(offset);
    free_by_size_.erase(FreeKey{length, slab, offset});
}

void* Arena::carve_locked(size_t length, Block& block) {
    auto it = free_by_size_.lower_bound(FreeKey{length, -1, 0});
    if (it == free_by_size_.end()) return nullptr;
    auto [free_length, slab, offset] = *it;
    erase_free_locked(slab, offset, free_length);
    if (free_length > length) insert_free_locked(slab, offset + length, free_length - length);
    used_ += length;
    block.slab = slab;
    block.offset = offset;
    return static_cast<char*>(slabs_[slab].region.ptr) + offset;
}

size_t Arena::growth_locked(size_t length) const {
    // A full slab where the cap leaves room for one, else what the cap still
    // allows (so a cap that is not a multiple of the slab size is used to its
    // end); 0 when not even `length` fits.
    size_t want = std::max(round_up(slab_bytes_, kAlignment), length);
    if (cap_bytes_ == kUnlimited) return want;
    size_t room = cap_bytes_ > reserved_ ? (cap_bytes_ - reserved_) / kAlignment * kAlignment : 0;
    if (room < length) return 0;
    return std::min(want, room);
}

void* Arena::allocate(size_t bytes, const std::string& tag, bool allow_pageable) {
    if (bytes > kMaxRequest) {
        ts::throw_memory_error("cannot allocate ", bytes, " bytes of host memory: larger than any host can hold");
    }
    size_t length = round_up(std::max<size_t>(bytes, 1), kAlignment);
    std::lock_guard<std::mutex> lock(mutex_);
    Block block{-1, 0, length, bytes, tag, {}};
    void* ptr = carve_locked(length, block);
    if (ptr == nullptr) {
        size_t grow = growth_locked(length);
        bool grown = false;
        if (grow > 0) {
            // If page-locking a whole slab fails, the request alone may still be
            // page-locked (or, when the caller allows, made pageable) below.
            try {
                grown = add_slab_locked(grow);
            } catch (const ts::memory_error&) {
                grown = false;
            } catch (const std::bad_alloc&) {
                grown = false;
            }
        }
        if (grown) ptr = carve_locked(length, block);
    }
    if (ptr == nullptr) {
        block.slab = -1;
        block.standalone = allocate_host(length, allow_pageable);
        ++host_alloc_calls_;
        ++fallbacks_;
        if (!block.standalone.pinned && page_locking_available()) ++pageable_fallbacks_;
        fallback_bytes_ += length;
        ptr = block.standalone.ptr;
    }
    by_tag_[tag] += bytes;
    blocks_.emplace(ptr, std::move(block));
    return ptr;
}

bool Arena::is_pinned(void* ptr) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return false;
    const Block& block = it->second;
    return block.slab < 0 ? block.standalone.pinned : slabs_[block.slab].region.pinned;
}

void Arena::release(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(ptr);
    TS_CHECK_ARG(it != blocks_.end(), "pointer was not allocated by this arena (double free?)");
    Block block = std::move(it->second);
    blocks_.erase(it);
    auto tag = by_tag_.find(block.tag);
    tag->second -= block.requested;
    if (tag->second == 0) by_tag_.erase(tag);
    if (block.slab < 0) {
        fallback_bytes_ -= block.length;
        free_host(block.standalone);
        return;
    }
    used_ -= block.length;
    size_t offset = block.offset;
    size_t length = block.length;
    auto& ranges = slabs_[block.slab].free_ranges;
    auto next = ranges.lower_bound(offset);
    if (next != ranges.end() && next->first == offset + length) {
        size_t next_length = next->second;
        erase_free_locked(block.slab, next->first, next_length);
        length += next_length;
    }
    next = ranges.lower_bound(offset);
    if (next != ranges.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == offset) {
            size_t prev_offset = prev->first;
            size_t prev_length = prev->second;
            erase_free_locked(block.slab, prev_offset, prev_length);
            offset = prev_offset;
            length += prev_length;
        }
    }
    insert_free_locked(block.slab, offset, length);
}

size_t Arena::trim(size_t keep_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t released = 0;
    for (size_t i = slabs_.size(); i-- > 0 && reserved_ > keep_bytes;) {
        Slab& slab = slabs_[i];
        if (slab.region.ptr == nullptr || slab.free_ranges.size() != 1) continue;
        auto [offset, length] = *slab.free_ranges.begin();
        if (offset != 0 || length != slab.region.bytes) continue;  // some block lives here
        erase_free_locked(static_cast<int>(i), offset, length);
        free_host(slab.region);
        reserved_ -= slab.region.bytes;
        released += slab.region.bytes;
        slab.region = HostRegion{};
    }
    return released;
}

void Arena::set_slab_bytes(size_t bytes) {
    TS_CHECK_ARG(bytes > 0, "slab size must be positive");
    TS_CHECK_ARG(bytes <= kMaxRequest, "slab size (", bytes, ") is larger than any host can hold");
    std::lock_guard<std::mutex> lock(mutex_);
    slab_bytes_ = bytes;
}

ArenaStats Arena::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    ArenaStats s;
    s.arena_bytes = reserved_;
    s.arena_used = used_;
    s.arena_slabs = static_cast<size_t>(
        std::count_if(slabs_.begin(), slabs_.end(), [](const Slab& sl) { return sl.region.ptr != nullptr; }));
    s.arena_cap = cap_bytes_;
    s.arena_fallbacks = fallbacks_;
    s.arena_largest_free = free_by_size_.empty() ? 0 : std::get<0>(*free_by_size_.rbegin());
    s.fallback_bytes = fallback_bytes_;
    s.pageable_fallbacks = pageable_fallbacks_;
    s.host_alloc_calls = host_alloc_calls_;
    s.live_blocks = blocks_.size();
    s.slab_bytes = slab_bytes_;
    s.pinned = page_locking_available();
    s.by_tag = by_tag_;
    return s;
}

void Arena::check_invariants() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::map<size_t, size_t>> covered(slabs_.size());
    size_t free_total = 0;
    size_t free_entries = 0;
    for (size_t s = 0; s < slabs_.size(); ++s) {
        size_t last_end = 0;
        bool have_last = false;
        for (const auto& [offset, length] : slabs_[s].free_ranges) {
            if (have_last && offset == last_end) ts::throw_runtime_error("free ranges not coalesced in slab ", s);
            covered[s].emplace(offset, length);
            free_total += length;
            last_end = offset + length;
            have_last = true;
            ++free_entries;
        }
    }
    if (free_entries != free_by_size_.size()) ts::throw_runtime_error("size index out of sync with free ranges");
    size_t used_total = 0;
    for (const auto& [ptr, block] : blocks_) {
        if (block.slab < 0) continue;
        if (block.offset % kAlignment != 0) ts::throw_runtime_error("misaligned block");
        if (!covered[block.slab].emplace(block.offset, block.length).second)
            ts::throw_runtime_error("two ranges start at one offset");
        used_total += block.length;
    }
    if (used_total != used_) ts::throw_runtime_error("used bytes do not add up");
    if (used_total + free_total != reserved_) ts::throw_runtime_error("used + free != reserved");
    for (size_t s = 0; s < slabs_.size(); ++s) {
        size_t expect = 0;
        for (const auto& [offset, length] : covered[s]) {
            if (offset != expect) ts::throw_runtime_error("gap or overlap in slab ", s, " at offset ", offset);
            expect = offset + length;
        }
        if (expect != slabs_[s].region.bytes) ts::throw_runtime_error("slab ", s, " not tiled to its end");
    }
    if (cap_bytes_ != kUnlimited && reserved_ > cap_bytes_) ts::throw_runtime_error("reserved beyond the cap");
}

}  // namespace ts_pinned
