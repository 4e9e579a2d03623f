// Host entry points of the Hopper fused dequantize + matmul (fused_linear.cu).
#pragma once

#include <cstdint>
#include <stdexcept>

#include "formats.h"
#include "ts/errors.h"

namespace ts_quant {

// The fused kernel cannot run here: the device, driver or build lacks what it needs, or the
// operands are outside what it takes. Python's ts_quant.FusedLinearUnavailable (a RuntimeError),
// on which quantized_linear uses dequantize + matmul for that call; every other error propagates.
struct FusedLinearUnavailable : std::runtime_error {
    using std::runtime_error::runtime_error;
};

template <typename... Parts>
[[noreturn]] void throw_fused_unavailable(const Parts&... parts) {
    throw FusedLinearUnavailable(ts::concat(parts...));
}

// True when `device` is compute capability 9.0 (the kernel is built for sm_90a only).
bool fused_linear_supported(int device);

// out[m, n] = x[m, k] @ dequantize(codes, scales)^T (+ bias), all bf16 on `device`,
// enqueued on `stream`. format: int8 or nf4 with power-of-two blocks >= 32, or
// nvfp4, over a [n, k] weight; k % 64 == 0.
// scales: fp32 per block (int8, nf4) or e4m3 bytes with global_scale (nvfp4).
// tile_m: x rows per CTA (64, 128 or 256), 0 to pick from m. workspace
// [slots][kFusedSlotFloats] fp32 and flags [slots] int32: stream-K partial
// sums, one slot per CTA; the grid is min(slots, SM count). epoch: one 64-bit
// word the kernel advances itself (so CUDA graph replays stay correct).
// flags and epoch start zeroed; launches sharing them must run one after
// another (one stream, or one graph replayed on one stream at a time).
// Throws FusedLinearUnavailable where this device, driver or build cannot run it.
constexpr int64_t kFusedSlotFloats = 256 * 128;  // tile_m / 2 accumulators x 256 consumer threads, at most
void fused_linear_sm90(Format format, const void* x, int64_t m, int64_t k, const uint8_t* codes,
                       const void* scales, const float* global_scale, int64_t block, int64_t n, const void* bias,
                       void* out, int tile_m, float* workspace, int* flags, int64_t slots,
                       unsigned long long* epoch, int device, uintptr_t stream);

// The hot path of quantized_linear (ts_quant._plan): the codes' TMA descriptor is built once per weight
// (fused_code_map_sm90 writes kFusedCodeMapBytes opaque bytes) and handed back on every call, with the
// other operands as addresses the caller validated once through fused_linear_sm90's checked binding.
constexpr size_t kFusedCodeMapBytes = 128;  // sizeof(CUtensorMap)
void fused_code_map_sm90(Format format, const uint8_t* codes, int64_t n, int64_t k, void* map_out);
void fused_linear_sm90_mapped(Format format, const void* x, int64_t m, int64_t k, const void* code_map,
                              const void* scales, const float* global_scale, int64_t block, int64_t n,
                              const void* bias, void* out, int tile_m, float* workspace, int* flags, int64_t slots,
                              unsigned long long* epoch, int device, uintptr_t stream);

}  // namespace ts_quant
