// Exponent-packed bf16 on the host: histogram, pack (two passes: escapes counted per chunk, then
// written in order) and unpack, spread over the shared host pool.
#include <algorithm>
#include <array>
#include <vector>

#include "packed_bf16.h"
#include "ts/errors.h"
#include "ts/thread_pool.h"

namespace ts_quant {
namespace {

constexpr int64_t kGrain = int64_t(1) << 18;  // values per chunk; even, so a chunk owns whole nibble bytes

inline uint32_t exponent_of(uint16_t v) { return (v >> 7) & 0xFFu; }
inline bool in_window(uint32_t e, int base) { return e >= uint32_t(base) && e < uint32_t(base + kPackedWindow); }

}  // namespace

void exponent_histogram_cpu(const uint16_t* x, int64_t n, int64_t* counts) {
    const int64_t chunks = (n + kGrain - 1) / kGrain;
    std::vector<std::array<int64_t, 256>> partial(static_cast<size_t>(chunks));
    ts::host_pool().parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
            auto& h = partial[size_t(c)];
            h.fill(0);
            for (int64_t i = c * kGrain, end = std::min(n, (c + 1) * kGrain); i < end; ++i) ++h[exponent_of(x[i])];
        }
    });
    std::fill(counts, counts + 256, 0);
    for (const auto& h : partial)
        for (int e = 0; e < 256; ++e) counts[e] += h[size_t(e)];
}

void pack_bf16_cpu(const uint16_t* x, const PackedLayout& l, int base, uint8_t* segment) {
    const int64_t n = l.n, chunks = (n + kGrain - 1) / kGrain;
    std::vector<int64_t> first(static_cast<size_t>(chunks) + 1, 0);  // each chunk's first escape slot
    ts::host_pool().parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
            int64_t escapes = 0;
            for (int64_t i = c * kGrain, end = std::min(n, (c + 1) * kGrain); i < end; ++i)
                escapes += !in_window(exponent_of(x[i]), base);
            first[size_t(c) + 1] = escapes;
        }
    });
    for (int64_t c = 0; c < chunks; ++c) first[size_t(c) + 1] += first[size_t(c)];
    TS_CHECK_ARG(first[size_t(chunks)] == l.k, "pack_bf16: the layout has room for ", l.k, " escapes, the values have ",
                 first[size_t(chunks)], " outside the window of base ", base);
    uint8_t* low = segment;
    uint8_t* nibbles = segment + l.nibbles;
    auto* indices = reinterpret_cast<int32_t*>(segment + l.indices);
    auto* values = reinterpret_cast<uint16_t*>(segment + l.values);
    ts::host_pool().parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
            int64_t slot = first[size_t(c)];
            for (int64_t i = c * kGrain, end = std::min(n, (c + 1) * kGrain); i < end; ++i) {
                const uint16_t v = x[i];
                const uint32_t e = exponent_of(v);
                uint32_t offset = kPackedEscape;
                if (in_window(e, base)) {
                    offset = e - uint32_t(base);
                } else {
                    indices[slot] = static_cast<int32_t>(i);
                    values[slot++] = v;
                }
                low[i] = static_cast<uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu));
                if (i % 2 == 0) nibbles[i / 2] = static_cast<uint8_t>(offset);
                else nibbles[i / 2] = static_cast<uint8_t>(nibbles[i / 2] | (offset << 4));
            }
        }
    });
}

void unpack_bf16_cpu(const uint8_t* segment, const PackedLayout& l, int base, uint16_t* out) {
    const uint8_t* low = segment;
    const uint8_t* nibbles = segment + l.nibbles;
    ts::host_pool().parallel_for(l.n, kGrain, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            const uint32_t offset = (nibbles[i / 2] >> ((i % 2) * 4)) & 0xFu;
            out[i] = packed_value(low[i], offset, uint32_t(base));
        }
    });
    const auto* indices = reinterpret_cast<const int32_t*>(segment + l.indices);
    const auto* values = reinterpret_cast<const uint16_t*>(segment + l.values);
    for (int64_t j = 0; j < l.k; ++j) out[indices[j]] = values[j];
}

}  // namespace ts_quant
