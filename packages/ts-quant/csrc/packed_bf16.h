// Exponent-packed bfloat16: a lossless 12-bit form of a bf16 tensor, for the host-to-device link.
//
// Trained (and initialized) weights use few exponents: a tensor's values sit within 16 binades of
// each other almost everywhere. Each value keeps its sign and 7 mantissa bits in one byte and its
// exponent as a 4-bit offset from the tensor's `base`; offset 15 marks an escape, whose whole
// bf16 bits are stored beside its index. Decoding restores every bit (zeros, subnormals, inf and
// NaN payloads included): 1.5 bytes a value plus 6 bytes an escape, against 2.
//
// One segment per tensor of n values with k escapes, every part 16-byte aligned from its start:
//   [0, n)            low bytes: sign << 7 | mantissa
//   [nibbles, +n/2)   offsets: value 2i in the low nibble of byte i, 2i+1 in the high one
//   [indices, +4k)    escape indices, int32, ascending
//   [values, +2k)     escape values, the raw bf16 bits
#pragma once

#include <cstdint>

namespace ts_quant {

constexpr int kPackedEscape = 15;  // the offset that marks an escape
constexpr int kPackedWindow = 15;  // exponents base .. base + 14 are coded in place

struct PackedLayout {
    int64_t n = 0, k = 0;
    int64_t nibbles = 0, indices = 0, values = 0, total = 0;  // byte offsets from the segment's start
};

inline int64_t packed_align16(int64_t x) { return (x + 15) / 16 * 16; }

inline PackedLayout packed_layout(int64_t n, int64_t k) {
    PackedLayout l;
    l.n = n;
    l.k = k;
    l.nibbles = packed_align16(n);
    l.indices = packed_align16(l.nibbles + (n + 1) / 2);
    l.values = l.indices + 4 * k;
    l.total = l.values + 2 * k;
    return l;
}

// The one value rule both directions share: bits from a low byte and an in-window offset.
inline
#ifdef __CUDACC__
    __host__ __device__
#endif
    uint16_t packed_value(uint32_t low, uint32_t offset, uint32_t base) {
    return static_cast<uint16_t>(((low & 0x80u) << 8) | (((base + (offset & 0xFu)) & 0xFFu) << 7) | (low & 0x7Fu));
}

// CPU (host pool threads).
void exponent_histogram_cpu(const uint16_t* x, int64_t n, int64_t* counts /* [256] */);
void pack_bf16_cpu(const uint16_t* x, const PackedLayout& layout, int base, uint8_t* segment);
void unpack_bf16_cpu(const uint8_t* segment, const PackedLayout& layout, int base, uint16_t* out);

// CUDA, enqueued on `stream`; segment and out in device memory, 16-byte aligned.
void unpack_bf16_cuda(const uint8_t* segment, const PackedLayout& layout, int base, uint16_t* out, int device,
                      uintptr_t stream);

}  // namespace ts_quant
