// Entry points of the quantize / dequantize kernels, on the host (threaded)
// and on CUDA (enqueued on the caller's stream, never synchronizing).
#pragma once

#include <cstdint>

#include "blocks.h"
#include "ts/ndarray.h"

namespace ts_quant {

// x: n values of `in_kind` (float32, bfloat16 or float16). data: packed codes.
// scales: fp32 (int8, nf4, fp8) or e4m3 bytes (nvfp4). global_scale: one fp32
// (NVFP4 only, else null), read where it lives: host memory for the CPU
// kernels, device memory for the CUDA kernels (no host sync).
void quantize_cpu(const Geometry& geo, const void* x, ts::ScalarKind in_kind, uint8_t* data, void* scales,
                  const float* global_scale);
void dequantize_cpu(const Geometry& geo, const uint8_t* data, const void* scales, const float* global_scale, void* out,
                    ts::ScalarKind out_kind);

void quantize_cuda(const Geometry& geo, const void* x, ts::ScalarKind in_kind, uint8_t* data, void* scales,
                   const float* global_scale, int device, uintptr_t stream);
void dequantize_cuda(const Geometry& geo, const uint8_t* data, const void* scales, const float* global_scale,
                     void* out, ts::ScalarKind out_kind, int device, uintptr_t stream);

// FP8 activations for the Hopper blockwise scaled matmul (cuda_act_quant.cu):
// x [m, k] -> codes [mp, k] (e4m3 bytes, rows m..mp-1 zero) and fp32 scales
// stored [k/128, mp]. k % 128 == 0, mp >= m. Enqueued on `stream`.
void fp8_act_quant_cuda(const void* x, ts::ScalarKind kind, uint8_t* codes, float* scales, int64_t m, int64_t mp,
                        int64_t k, int device, uintptr_t stream);

}  // namespace ts_quant
