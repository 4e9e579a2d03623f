// The AdamW update of one element, shared by the host SIMD kernels and the
// CUDA kernels. Every operation is a separate IEEE fp32 rounding in the order
// torch.optim.AdamW (single-tensor path) uses:
//
//   g  = grad * grad_scale            (negated when maximize)
//   p  = p * (1 - lr*wd)
//   m  = lerp(m, g, 1 - beta1)        (torch's lerp: two fused formulas around 0.5)
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   d  = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p  = p + ((-lr / (1 - beta1^step)) * m) / d
//
// Host files are compiled with -ffp-contract=off; device code uses the
// explicit __f*_rn intrinsics so nvcc cannot fuse multiply-adds either.
#pragma once

#include <cstdint>
#include <cstring>

#include "ts/half.h"

#if defined(__CUDACC__)
#define TSA_HD __host__ __device__ __forceinline__
#else
#define TSA_HD inline __attribute__((always_inline))
#endif

namespace ts_adamw {

enum class Kind : int { none = 0, f32 = 1, bf16 = 2, f16 = 3 };

// Scalars of one step, rounded to fp32 the way torch rounds its Python scalars.
struct Hyper {
    float decay;          // 1 - lr*wd
    float w1;             // 1 - beta1 (lerp weight)
    float lerp_coeff;     // w1, or w1 - 1 when w1 >= 0.5 (lerp's second formula)
    bool lerp_small;      // w1 < 0.5: lerp = m + w1*(g - m), else g + (w1 - 1)*(g - m)
    float beta2;
    float w2;             // 1 - beta2
    float bc2_sqrt;       // sqrt(1 - beta2^step)
    float eps;
    float neg_step_size;  // -lr / (1 - beta1^step)
    float grad_scale;     // already negated when maximize
    uint32_t seed_key;    // hash of (seed, step) for stochastic rounding
};

// Builds Hyper from the double-precision hyper-parameters (as Python holds them).
Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                 bool maximize, double grad_scale, uint64_t seed);

// ---- bit helpers ----------------------------------------------------------

// lowbias32 (a 32-bit integer finalizer): good avalanche, vectorizes.
TSA_HD uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Key of the 2^32-element window `hi` of a tensor: elements are hashed as
// mix32(uint32(index) ^ window_key(...)).
TSA_HD uint32_t window_key(uint32_t tensor_key, uint32_t hi) { return mix32(tensor_key + hi * 0x9e3779b9u); }

// Key of one tensor (its slot in the call) under a step's seed key.
TSA_HD uint32_t tensor_key(uint32_t seed_key, uint32_t slot) { return mix32(seed_key ^ mix32(slot + 0x632be5abu)); }

// ---- conversions (branch-free, so loops vectorize) -------------------------

TSA_HD float bf16_load(uint16_t h) { return ts::bits_float(uint32_t(h) << 16); }

TSA_HD uint16_t bf16_round(float x) {  // nearest even, NaN kept quiet
    uint32_t b = ts::float_bits(x);
    uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    uint32_t nan = (b >> 16) | 0x40u;
    return uint16_t((b & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

// Unbiased stochastic rounding with 16 random bits; inf/NaN round to nearest.
TSA_HD uint16_t bf16_stochastic(float x, uint32_t random16) {
    uint32_t b = ts::float_bits(x);
    uint32_t r = (b + (random16 & 0xffffu)) >> 16;
    return (b & 0x7f800000u) == 0x7f800000u ? bf16_round(x) : uint16_t(r);
}

TSA_HD float f16_load(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t em = uint32_t(h & 0x7fffu) << 13;  // exponent+mantissa in fp32 position
    uint32_t exp = em & 0x0f800000u;
    float normal = ts::bits_float(em + 0x38000000u);                                 // rebias 15 -> 127
    float special = ts::bits_float(em | 0x7f800000u);                                // inf / NaN
    float sub = ts::bits_float(em + 0x38800000u) - ts::bits_float(0x38800000u);                  // subnormal: exact
    float mag = exp == 0x0f800000u ? special : (exp == 0 ? sub : normal);
    return ts::bits_float(ts::float_bits(mag) | sign);
}

TSA_HD uint16_t f16_round(float x) {  // nearest even, overflow -> inf
    uint32_t b = ts::float_bits(x);
    uint32_t sign = (b >> 16) & 0x8000u;
    uint32_t a = b & 0x7fffffffu;
    uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    // Adding 0.5 (ulp 2^-24) lands the value on fp16's subnormal grid.
    uint32_t sub = ts::float_bits(ts::bits_float(a) + 0.5f) - 0x3f000000u;
    uint32_t v = a < 0x38800000u ? sub : normal;
    v = a >= 0x477ff000u ? 0x7c00u : v;
    v = a > 0x7f800000u ? 0x7e00u : v;
    return uint16_t(sign | v);
}

template <Kind K, typename T>
TSA_HD float load_as_float(const T* ptr, int64_t i) {
    if constexpr (K == Kind::f32) return reinterpret_cast<const float*>(ptr)[i];
    else if constexpr (K == Kind::bf16) return bf16_load(reinterpret_cast<const uint16_t*>(ptr)[i]);
    else return f16_load(reinterpret_cast<const uint16_t*>(ptr)[i]);
}

template <Kind K>
TSA_HD void store_nearest(void* ptr, int64_t i, float x) {
    if constexpr (K == Kind::f32) static_cast<float*>(ptr)[i] = x;
    else if constexpr (K == Kind::bf16) static_cast<uint16_t*>(ptr)[i] = bf16_round(x);
    else if constexpr (K == Kind::f16) static_cast<uint16_t*>(ptr)[i] = f16_round(x);
}

// ---- fp32 arithmetic without contraction ------------------------------------

TSA_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
TSA_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
TSA_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
TSA_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
TSA_HD float ffma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}
TSA_HD float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return __builtin_sqrtf(a);
#endif
}

// One element: p, m, v updated in place (m, v in fp32 here; the caller loads
// and stores them in their storage format). SmallWeight = hyper.lerp_small,
// a template argument so host loops carry no per-element select.
template <bool SmallWeight>
TSA_HD void update_with(const Hyper& h, float g_raw, float& p, float& m, float& v) {
    float g = fmul(g_raw, h.grad_scale);
    p = fmul(p, h.decay);
    float diff = fsub(g, m);
    // torch's lerp (vectorized on CPU, and on CUDA) fuses the multiply-add.
    m = ffma(h.lerp_coeff, diff, SmallWeight ? m : g);
    v = ffma(fmul(h.w2, g), g, fmul(v, h.beta2));  // torch's CPU addcmul fuses this
    float denom = fadd(fdiv(fsqrt(v), h.bc2_sqrt), h.eps);
    p = fadd(p, fdiv(fmul(h.neg_step_size, m), denom));
}

TSA_HD void update(const Hyper& h, float g_raw, float& p, float& m, float& v) {
    if (h.lerp_small) update_with<true>(h, g_raw, p, m, v);
    else update_with<false>(h, g_raw, p, m, v);
}

}  // namespace ts_adamw
