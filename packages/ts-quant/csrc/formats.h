// Scalar rules of the four formats, shared by the CPU and the CUDA kernels so
// both write the same bytes. Every step is one IEEE fp32 operation in a fixed
// order; ts_quant/reference.py mirrors them op for op in plain PyTorch.
//
// Non-finite inputs: a block (or FP8 tile) that holds an inf or NaN gets a NaN
// scale and zero codes, so every value of that block dequantizes to NaN (loud,
// never a silently wrong finite weight). NVFP4's per-tensor scale is taken
// over the finite values only, so one bad block does not spoil the tensor.
#pragma once

#include <cstdint>

#include "ts/half.h"

namespace ts_quant {

enum class Format : int { int8 = 0, nf4 = 1, fp8 = 2, nvfp4 = 3 };

// bitsandbytes' NF4 code book (bitsandbytes/backends/utils.py, 0.50.2), as fp32.
#define TS_QUANT_NF4_CODES                                                                      \
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,                   \
        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,              \
        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, \
        0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f

// OCP FP4 e2m1 magnitudes for codes 0..7 (bit 3 is the sign).
#define TS_QUANT_E2M1_VALUES 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f
// All 16 e2m1 codes as signed values (code 8 is -0.0): the decode tables of the CUDA kernels.
#define TS_QUANT_E2M1_SIGNED_VALUES \
    TS_QUANT_E2M1_VALUES, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f

constexpr float kNvfp4Max = 6.0f;      // largest e2m1 magnitude
constexpr float kFp8Max = 448.0f;      // largest e4m3 magnitude
constexpr float kNvfp4TensorDiv = 2688.0f;  // 448 * 6: per-tensor scale = amax / this
constexpr uint8_t kFp8NaN = 0x7f;
constexpr int kNf4ZeroCode = 7;

TS_HOST_DEVICE bool is_finite(float v) {
    return (ts::float_bits(v) & 0x7f800000u) != 0x7f800000u;
}
TS_HOST_DEVICE float abs_f(float v) { return ts::bits_float(ts::float_bits(v) & 0x7fffffffu); }
TS_HOST_DEVICE float nan_f() { return ts::bits_float(0x7fc00000u); }

// max |x| over the finite values of a block, and whether any value was not finite.
struct Amax {
    float value = 0.0f;
    bool nonfinite = false;
    TS_HOST_DEVICE void add(float x) {
        if (!is_finite(x)) {
            nonfinite = true;
        } else {
            float a = abs_f(x);
            value = a > value ? a : value;
        }
    }
};

// ---- int8: symmetric absmax, q = round_half_even(x / (amax / 127)) ----------

TS_HOST_DEVICE float int8_scale(const Amax& a) { return a.nonfinite ? nan_f() : a.value / 127.0f; }

TS_HOST_DEVICE uint8_t int8_encode(float x, float scale) {
    if (!(scale > 0.0f)) return 0;  // all-zero block, underflowed or NaN scale
    float q = x / scale;
#if defined(__CUDA_ARCH__)
    q = rintf(q);
#else
    q = __builtin_rintf(q);  // default rounding mode: nearest even
#endif
    q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
    return static_cast<uint8_t>(static_cast<int8_t>(q));
}

TS_HOST_DEVICE float int8_decode(uint8_t q, float scale) {
    return static_cast<float>(static_cast<int8_t>(q)) * scale;
}

// ---- nf4: bitsandbytes quantize_4bit (0.50 CPU path) -----------------------
// Full blocks scale by the reciprocal of max(amax, 1e-38) and store amax; the
// partial last block divides by max(amax, 1e-38) and stores that clamped
// value. The code is the number of code midpoints strictly below the scaled
// value (torch.bucketize), so an exact midpoint goes to the lower code.

constexpr float kNf4TinyAbsmax = 1e-38f;

struct Nf4Bounds {
    float mid[15];
    TS_HOST_DEVICE Nf4Bounds() {
        const float codes[16] = {TS_QUANT_NF4_CODES};
        for (int i = 0; i < 15; ++i) mid[i] = (codes[i] + codes[i + 1]) / 2.0f;
    }
};

TS_HOST_DEVICE float nf4_clamped_absmax(float amax) { return amax > kNf4TinyAbsmax ? amax : kNf4TinyAbsmax; }

// Scaled value of x: full blocks multiply by `factor` (the reciprocal),
// partial blocks divide by `divisor`; both clamp to [-1, 1].
TS_HOST_DEVICE float nf4_scaled(float x, float factor, float divisor, bool partial) {
    float s = partial ? x / divisor : x * factor;
    return s < -1.0f ? -1.0f : (s > 1.0f ? 1.0f : s);
}

TS_HOST_DEVICE uint8_t nf4_encode_scaled(float s, const Nf4Bounds& b) {
    int code = 0;
    for (int i = 0; i < 15; ++i) code += b.mid[i] < s ? 1 : 0;
    return static_cast<uint8_t>(code);
}

// ---- fp8: e4m3 codes, fp32 scale amax / 448 per tile -----------------------

TS_HOST_DEVICE float fp8_scale(const Amax& a) { return a.nonfinite ? nan_f() : a.value / kFp8Max; }

TS_HOST_DEVICE uint8_t fp8_encode(float x, float scale) {
    if (!(scale > 0.0f)) return 0;
    return ts::float_to_fp8_e4m3(x / scale);
}

TS_HOST_DEVICE float fp8_decode(uint8_t q, float scale) { return ts::fp8_e4m3_to_float(q) * scale; }

// ---- nvfp4: e2m1 codes, e4m3 scale per 16, fp32 per-tensor scale ------------
// Block scale byte = e4m3((amax_block / 6) / g) with g = amax_tensor / 2688;
// effective block scale = e4m3_to_float(byte) * g; code = e2m1_rne(x / that).

TS_HOST_DEVICE uint8_t nvfp4_scale_byte(const Amax& a, float g) {
    if (a.nonfinite) return kFp8NaN;
    if (!(g > 0.0f)) return 0;
    return ts::float_to_fp8_e4m3((a.value / kNvfp4Max) / g);
}

TS_HOST_DEVICE float nvfp4_block_scale(uint8_t scale_byte, float g) { return ts::fp8_e4m3_to_float(scale_byte) * g; }

// Round to nearest e2m1, ties to the even code, saturating at 6.
TS_HOST_DEVICE uint8_t e2m1_encode(float v) {
    uint8_t sign = (ts::float_bits(v) >> 28) & 0x8u;
    float a = abs_f(v);
    int code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return static_cast<uint8_t>(sign | code);
}

TS_HOST_DEVICE uint8_t nvfp4_encode(float x, float block_scale) {
    if (!(block_scale > 0.0f)) return 0;
    return e2m1_encode(x / block_scale);
}

TS_HOST_DEVICE float e2m1_decode(uint8_t code) {
    const float values[8] = {TS_QUANT_E2M1_VALUES};
    float v = values[code & 7u];
    return (code & 8u) ? -v : v;
}

}  // namespace ts_quant
