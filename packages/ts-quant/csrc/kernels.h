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

}  // namespace ts_quant
