// CUDA kernels, enqueued on the caller's stream; nothing here synchronizes.
//
// Quantize runs one thread per block (fp8: per tile) through the same
// block routine as the CPU, so the bytes match the CPU's exactly. Dequantize
// is bandwidth-bound: cuda_dequant.cuh decodes groups of 8 values per load
// and 16-byte store; a scalar kernel covers tails and misaligned views.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_decode.cuh"
#include "kernels.h"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

constexpr int kThreads = 256;

__constant__ float kNf4Codes[16] = {TS_QUANT_NF4_CODES};
__constant__ float kE2m1Signed[16] = {TS_QUANT_E2M1_SIGNED_VALUES};


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

#include "cuda_dequant.cuh"

template <class In>
void quantize_launch(const Geometry& geo, const In* x, uint8_t* data, void* scales, const float* g, cudaStream_t s) {
    const int64_t slots = geo.scale_count();
    quantize_kernel<In><<<grid_for(slots), kThreads, 0, s>>>(geo, x, data, scales, g);
    TS_CUDA_CHECK_LAUNCH();
}

template <Format F, class Out>
void dequantize_format(const Geometry& geo, const uint8_t* data, const void* scales, const float* g, Out* out,
                       cudaStream_t s) {
    const int64_t done = dequantize_groups<F, Out>(geo, data, scales, g, out, s);
    const int64_t rest = geo.n - done;
    if (rest > 0) {
        dequantize_scalar_kernel<Out><<<grid_for(rest), kThreads, 0, s>>>(geo, data, scales, g, out, done);
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
    ts::CudaDeviceGuard guard(device);
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
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    switch (out_kind) {
        case ts::ScalarKind::float32: return dequantize_typed(geo, data, scales, global_scale, static_cast<float*>(out), s);
        case ts::ScalarKind::bfloat16: return dequantize_typed(geo, data, scales, global_scale, static_cast<Bf16*>(out), s);
        case ts::ScalarKind::float16: return dequantize_typed(geo, data, scales, global_scale, static_cast<Fp16*>(out), s);
        default: ts::throw_value_error("dequantize: output dtype must be float32, bfloat16 or float16");
    }
}

}  // namespace ts_quant
