// FP8 activation quantization for Hopper's blockwise scaled matmul, in one
// kernel: x [M, K] (fp32, bf16 or fp16) -> e4m3 codes [Mp, K] and fp32 scales
// stored [K/128, Mp] (so scales.t() is the [Mp, K/128] outer-dim-major matrix
// torch's BlockWise1x128 recipe wants). Rows M..Mp-1 are padding: codes 0.
//
// One warp per 1x128 block, 4 values per lane. scale = max(amax / 448, 1e-30)
// and code = e4m3_rne(clamp(x / scale, +-448)), both divisions IEEE (__fdiv_rn),
// which is exactly what ts_quant._scaled.quantize_activation_1x128 computes.
#include <cuda_runtime.h>

#include "kernels.h"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

constexpr int kActThreads = 256;  // 8 warps, 8 blocks of 128 values per CTA

__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
    const float4 w = __ldg(reinterpret_cast<const float4*>(p));
    v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
}
__device__ __forceinline__ void load4(const Bf16* p, float (&v)[4]) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    v[0] = ts::bf16_to_float(w.x & 0xffffu), v[1] = ts::bf16_to_float(w.x >> 16);
    v[2] = ts::bf16_to_float(w.y & 0xffffu), v[3] = ts::bf16_to_float(w.y >> 16);
}
__device__ __forceinline__ void load4(const Fp16* p, float (&v)[4]) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    v[0] = ts::fp16_to_float(w.x & 0xffffu), v[1] = ts::fp16_to_float(w.x >> 16);
    v[2] = ts::fp16_to_float(w.y & 0xffffu), v[3] = ts::fp16_to_float(w.y >> 16);
}

template <class In>
__global__ void __launch_bounds__(kActThreads) fp8_act_quant_kernel(const In* __restrict__ x, uint8_t* __restrict__ codes,
                                                                    float* __restrict__ scales, int64_t m,
                                                                    int64_t mp, int64_t k) {
    const int64_t kb = k / 128;
    const int64_t block = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;  // row * kb + kblock
    const int lane = threadIdx.x & 31;
    if (block >= mp * kb) return;  // whole warps leave together: block is warp-uniform
    const int64_t row = block / kb, col = (block - row * kb) * 128 + lane * 4;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (row < m) load4(x + row * k + col, v);
    // amax with NaN propagation (torch's amax returns NaN when a NaN is present)
    float amax = 0.0f;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        nan |= v[i] != v[i];
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        nan |= __shfl_xor_sync(0xffffffffu, int(nan), off) != 0;
    }
    float scale = fmaxf(__fdiv_rn(amax, 448.0f), 1e-30f);
    if (nan) scale = __uint_as_float(0x7fc00000u);
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float c = __fdiv_rn(v[i], scale);
        c = c != c ? c : fminf(fmaxf(c, -448.0f), 448.0f);
        packed |= uint32_t(ts::float_to_fp8_e4m3(c)) << (8 * i);
    }
    *reinterpret_cast<uint32_t*>(codes + row * k + col) = packed;
    if (lane == 0) scales[(block - row * kb) * mp + row] = scale;
}


}  // namespace

void fp8_act_quant_cuda(const void* x, ts::ScalarKind kind, uint8_t* codes, float* scales, int64_t m, int64_t mp,
                        int64_t k, int device, uintptr_t stream) {
    ts::CudaDeviceGuard scope(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int64_t warps = mp * (k / 128);
    if (warps == 0) return;
    const int64_t grid = (warps * 32 + kActThreads - 1) / kActThreads;
    TS_CHECK_ARG(grid < (int64_t(1) << 31), "fp8 activation quantization: input too large");
    switch (kind) {
        case ts::ScalarKind::float32:
            fp8_act_quant_kernel<float><<<unsigned(grid), kActThreads, 0, s>>>(static_cast<const float*>(x), codes, scales, m, mp, k);
            break;
        case ts::ScalarKind::bfloat16:
            fp8_act_quant_kernel<Bf16><<<unsigned(grid), kActThreads, 0, s>>>(static_cast<const Bf16*>(x), codes, scales, m, mp, k);
            break;
        case ts::ScalarKind::float16:
            fp8_act_quant_kernel<Fp16><<<unsigned(grid), kActThreads, 0, s>>>(static_cast<const Fp16*>(x), codes, scales, m, mp, k);
            break;
        default: ts::throw_value_error("fp8 activation quantization: x must be float32, bfloat16 or float16");
    }
    TS_CUDA_CHECK_LAUNCH();
}

}  // namespace ts_quant
