// CPU kernels: blocks (or fp8 tiles) spread over the shared host pool.
#include <algorithm>

#include "kernels.h"
#include "ts/thread_pool.h"

namespace ts_quant {
namespace {

// Blocks per pool chunk: about 64 Ki values, enough to amortize the hand-off.
int64_t grain_for(const Geometry& geo) {
    int64_t per_slot = geo.format == Format::fp8 ? geo.block * geo.block : geo.block;
    return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, per_slot));
}

template <class In>
void quantize_typed(const Geometry& geo, const In* x, uint8_t* data, void* scales, float g) {
    const Nf4Bounds bounds;
    ts::host_pool().parallel_for(geo.scale_count(), grain_for(geo), [&](int64_t begin, int64_t end) {
        for (int64_t s = begin; s < end; ++s) {
            if (geo.format == Format::fp8) {
                quantize_fp8_tile(geo, x, s, data, static_cast<float*>(scales));
            } else {
                quantize_flat_block(geo, x, s, data, scales, g, bounds);
            }
        }
    });
}

template <class Out>
void dequantize_typed(const Geometry& geo, const uint8_t* data, const void* scales, float g, Out* out) {
    static const float nf4_codes[16] = {TS_QUANT_NF4_CODES};
    if (geo.format == Format::fp8) {
        // Row by row: a row's tile scales are contiguous.
        ts::host_pool().parallel_for(geo.rows, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, geo.cols)),
                                     [&](int64_t r0, int64_t r1) {
                                         for (int64_t r = r0; r < r1; ++r)
                                             for (int64_t c = 0; c < geo.cols; ++c) {
                                                 int64_t i = r * geo.cols + c;
                                                 float s = slot_scale(geo, scales, geo.scale_index(i), g);
                                                 store_float(decode_element(geo, data, i, s, nf4_codes), out + i);
                                             }
                                     });
        return;
    }
    ts::host_pool().parallel_for(geo.scale_count(), grain_for(geo), [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            float s = slot_scale(geo, scales, b, g);
            int64_t i1 = std::min(geo.n, (b + 1) * geo.block);
            for (int64_t i = b * geo.block; i < i1; ++i) store_float(decode_element(geo, data, i, s, nf4_codes), out + i);
        }
    });
}

}  // namespace

void quantize_cpu(const Geometry& geo, const void* x, ts::ScalarKind in_kind, uint8_t* data, void* scales,
                  const float* global_scale) {
    float g = global_scale ? *global_scale : 0.0f;
    switch (in_kind) {
        case ts::ScalarKind::float32: return quantize_typed(geo, static_cast<const float*>(x), data, scales, g);
        case ts::ScalarKind::bfloat16: return quantize_typed(geo, static_cast<const Bf16*>(x), data, scales, g);
        case ts::ScalarKind::float16: return quantize_typed(geo, static_cast<const Fp16*>(x), data, scales, g);
        default: ts::throw_value_error("quantize: input dtype must be float32, bfloat16 or float16");
    }
}

void dequantize_cpu(const Geometry& geo, const uint8_t* data, const void* scales, const float* global_scale, void* out,
                    ts::ScalarKind out_kind) {
    float g = global_scale ? *global_scale : 0.0f;
    switch (out_kind) {
        case ts::ScalarKind::float32: return dequantize_typed(geo, data, scales, g, static_cast<float*>(out));
        case ts::ScalarKind::bfloat16: return dequantize_typed(geo, data, scales, g, static_cast<Bf16*>(out));
        case ts::ScalarKind::float16: return dequantize_typed(geo, data, scales, g, static_cast<Fp16*>(out));
        default: ts::throw_value_error("dequantize: output dtype must be float32, bfloat16 or float16");
    }
}

}  // namespace ts_quant
