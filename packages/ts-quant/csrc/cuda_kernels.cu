// CUDA kernels, enqueued on the caller's stream; nothing here synchronizes.
//
// Quantize runs one thread per block (fp8: per tile) through the same
// block routine as the CPU, so the bytes match the CPU's exactly. Dequantize
// is bandwidth-bound and vectorized: each thread decodes a chunk of 16
// consecutive values from one 16-byte (int8, fp8) or 8-byte (nf4, nvfp4) load
// and writes them with 16-byte stores.
#include <cuda_runtime.h>

#include "kernels.h"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 16;  // values per thread in the vectorized dequantize

__constant__ float kNf4Codes[16] = {TS_QUANT_NF4_CODES};

// Makes `device` current for the scope (the caller's tensors live there).
struct DeviceGuard {
    int previous = -1;
    explicit DeviceGuard(int device) {
        TS_CUDA_CHECK(cudaGetDevice(&previous));
        if (previous != device) TS_CUDA_CHECK(cudaSetDevice(device));
    }
    ~DeviceGuard() {
        int current = -1;
        if (cudaGetDevice(&current) == cudaSuccess && current != previous) cudaSetDevice(previous);
    }
};

unsigned grid_for(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

template <class In>
__global__ void quantize_kernel(Geometry geo, const In* __restrict__ x, uint8_t* __restrict__ data, void* scales,
                                const float* __restrict__ global_scale) {
    const int64_t slot = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (slot >= geo.scale_count()) return;
    if (geo.format == Format::fp8) {
        quantize_fp8_tile(geo, x, slot, data, static_cast<float*>(scales));
        return;
    }
    const Nf4Bounds bounds;
    const float g = global_scale ? *global_scale : 0.0f;
    quantize_flat_block(geo, x, slot, data, scales, g, bounds);
}

__device__ __forceinline__ void load_nf4_table(float* table) {
    if (threadIdx.x < 16) table[threadIdx.x] = kNf4Codes[threadIdx.x];
    __syncthreads();
}

// Generic path: one value per thread (misaligned pointers, chunk tails).
template <class Out>
__global__ void dequantize_scalar_kernel(Geometry geo, const uint8_t* __restrict__ data, const void* __restrict__ scales,
                                         const float* __restrict__ global_scale, Out* __restrict__ out,
                                         int64_t begin) {
    __shared__ float table[16];
    load_nf4_table(table);
    const int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= geo.n) return;
    const float g = global_scale ? *global_scale : 0.0f;
    const float s = slot_scale(geo, scales, geo.scale_index(i), g);
    store_float(decode_element(geo, data, i, s, table), out + i);
}

template <Format F>
__device__ __forceinline__ float decode_local(const uint8_t* bytes, int k, float scale, const float* table) {
    if constexpr (F == Format::int8) return int8_decode(bytes[k], scale);
    if constexpr (F == Format::fp8) return fp8_decode(bytes[k], scale);
    const uint8_t byte = bytes[k >> 1];
    if constexpr (F == Format::nf4) return table[(k & 1) ? (byte & 0x0f) : (byte >> 4)] * scale;
    return e2m1_decode((k & 1) ? (byte >> 4) : (byte & 0x0f)) * scale;
}

// Vectorized path. `Uniform`: all 16 values of a chunk share one scale slot.
template <Format F, bool Uniform, class Out>
__global__ void dequantize_vec_kernel(Geometry geo, const uint8_t* __restrict__ data, const void* __restrict__ scales,
                                      const float* __restrict__ global_scale, Out* __restrict__ out, int64_t chunks) {
    __shared__ float table[16];
    if constexpr (F == Format::nf4) load_nf4_table(table);
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= chunks) return;
    constexpr bool four_bit = F == Format::nf4 || F == Format::nvfp4;
    union {
        uint4 v;
        uint2 h;
        uint8_t b[16];
    } in;
    if constexpr (four_bit) {
        in.h = __ldg(reinterpret_cast<const uint2*>(data) + c);
    } else {
        in.v = __ldg(reinterpret_cast<const uint4*>(data) + c);
    }
    const float g = F == Format::nvfp4 ? __ldg(global_scale) : 0.0f;
    const int64_t i0 = c * kChunk;
    union {
        Out o[kChunk];
        uint4 v[kChunk * sizeof(Out) / 16];
    } res;
    if constexpr (Uniform) {
        const float s = slot_scale(geo, scales, geo.scale_index(i0), g);
#pragma unroll
        for (int k = 0; k < kChunk; ++k) store_float(decode_local<F>(in.b, k, s, table), &res.o[k]);
    } else {
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
            const float s = slot_scale(geo, scales, geo.scale_index(i0 + k), g);
            store_float(decode_local<F>(in.b, k, s, table), &res.o[k]);
        }
    }
    uint4* dst = reinterpret_cast<uint4*>(out + i0);
#pragma unroll
    for (int k = 0; k < int(kChunk * sizeof(Out) / 16); ++k) dst[k] = res.v[k];
}

template <class In>
void quantize_launch(const Geometry& geo, const In* x, uint8_t* data, void* scales, const float* g, cudaStream_t s) {
    const int64_t slots = geo.scale_count();
    quantize_kernel<In><<<grid_for(slots), kThreads, 0, s>>>(geo, x, data, scales, g);
    TS_CUDA_CHECK_LAUNCH();
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <Format F, class Out>
void dequantize_format(const Geometry& geo, const uint8_t* data, const void* scales, const float* g, Out* out,
                       cudaStream_t s) {
    constexpr bool four_bit = F == Format::nf4 || F == Format::nvfp4;
    int64_t chunks = geo.n / kChunk;
    if (!aligned(data, four_bit ? 8 : 16) || !aligned(out, 16)) chunks = 0;
    if (chunks > 0) {
        const bool uniform = F == Format::fp8 ? (geo.cols % kChunk == 0 && geo.block % kChunk == 0)
                                              : geo.block % kChunk == 0;
        if (uniform) {
            dequantize_vec_kernel<F, true, Out><<<grid_for(chunks), kThreads, 0, s>>>(geo, data, scales, g, out, chunks);
        } else {
            dequantize_vec_kernel<F, false, Out><<<grid_for(chunks), kThreads, 0, s>>>(geo, data, scales, g, out, chunks);
        }
        TS_CUDA_CHECK_LAUNCH();
    }
    const int64_t rest = geo.n - chunks * kChunk;
    if (rest > 0) {
        dequantize_scalar_kernel<Out><<<grid_for(rest), kThreads, 0, s>>>(geo, data, scales, g, out, chunks * kChunk);
        TS_CUDA_CHECK_LAUNCH();
    }
}

template <class Out>
void dequantize_typed(const Geometry& geo, const uint8_t* data, const void* scales, const float* g, Out* out,
                      cudaStream_t s) {
    switch (geo.format) {
        case Format::int8: return dequantize_format<Format::int8>(geo, data, scales, g, out, s);
        case Format::nf4: return dequantize_format<Format::nf4>(geo, data, scales, g, out, s);
        case Format::fp8: return dequantize_format<Format::fp8>(geo, data, scales, g, out, s);
        case Format::nvfp4: return dequantize_format<Format::nvfp4>(geo, data, scales, g, out, s);
    }
}

}  // namespace

void quantize_cuda(const Geometry& geo, const void* x, ts::ScalarKind in_kind, uint8_t* data, void* scales,
                   const float* global_scale, int device, uintptr_t stream) {
    DeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    switch (in_kind) {
        case ts::ScalarKind::float32: return quantize_launch(geo, static_cast<const float*>(x), data, scales, global_scale, s);
        case ts::ScalarKind::bfloat16: return quantize_launch(geo, static_cast<const Bf16*>(x), data, scales, global_scale, s);
        case ts::ScalarKind::float16: return quantize_launch(geo, static_cast<const Fp16*>(x), data, scales, global_scale, s);
        default: ts::throw_value_error("quantize: input dtype must be float32, bfloat16 or float16");
    }
}

void dequantize_cuda(const Geometry& geo, const uint8_t* data, const void* scales, const float* global_scale,
                     void* out, ts::ScalarKind out_kind, int device, uintptr_t stream) {
    DeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    switch (out_kind) {
        case ts::ScalarKind::float32: return dequantize_typed(geo, data, scales, global_scale, static_cast<float*>(out), s);
        case ts::ScalarKind::bfloat16: return dequantize_typed(geo, data, scales, global_scale, static_cast<Bf16*>(out), s);
        case ts::ScalarKind::float16: return dequantize_typed(geo, data, scales, global_scale, static_cast<Fp16*>(out), s);
        default: ts::throw_value_error("dequantize: output dtype must be float32, bfloat16 or float16");
    }
}

}  // namespace ts_quant
