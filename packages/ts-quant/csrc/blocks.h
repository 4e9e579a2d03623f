// Block-level quantize and element-level dequantize, written once for the
// host and the device (ts/half.h's TS_HOST_DEVICE). The CPU kernels call them
// from the thread pool, the CUDA kernels from one thread per block, so both
// produce identical bytes by construction.
#pragma once

#include <cstdint>

#include "formats.h"

namespace ts_quant {

// Element types that cross as dtype-less ndarrays.
struct Bf16 {
    uint16_t bits;
};
struct Fp16 {
    uint16_t bits;
};

TS_HOST_DEVICE float to_float(float v) { return v; }
TS_HOST_DEVICE float to_float(Bf16 v) { return ts::bf16_to_float(v.bits); }
TS_HOST_DEVICE float to_float(Fp16 v) { return ts::fp16_to_float(v.bits); }

TS_HOST_DEVICE void store_float(float v, float* out) { *out = v; }
TS_HOST_DEVICE void store_float(float v, Bf16* out) { out->bits = ts::float_to_bf16(v); }
TS_HOST_DEVICE void store_float(float v, Fp16* out) { out->bits = ts::float_to_fp16(v); }

// Where one tensor's codes and scales live. Flat formats (int8, nf4, nvfp4)
// block the flattened tensor; fp8 tiles it as rows x cols with square tiles.
struct Geometry {
    Format format;
    int64_t n;       // values
    int64_t block;   // values per block (flat) or tile edge (fp8)
    int64_t rows;    // fp8 only
    int64_t cols;    // fp8 only
    TS_HOST_DEVICE int64_t tiles_c() const { return (cols + block - 1) / block; }
    TS_HOST_DEVICE int64_t tiles_r() const { return (rows + block - 1) / block; }
    // Scale slots: blocks of the flat formats, tiles of fp8.
    TS_HOST_DEVICE int64_t scale_count() const {
        return format == Format::fp8 ? tiles_r() * tiles_c() : (n + block - 1) / block;
    }
    TS_HOST_DEVICE int64_t scale_index(int64_t i) const {
        if (format != Format::fp8) return i / block;
        return (i / cols / block) * tiles_c() + (i % cols) / block;
    }
};

TS_HOST_DEVICE void put_nibble(uint8_t* data, int64_t i, uint8_t code, bool first_high) {
    // Each block starts at an even index, so a byte never spans two blocks.
    bool first = (i & 1) == 0;
    uint8_t shift = (first == first_high) ? 4 : 0;
    uint8_t keep = shift ? 0x0f : 0xf0;
    data[i >> 1] = static_cast<uint8_t>((data[i >> 1] & keep) | (code << shift));
}

TS_HOST_DEVICE uint8_t get_nibble(const uint8_t* data, int64_t i, bool first_high) {
    bool first = (i & 1) == 0;
    uint8_t byte = data[i >> 1];
    return (first == first_high) ? (byte >> 4) : (byte & 0x0f);
}

// Quantizes flat block `b` (int8, nf4 or nvfp4). `g` is NVFP4's per-tensor scale.
template <class In>
TS_HOST_DEVICE void quantize_flat_block(const Geometry& geo, const In* x, int64_t b, uint8_t* data, void* scales,
                                        float g, const Nf4Bounds& bounds) {
    const int64_t begin = b * geo.block;
    const int64_t end = begin + geo.block < geo.n ? begin + geo.block : geo.n;
    Amax amax;
    for (int64_t i = begin; i < end; ++i) amax.add(to_float(x[i]));
    switch (geo.format) {
        case Format::int8: {
            float scale = int8_scale(amax);
            static_cast<float*>(scales)[b] = scale;
            for (int64_t i = begin; i < end; ++i) data[i] = int8_encode(to_float(x[i]), scale);
            break;
        }
        case Format::nf4: {
            const bool partial = end - begin < geo.block;
            float stored, factor = 0.0f, divisor = 0.0f;
            if (amax.nonfinite) {
                stored = nan_f();
            } else if (partial) {
                stored = divisor = nf4_clamped_absmax(amax.value);
            } else {
                stored = amax.value;
                factor = 1.0f / nf4_clamped_absmax(amax.value);
            }
            static_cast<float*>(scales)[b] = stored;
            for (int64_t i = begin; i < end; ++i) {
                uint8_t code = amax.nonfinite ? kNf4ZeroCode
                                              : nf4_encode_scaled(nf4_scaled(to_float(x[i]), factor, divisor, partial), bounds);
                put_nibble(data, i, code, true);
            }
            // bitsandbytes pads an odd tensor with one 0.0, whose code is 7.
            if ((end & 1) && end == geo.n) put_nibble(data, end, kNf4ZeroCode, true);
            break;
        }
        case Format::nvfp4: {
            uint8_t scale_byte = nvfp4_scale_byte(amax, g);
            static_cast<uint8_t*>(scales)[b] = scale_byte;
            float block_scale = amax.nonfinite ? 0.0f : nvfp4_block_scale(scale_byte, g);
            for (int64_t i = begin; i < end; ++i) put_nibble(data, i, nvfp4_encode(to_float(x[i]), block_scale), false);
            if ((end & 1) && end == geo.n) put_nibble(data, end, 0, false);
            break;
        }
        default:
            break;
    }
}

// Quantizes fp8 tile `t` (row-major over tiles).
template <class In>
TS_HOST_DEVICE void quantize_fp8_tile(const Geometry& geo, const In* x, int64_t t, uint8_t* data, float* scales) {
    const int64_t tr = t / geo.tiles_c(), tc = t % geo.tiles_c();
    const int64_t r0 = tr * geo.block, c0 = tc * geo.block;
    const int64_t r1 = r0 + geo.block < geo.rows ? r0 + geo.block : geo.rows;
    const int64_t c1 = c0 + geo.block < geo.cols ? c0 + geo.block : geo.cols;
    Amax amax;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax.add(to_float(x[r * geo.cols + c]));
    float scale = fp8_scale(amax);
    scales[t] = scale;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) data[r * geo.cols + c] = fp8_encode(to_float(x[r * geo.cols + c]), scale);
}

// The scale that multiplies the codes of scale slot `s` (NVFP4: byte * g).
TS_HOST_DEVICE float slot_scale(const Geometry& geo, const void* scales, int64_t s, float g) {
    if (geo.format == Format::nvfp4) return nvfp4_block_scale(static_cast<const uint8_t*>(scales)[s], g);
    return static_cast<const float*>(scales)[s];
}

// Value i, given its slot's scale. `nf4_codes` is a 16-entry table.
TS_HOST_DEVICE float decode_element(const Geometry& geo, const uint8_t* data, int64_t i, float scale,
                                    const float* nf4_codes) {
    switch (geo.format) {
        case Format::int8: return int8_decode(data[i], scale);
        case Format::nf4: return nf4_codes[get_nibble(data, i, true)] * scale;
        case Format::fp8: return fp8_decode(data[i], scale);
        case Format::nvfp4: return e2m1_decode(get_nibble(data, i, false)) * scale;
    }
    return 0.0f;
}

}  // namespace ts_quant
