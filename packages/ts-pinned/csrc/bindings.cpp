// Python bindings of ts_pinned._core. Tensors cross as DLPack: blocks leave
// as uint8 torch tensors whose capsule returns the block to its arena.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <memory>

#include "arena.h"
#include "gather.h"
#include "staging.h"
#include "ts/bindings.h"
#include "ts/ndarray.h"

namespace nb = nanobind;
using namespace ts_pinned;

namespace {

using ByteTensor = nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// What a block's capsule owns: the block, and the arena kept alive until the
// last tensor viewing the block is gone.
struct BlockOwner {
    std::shared_ptr<Arena> arena;
    void* ptr;
};

ByteTensor allocate_tensor(const std::shared_ptr<Arena>& arena, size_t bytes, const std::string& tag,
                           bool allow_pageable) {
    void* ptr;
    {
        nb::gil_scoped_release release;  // page-locking a new slab can take a second
        ptr = arena->allocate(bytes, tag, allow_pageable);
    }
    auto* owner = new BlockOwner{arena, ptr};
    nb::capsule capsule(owner, [](void* p) noexcept {
        auto* block = static_cast<BlockOwner*>(p);
        block->arena->release(block->ptr);
        delete block;
    });
    size_t shape[1] = {bytes};
    return ByteTensor(ptr, 1, shape, capsule);
}

nb::dict stats_dict(const ArenaStats& s) {
    nb::dict d;
    d["arena_bytes"] = s.arena_bytes;
    d["arena_used"] = s.arena_used;
    d["arena_slabs"] = s.arena_slabs;
    d["arena_cap"] = s.arena_cap == kUnlimited ? nb::object(nb::none()) : nb::object(nb::int_(s.arena_cap));
    d["arena_fallbacks"] = s.arena_fallbacks;
    d["arena_largest_free"] = s.arena_largest_free;
    d["fallback_bytes"] = s.fallback_bytes;
    d["pageable_fallbacks"] = s.pageable_fallbacks;
    d["host_alloc_calls"] = s.host_alloc_calls;
    d["live_blocks"] = s.live_blocks;
    d["slab_bytes"] = s.slab_bytes;
    d["pinned"] = s.pinned;
    nb::dict tags;
    for (const auto& [tag, bytes] : s.by_tag) tags[nb::str(tag.c_str())] = bytes;
    d["by_tag"] = tags;
    return d;
}

using HostBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyBytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>;

void staged_copy(HostBytes src, AnyBytes dst, uintptr_t stream) {
    TS_CHECK_ARG(src.size() == dst.size(), "copy_to_device: src has ", src.size(), " bytes but dst has ",
                 dst.size());
    bool on_device = ts::is_cuda(dst);
    TS_CHECK_ARG(on_device || ts::is_cpu(dst), "copy_to_device: dst must be a CUDA or CPU tensor");
    nb::gil_scoped_release release;
    default_staging_ring().copy(src.data(), dst.data(), src.size(), on_device, dst.device_id(), stream);
}

// table: a page-locked CPU tensor [rows, row_bytes] as bytes; ids: int64 on a CUDA device; out: that device,
// n * row_bytes bytes; bad: one int32 in page-locked host memory, set to 1 by an id out of range.
void gather_rows(nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig> table, nb::ndarray<int64_t, nb::c_contig> ids,
                 nb::ndarray<uint8_t, nb::c_contig> out, nb::ndarray<int32_t, nb::c_contig> bad, uintptr_t stream) {
    TS_CHECK_ARG(ts::is_cpu(table) && ts::is_cpu(bad) && bad.size() == 1,
                 "gather_rows: table and bad (one int32) must be CPU tensors in page-locked memory");
    TS_CHECK_ARG(ts::is_cuda(ids) && ts::is_cuda(out) && ids.device_id() == out.device_id(),
                 "gather_rows: ids and out must be on the same CUDA device");
    const int64_t n = static_cast<int64_t>(ids.size()), row_bytes = static_cast<int64_t>(table.shape(1));
    TS_CHECK_ARG(out.size() == static_cast<size_t>(n * row_bytes), "gather_rows: out must hold ", n * row_bytes,
                 " bytes (ids x row), holds ", out.size());
#ifdef TS_WITH_CUDA
    const int device = static_cast<int>(ids.device_id());
    const void* view = device_view_of_host(table.data(), device);
    auto* flag = static_cast<int*>(const_cast<void*>(device_view_of_host(bad.data(), device)));
    TS_CHECK_ARG(view != nullptr && flag != nullptr,
                 "gather_rows: table and bad must be page-locked host memory the device can read");
    gather_rows_cuda(view, static_cast<int64_t>(table.shape(0)), row_bytes, ids.data(), n, out.data(), flag, device,
                     stream);
#else
    (void)stream;
    ts::cuda_unavailable("gather_rows");
#endif
}

}  // namespace

NB_MODULE(_core, m) {
    ts::register_common(m);
    // Arena blocks are owned by torch tensors, which may still be alive when
    // the interpreter shuts down; nanobind would then report the arenas they
    // keep alive as leaks on every exit. They are not leaks: silence that.
    nb::set_leak_warnings(false);
    m.attr("ALIGNMENT") = kAlignment;

    nb::class_<Arena>(m, "Arena", "Slab arena of page-locked host memory (see ts_pinned.PinnedArena).")
        .def("__init__",
             [](Arena* self, size_t slab_bytes, nb::object cap) {
                 new (self) Arena(slab_bytes, cap.is_none() ? kUnlimited : nb::cast<size_t>(cap));
             },
             nb::arg("slab_bytes"), nb::arg("cap_bytes").none())
        .def("reserve", &Arena::reserve, nb::arg("bytes_now"), nb::arg("cap") = 0,
             nb::call_guard<nb::gil_scoped_release>())
        .def("set_slab_bytes", &Arena::set_slab_bytes, nb::arg("bytes"))
        .def("trim", &Arena::trim, nb::arg("keep_bytes") = 0, nb::call_guard<nb::gil_scoped_release>())
        .def("stats", [](const Arena& a) { return stats_dict(a.stats()); })
        .def("check_invariants", &Arena::check_invariants);

    m.def("allocate", &allocate_tensor, nb::arg("arena"), nb::arg("nbytes"), nb::arg("tag") = "",
          nb::arg("allow_pageable") = false,
          "A uint8 CPU tensor of nbytes backed by an arena block; the block returns when it dies.");
    m.def("block_is_pinned", [](const std::shared_ptr<Arena>& arena, uintptr_t ptr) {
        return arena->is_pinned(reinterpret_cast<void*>(ptr));
    });

    m.def("copy_to_device", &staged_copy, nb::arg("src").noconvert(), nb::arg("dst").noconvert(),
          nb::arg("stream"),
          "Copies host bytes to dst (CUDA or CPU) through the pinned staging ring. Returns once src "
          "has been read; a CUDA copy completes in `stream` order.");
    m.def("configure_staging", &configure_default_staging_ring, nb::arg("slot_bytes"), nb::arg("slots"),
          "Sizes the staging ring before its first use; False if it already exists.");
    m.def("staging_stats", [] {
        StagingRing& ring = default_staging_ring();
        StagingStats s = ring.stats();
        nb::dict d;
        d["copies"] = s.copies;
        d["bytes"] = s.bytes;
        d["slot_waits"] = s.slot_waits;
        d["slot_bytes"] = ring.slot_bytes();
        d["slots"] = ring.slots();
        return d;
    });
    m.def("host_limits", &describe_host_limits);
    m.def("gather_rows", &gather_rows, nb::arg("table"), nb::arg("ids"), nb::arg("out").noconvert(),
          nb::arg("bad").noconvert(), nb::arg("stream"),
          "out[r] = table[ids[r]]: rows of a page-locked host table read by the device over the link, on `stream`.");
}
