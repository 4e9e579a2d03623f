// Device-side decoding shared by the dequantize kernels and the Hopper fused
// linear: the exact e4m3 -> fp32 conversion of scale and code bytes.
#pragma once

#include <cstdint>

namespace ts_quant {

// e4m3 byte -> fp32, branch-free and exact (equal to ts::fp8_e4m3_to_float):
// the 7 exponent/mantissa bits placed at fp32 bit 20 give the value times
// 2^-120 (fp32 denormals included), so one exact multiply by 2^120 restores it.
__device__ __forceinline__ float e4m3_value(uint32_t byte) {
    const uint32_t em = byte & 0x7fu;
    const float magnitude = __uint_as_float(em << 20) * 0x1p120f;
    const float v = (byte & 0x80u) ? -magnitude : magnitude;
    return em == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
}

}  // namespace ts_quant
