// Scalar conversions for the 16- and 8-bit floating formats, usable on the
// host and (with TS_HOST_DEVICE) in CUDA kernels. Bit-level, so they match
// torch's own rounding: round to nearest even, NaN preserved.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TS_HOST_DEVICE inline
#endif

namespace ts {

TS_HOST_DEVICE uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(value);
#else
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    return bits;
#endif
}

TS_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

// ---- bfloat16 ----------------------------------------------------------

TS_HOST_DEVICE float bf16_to_float(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }

TS_HOST_DEVICE uint16_t float_to_bf16(float value) {
    uint32_t bits = float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t((bits + rounding) >> 16);
}

// Stochastic rounding: adds 16 random low bits before truncating, so the
// expected value of the result equals the input (unbiased).
TS_HOST_DEVICE uint16_t float_to_bf16_stochastic(float value, uint32_t random16) {
    uint32_t bits = float_bits(value);
    if ((bits & 0x7f800000u) == 0x7f800000u) return float_to_bf16(value);  // inf / NaN
    return uint16_t((bits + (random16 & 0xffffu)) >> 16);
}

// ---- float16 -----------------------------------------------------------

TS_HOST_DEVICE float fp16_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        if (mantissa == 0) return bits_float(sign);
        // subnormal: value = mantissa * 2^-24
        float magnitude = float(mantissa) * 5.9604644775390625e-08f;
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

TS_HOST_DEVICE uint16_t float_to_fp16(float value) {
    uint32_t bits = float_bits(value);
    uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);         // NaN
    if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);        // overflow -> inf
    if (abs < 0x38800000u) {                                        // subnormal or zero
        // Scale into the subnormal grid; float addition rounds to nearest even.
        // Adding 0.5 (whose float ulp is 2^-24) rounds onto the subnormal grid.
        float magnitude = bits_float(abs) + 0.5f;
        return uint16_t(sign | (float_bits(magnitude) - 0x3f000000u));
    }
    uint32_t rounding = 0xfffu + ((abs >> 13) & 1u);
    return uint16_t(sign | ((abs - 0x38000000u + rounding) >> 13));
}

// ---- float8 e4m3 (OCP "e4m3fn": no inf, NaN = 0x7f / 0xff, max 448) -----

TS_HOST_DEVICE float fp8_e4m3_to_float(uint8_t v) {
    uint32_t sign = uint32_t(v & 0x80u) << 24;
    uint32_t exponent = (v >> 3) & 0xfu;
    uint32_t mantissa = v & 0x7u;
    if (exponent == 0xf && mantissa == 0x7) return bits_float(sign | 0x7fc00000u);
    if (exponent == 0) {
        float magnitude = float(mantissa) * 0.001953125f;  // 2^-9
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | ((exponent + 120) << 23) | (mantissa << 20));
}

// Round to nearest even, saturating to +-448 (torch's float8_e4m3fn cast
// saturates only under explicit clamping; callers here always scale first).
TS_HOST_DEVICE uint8_t float_to_fp8_e4m3(float value) {
    uint32_t bits = float_bits(value);
    uint8_t sign = uint8_t((bits >> 24) & 0x80u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return uint8_t(sign | 0x7fu);
    if (abs >= 0x43e00000u) return uint8_t(sign | 0x7eu);          // >= 448: saturate
    if (abs < 0x3c800000u) {                                       // below 2^-6: subnormal grid 2^-9
        // Adding 2^14 (whose float ulp is 2^-9) rounds onto the subnormal grid.
        float magnitude = bits_float(abs) + 16384.0f;
        return uint8_t(sign | uint8_t(float_bits(magnitude) - 0x46800000u));
    }
    uint32_t rounding = 0x7ffffu + ((abs >> 20) & 1u);
    uint32_t rounded = abs + rounding;
    return uint8_t(sign | uint8_t(((rounded >> 20) - (120u << 3)) & 0x7fu));
}

}  // namespace ts
