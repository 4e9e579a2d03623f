// Host AdamW kernels. One plain loop per (grad, moment, out) dtype combination,
// written so the compiler vectorizes it (branch-free conversions, restrict
// pointers, no FMA contraction), compiled for three ISAs and chosen at run
// time. Checked with -fopt-info-vec and in the disassembly (zmm code in the
// AVX-512 variant).
#include "host_adamw.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>

#include "host_stream.h"
#include "isa.h"
#include "ts/errors.h"
#include "ts/thread_pool.h"

namespace ts_adamw {

namespace {

template <Kind K>
using storage_t = std::conditional_t<K == Kind::f32 || K == Kind::none, float, uint16_t>;

template <Kind GK, Kind MK, Kind OK, bool Small>
inline __attribute__((always_inline)) void update_loop_with(const Hyper& hyper, float* __restrict p,
                                                       const storage_t<GK>* __restrict g,
                                                       storage_t<MK>* __restrict m, storage_t<MK>* __restrict v,
                                                       storage_t<OK>* __restrict out, int64_t n, uint32_t idx0,
                                                       uint32_t key) {
    const Hyper h = hyper;  // local copy: no aliasing with the arrays
    for (int64_t i = 0; i < n; ++i) {
        float gi = load_as_float<GK>(g, i);
        float pi = p[i];
        float mi, vi;
        if constexpr (MK == Kind::f32) {
            mi = m[i];
            vi = v[i];
        } else {
            mi = bf16_load(m[i]);
            vi = bf16_load(v[i]);
        }
        update_with<Small>(h, gi, pi, mi, vi);
        p[i] = pi;
        if constexpr (MK == Kind::f32) {
            m[i] = mi;
            v[i] = vi;
        } else {
            uint32_t r = mix32((idx0 + uint32_t(i)) ^ key);
            m[i] = bf16_stochastic(mi, r);
            v[i] = bf16_stochastic(vi, r >> 16);
        }
        if constexpr (OK != Kind::none) store_nearest<OK>(out, i, pi);
    }
}

template <Kind GK, Kind MK, Kind OK>
inline __attribute__((always_inline)) void update_loop(const Hyper& h, float* p, const storage_t<GK>* g,
                                                       storage_t<MK>* m, storage_t<MK>* v, storage_t<OK>* out,
                                                       int64_t n, uint32_t idx0, uint32_t key) {
    if (h.lerp_small) update_loop_with<GK, MK, OK, true>(h, p, g, m, v, out, n, idx0, key);
    else update_loop_with<GK, MK, OK, false>(h, p, g, m, v, out, n, idx0, key);
}

using KernelFn = void (*)(const Hyper&, float*, const void*, void*, void*, void*, int64_t, uint32_t, uint32_t);

#define TSA_DEFINE_VARIANT(NAME, TARGET)                                                                     \
    template <Kind GK, Kind MK, Kind OK>                                                                     \
    TARGET void NAME(const Hyper& h, float* p, const void* g, void* m, void* v, void* out, int64_t n,       \
                     uint32_t idx0, uint32_t key) {                                                          \
        update_loop<GK, MK, OK>(h, p, static_cast<const storage_t<GK>*>(g), static_cast<storage_t<MK>*>(m), \
                                static_cast<storage_t<MK>*>(v), static_cast<storage_t<OK>*>(out), n, idx0,  \
                                key);                                                                        \
    }

TSA_DEFINE_VARIANT(kernel_baseline, )
TSA_DEFINE_VARIANT(kernel_avx2, TSA_TARGET_AVX2)
TSA_DEFINE_VARIANT(kernel_avx512, TSA_TARGET_AVX512)

template <Kind GK, Kind MK, Kind OK>
KernelFn pick_isa(Isa isa) {
    switch (isa) {
        case Isa::avx512: return &kernel_avx512<GK, MK, OK>;
        case Isa::avx2: return &kernel_avx2<GK, MK, OK>;
        default: return &kernel_baseline<GK, MK, OK>;
    }
}

template <Kind GK, Kind MK>
KernelFn pick_out(Kind ok, Isa isa) {
    switch (ok) {
        case Kind::f32: return pick_isa<GK, MK, Kind::f32>(isa);
        case Kind::bf16: return pick_isa<GK, MK, Kind::bf16>(isa);
        case Kind::f16: return pick_isa<GK, MK, Kind::f16>(isa);
        default: return pick_isa<GK, MK, Kind::none>(isa);
    }
}

template <Kind GK>
KernelFn pick_moment(Kind mk, Kind ok, Isa isa) {
    return mk == Kind::bf16 ? pick_out<GK, Kind::bf16>(ok, isa) : pick_out<GK, Kind::f32>(ok, isa);
}

KernelFn pick_kernel(Kind gk, Kind mk, Kind ok, Isa isa) {
    switch (gk) {
        case Kind::bf16: return pick_moment<Kind::bf16>(mk, ok, isa);
        case Kind::f16: return pick_moment<Kind::f16>(mk, ok, isa);
        default: return pick_moment<Kind::f32>(mk, ok, isa);
    }
}

// Elements per pool chunk at least: 32K elements is ~1 MB of traffic.
constexpr int64_t kGrain = int64_t(1) << 15;

// Streaming (non-temporal) stores for params_out: -1 auto, 0 off, 1 on.
std::atomic<int> streaming_mode{-1};

// Auto mode streams params_out when the call writes at least this many bytes
// of it: a copy that large leaves the last-level cache before the host-to-GPU
// copy reads it anyway, so the write-allocate read (2 bytes per bf16 weight)
// is pure waste. Smaller outputs keep ordinary stores and stay in cache.
constexpr int64_t kStreamOutBytes = int64_t(32) << 20;

// params_out goes through an L1-resident buffer of this many elements, then to
// memory with streaming stores (the kernels stay plain vectorized loops).
constexpr int64_t kOutBlock = 2048;

// One window piece: the kernel over `n` elements, params_out written either
// directly or, when `stream`, in aligned blocks through streaming stores.
void run_window(const Plan& plan, KernelFn fn, float* p, const char* g, char* m, char* v, char* out, int64_t n,
                uint32_t lo, uint32_t key, size_t gb, size_t mb, size_t ob, bool stream) {
    if (!stream || out == nullptr || reinterpret_cast<uintptr_t>(out) % ob != 0) {
        fn(plan.hyper, p, g, m, v, out, n, lo, key);
        return;
    }
    const uintptr_t misalign = reinterpret_cast<uintptr_t>(out) % 64;
    const int64_t head = std::min<int64_t>(n, int64_t((64 - misalign) % 64 / ob));
    if (head > 0) fn(plan.hyper, p, g, m, v, out, head, lo, key);
    alignas(64) unsigned char buffer[kOutBlock * 4];
    int64_t i = head;
    for (; i + kOutBlock <= n; i += kOutBlock) {
        fn(plan.hyper, p + i, g + i * gb, m + i * mb, v + i * mb, buffer, kOutBlock, lo + uint32_t(i), key);
        nt_copy(out + i * ob, buffer, kOutBlock * int64_t(ob));
    }
    if (i < n) fn(plan.hyper, p + i, g + i * gb, m + i * mb, v + i * mb, out + i * ob, n - i, lo + uint32_t(i), key);
    stream_fence();
}

// Runs elements [local, local+count) of one segment, split at 2^32-element
// windows of the rounding index s.first_index + local (the stochastic-rounding
// counter is 32-bit inside a window).
void run_piece(const Plan& plan, const Segment& s, KernelFn fn, int64_t local, int64_t count, bool stream) {
    const size_t gb = kind_bytes(s.grad_kind), mb = kind_bytes(plan.moment_kind), ob = kind_bytes(s.out_kind);
    while (count > 0) {
        const uint64_t index = uint64_t(s.first_index + local);
        const uint32_t lo = uint32_t(index);
        const uint32_t hi = uint32_t(index >> 32);
        const int64_t piece = std::min<int64_t>(count, (int64_t(1) << 32) - int64_t(lo));
        auto* g = static_cast<const char*>(s.grad) + size_t(local) * gb;
        auto* m = static_cast<char*>(s.exp_avg) + size_t(local) * mb;
        auto* v = static_cast<char*>(s.exp_avg_sq) + size_t(local) * mb;
        char* out = s.out ? static_cast<char*>(s.out) + size_t(local) * ob : nullptr;
        run_window(plan, fn, s.param + local, g, m, v, out, piece, lo, window_key(s.key, hi), gb, mb, ob, stream);
        local += piece;
        count -= piece;
    }
}

}  // namespace

void run_host_step(const Plan& plan) {
    const size_t count = plan.segments.size();
    std::vector<int64_t> start(count + 1, 0);
    std::vector<KernelFn> fns(count);
    const Isa isa = active_isa();
    for (size_t i = 0; i < count; ++i) {
        const Segment& s = plan.segments[i];
        start[i + 1] = start[i] + s.n;
        fns[i] = pick_kernel(s.grad_kind, plan.moment_kind, s.out_kind, isa);
    }
    const int64_t total = start[count];
    int64_t out_bytes = 0;
    for (const Segment& s : plan.segments) out_bytes += s.out ? s.n * int64_t(kind_bytes(s.out_kind)) : 0;
    const int mode = streaming_mode.load(std::memory_order_relaxed);
    const bool stream = mode == 1 || (mode < 0 && out_bytes >= kStreamOutBytes);
    ts::host_pool().parallel_for(
        total, kGrain,
        [&](int64_t begin, int64_t end) {
            size_t seg = size_t(std::upper_bound(start.begin(), start.end(), begin) - start.begin()) - 1;
            for (; begin < end && seg < count; ++seg) {
                const int64_t stop = std::min(end, start[seg + 1]);
                if (stop <= begin) continue;
                run_piece(plan, plan.segments[seg], fns[seg], begin - start[seg], stop - begin, stream);
                begin = stop;
            }
        },
        plan.max_threads);
}

void set_streaming_stores(const std::string& mode) {
    if (mode == "auto") streaming_mode.store(-1);
    else if (mode == "on") streaming_mode.store(1);
    else if (mode == "off") streaming_mode.store(0);
    else ts::throw_value_error("streaming stores mode \"", mode, "\" is not one of auto, on, off");
}

std::string streaming_stores() {
    const int mode = streaming_mode.load();
    return mode < 0 ? "auto" : (mode ? "on" : "off");
}

}  // namespace ts_adamw
