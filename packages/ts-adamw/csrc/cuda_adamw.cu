// Multi-tensor AdamW on the GPU. Up to kMaxTensors tensors per launch travel
// in a table passed as a __grid_constant__ kernel parameter (no device
// allocation, no copy); blocks walk fixed tiles of kTile elements grid-stride
// over all tensors of the table. Each thread moves 4 elements per iteration
// with 16-byte (fp32) or 8-byte (16-bit) loads when the tensor is aligned.
//
// Pointers may be device memory or mapped page-locked host memory ("zero
// copy": the same kernel then reads and writes the host over the link).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <vector>

#include "cuda_adamw.h"
#include "ts/cuda_check.h"

namespace ts_adamw {

namespace {

constexpr int kMaxTensors = 32;
constexpr int kThreads = 256;
constexpr int kVec = 4;
// Divides 2^32: a tile of a tensor whose first rounding index is a multiple of it never straddles a
// hash window; a piece starting elsewhere may have one tile that does (handled per element).
constexpr int64_t kTile = 4096;

struct Table {
    float* param[kMaxTensors];
    const void* grad[kMaxTensors];
    void* exp_avg[kMaxTensors];
    void* exp_avg_sq[kMaxTensors];
    void* out[kMaxTensors];
    int64_t n[kMaxTensors];
    int64_t first[kMaxTensors];  // index of element 0 in its tensor's rounding stream (Segment::first_index)
    int64_t tile_start[kMaxTensors + 1];
    uint32_t key[kMaxTensors];
    bool aligned[kMaxTensors];
    int count;
};

// The table and Hyper travel as kernel parameters: keep them well under the classic 4 KiB limit.
static_assert(sizeof(Table) == 2224, "Table is 2224 bytes (32 tensors); recheck the kernel-parameter budget");
static_assert(sizeof(Table) + sizeof(Hyper) <= 4096, "kernel parameters must stay under 4 KiB");

template <Kind K>
struct Storage {
    using type = uint16_t;
};
template <>
struct Storage<Kind::f32> {
    using type = float;
};

// Loads 4 consecutive elements starting at i (i % 4 == 0, pointer aligned).
template <Kind K>
__device__ __forceinline__ void load4(const void* ptr, int64_t i, float (&x)[kVec]) {
    if constexpr (K == Kind::f32) {
        float4 q = reinterpret_cast<const float4*>(ptr)[i / kVec];
        x[0] = q.x, x[1] = q.y, x[2] = q.z, x[3] = q.w;
    } else {
        uint2 q = reinterpret_cast<const uint2*>(ptr)[i / kVec];
        uint16_t h[kVec] = {uint16_t(q.x), uint16_t(q.x >> 16), uint16_t(q.y), uint16_t(q.y >> 16)};
#pragma unroll
        for (int j = 0; j < kVec; ++j) x[j] = K == Kind::bf16 ? bf16_load(h[j]) : f16_load(h[j]);
    }
}

__device__ __forceinline__ void store4_bits(void* ptr, int64_t i, const uint16_t (&h)[kVec]) {
    uint2 q;
    q.x = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
    q.y = uint32_t(h[2]) | (uint32_t(h[3]) << 16);
    reinterpret_cast<uint2*>(ptr)[i / kVec] = q;
}

__device__ __forceinline__ void store4_f32(void* ptr, int64_t i, const float (&x)[kVec]) {
    reinterpret_cast<float4*>(ptr)[i / kVec] = make_float4(x[0], x[1], x[2], x[3]);
}

template <Kind OK>
__device__ __forceinline__ void store4_out(void* ptr, int64_t i, const float (&x)[kVec]) {
    if constexpr (OK == Kind::f32) {
        store4_f32(ptr, i, x);
    } else if constexpr (OK != Kind::none) {
        uint16_t h[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) h[j] = OK == Kind::bf16 ? bf16_round(x[j]) : f16_round(x[j]);
        store4_bits(ptr, i, h);
    }
}

// `lo0`: the low 32 bits of the tensor's first rounding index; `wkey`: the window key of element i's
// index (first + i) >> 32. Element i hashes the low 32 bits of first + i, as the host kernels do.
template <Kind GK, Kind MK, Kind OK>
__device__ __forceinline__ void update_one(const Hyper& h, const Table& t, int k, int64_t i, uint32_t lo0,
                                           uint32_t wkey) {
    float p = t.param[k][i];
    float g = load_as_float<GK>(static_cast<const typename Storage<GK>::type*>(t.grad[k]), i);
    float m = load_as_float<MK>(static_cast<const typename Storage<MK>::type*>(t.exp_avg[k]), i);
    float v = load_as_float<MK>(static_cast<const typename Storage<MK>::type*>(t.exp_avg_sq[k]), i);
    update(h, g, p, m, v);
    t.param[k][i] = p;
    if constexpr (MK == Kind::f32) {
        static_cast<float*>(t.exp_avg[k])[i] = m;
        static_cast<float*>(t.exp_avg_sq[k])[i] = v;
    } else {
        uint32_t r = mix32((lo0 + uint32_t(i)) ^ wkey);
        static_cast<uint16_t*>(t.exp_avg[k])[i] = bf16_stochastic(m, r);
        static_cast<uint16_t*>(t.exp_avg_sq[k])[i] = bf16_stochastic(v, r >> 16);
    }
    if constexpr (OK != Kind::none) store_nearest<OK>(t.out[k], i, p);
}

template <Kind GK, Kind MK, Kind OK>
__device__ __forceinline__ void update_four(const Hyper& h, const Table& t, int k, int64_t i, uint32_t lo0,
                                            uint32_t wkey) {
    float p[kVec], g[kVec], m[kVec], v[kVec];
    load4<Kind::f32>(t.param[k], i, p);
    load4<GK>(t.grad[k], i, g);
    load4<MK>(t.exp_avg[k], i, m);
    load4<MK>(t.exp_avg_sq[k], i, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) update(h, g[j], p[j], m[j], v[j]);
    store4_f32(t.param[k], i, p);
    if constexpr (MK == Kind::f32) {
        store4_f32(t.exp_avg[k], i, m);
        store4_f32(t.exp_avg_sq[k], i, v);
    } else {
        uint16_t mb[kVec], vb[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
            uint32_t r = mix32((lo0 + uint32_t(i + j)) ^ wkey);
            mb[j] = bf16_stochastic(m[j], r);
            vb[j] = bf16_stochastic(v[j], r >> 16);
        }
        store4_bits(t.exp_avg[k], i, mb);
        store4_bits(t.exp_avg_sq[k], i, vb);
    }
    store4_out<OK>(t.out[k], i, p);
}

template <Kind GK, Kind MK, Kind OK>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ Table t, const Hyper h) {
    const int64_t tiles = t.tile_start[t.count];
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int k = 0;
        while (k + 1 < t.count && t.tile_start[k + 1] <= tile) ++k;
        const int64_t base = (tile - t.tile_start[k]) * kTile;
        const int64_t end = min(base + kTile, t.n[k]);
        const uint64_t first = uint64_t(t.first[k]);
        const uint32_t lo0 = uint32_t(first);
        const uint32_t hi = uint32_t((first + uint64_t(base)) >> 32);
        if (MK == Kind::bf16 && hi != uint32_t((first + uint64_t(end - 1)) >> 32)) {
            // The tile's rounding indices cross a 2^32 boundary: each element takes its own window's key.
            for (int64_t i = base + threadIdx.x; i < end; i += kThreads)
                update_one<GK, MK, OK>(h, t, k, i, lo0, window_key(t.key[k], uint32_t((first + uint64_t(i)) >> 32)));
            continue;
        }
        const uint32_t wkey = window_key(t.key[k], hi);
        if (t.aligned[k]) {
            for (int64_t i = base + int64_t(threadIdx.x) * kVec; i < end; i += int64_t(kThreads) * kVec) {
                if (i + kVec <= end) {
                    update_four<GK, MK, OK>(h, t, k, i, lo0, wkey);
                } else {
                    for (int64_t e = i; e < end; ++e) update_one<GK, MK, OK>(h, t, k, e, lo0, wkey);
                }
            }
        } else {
            for (int64_t i = base + threadIdx.x; i < end; i += kThreads)
                update_one<GK, MK, OK>(h, t, k, i, lo0, wkey);
        }
    }
}

bool aligned_to(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

bool vector_aligned(const Segment& s, Kind mk) {
    const size_t mvec = kind_bytes(mk) * kVec;
    return aligned_to(s.param, 16) && aligned_to(s.grad, kind_bytes(s.grad_kind) * kVec) &&
           aligned_to(s.exp_avg, mvec) && aligned_to(s.exp_avg_sq, mvec) &&
           (s.out == nullptr || aligned_to(s.out, kind_bytes(s.out_kind) * kVec));
}

int multiprocessors() {
    int device = 0;
    TS_CUDA_CHECK(cudaGetDevice(&device));
    int sms = 0;
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return std::max(1, sms);
}

template <Kind GK, Kind MK, Kind OK>
void launch_table(const Table& t, const Hyper& h, cudaStream_t stream, int sms) {
    const int64_t tiles = t.tile_start[t.count];
    if (tiles == 0) return;
    // Eight 256-thread blocks per SM fill it; more tiles are walked grid-stride.
    const int blocks = int(std::min<int64_t>(tiles, int64_t(sms) * 8));
    adamw_kernel<GK, MK, OK><<<blocks, kThreads, 0, stream>>>(t, h);
    TS_CUDA_CHECK_LAUNCH();
}

template <Kind GK, Kind MK>
void launch_out(Kind ok, const Table& t, const Hyper& h, cudaStream_t s, int sms) {
    switch (ok) {
        case Kind::f32: return launch_table<GK, MK, Kind::f32>(t, h, s, sms);
        case Kind::bf16: return launch_table<GK, MK, Kind::bf16>(t, h, s, sms);
        case Kind::f16: return launch_table<GK, MK, Kind::f16>(t, h, s, sms);
        default: return launch_table<GK, MK, Kind::none>(t, h, s, sms);
    }
}

template <Kind GK>
void launch_moment(Kind mk, Kind ok, const Table& t, const Hyper& h, cudaStream_t s, int sms) {
    if (mk == Kind::bf16) launch_out<GK, Kind::bf16>(ok, t, h, s, sms);
    else launch_out<GK, Kind::f32>(ok, t, h, s, sms);
}

void launch(Kind gk, Kind mk, Kind ok, const Table& t, const Hyper& h, cudaStream_t s, int sms) {
    switch (gk) {
        case Kind::bf16: return launch_moment<Kind::bf16>(mk, ok, t, h, s, sms);
        case Kind::f16: return launch_moment<Kind::f16>(mk, ok, t, h, s, sms);
        default: return launch_moment<Kind::f32>(mk, ok, t, h, s, sms);
    }
}

}  // namespace

void launch_cuda_step(const Plan& plan, uintptr_t stream_handle) {
    cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
    const int sms = multiprocessors();
    // One launch per (grad dtype, out dtype) group and per kMaxTensors tensors.
    constexpr int kKinds = 4;
    std::array<std::vector<const Segment*>, kKinds * kKinds> groups;
    for (const Segment& s : plan.segments)
        if (s.n > 0) groups[int(s.grad_kind) * kKinds + int(s.out_kind)].push_back(&s);
    for (int gi = 0; gi < kKinds * kKinds; ++gi) {
        const auto& group = groups[gi];
        for (size_t first = 0; first < group.size(); first += kMaxTensors) {
            Table t{};
            t.count = int(std::min<size_t>(kMaxTensors, group.size() - first));
            t.tile_start[0] = 0;
            for (int k = 0; k < t.count; ++k) {
                const Segment& s = *group[first + k];
                t.param[k] = s.param;
                t.grad[k] = s.grad;
                t.exp_avg[k] = s.exp_avg;
                t.exp_avg_sq[k] = s.exp_avg_sq;
                t.out[k] = s.out;
                t.n[k] = s.n;
                t.first[k] = s.first_index;
                t.key[k] = s.key;
                t.aligned[k] = vector_aligned(s, plan.moment_kind);
                t.tile_start[k + 1] = t.tile_start[k] + (s.n + kTile - 1) / kTile;
            }
            launch(Kind(gi / kKinds), plan.moment_kind, Kind(gi % kKinds), t, plan.hyper, stream, sms);
        }
    }
}

}  // namespace ts_adamw
