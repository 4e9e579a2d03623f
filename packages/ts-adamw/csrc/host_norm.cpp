// Sum of squares over many buffers: fixed blocks so the result does not depend
// on the thread count; fp32 SIMD lanes inside sub-blocks, fp64 above them.
#include "host_norm.h"

#include <algorithm>
#include <type_traits>

#include "isa.h"
#include "ts/thread_pool.h"

namespace ts_adamw {

namespace {

constexpr int64_t kBlock = int64_t(1) << 16;  // elements per deterministic block
constexpr int64_t kSub = 1024;                // fp32 lanes flush to fp64 this often
constexpr int kLanes = 16;

template <Kind K>
using elem_t = std::conditional_t<K == Kind::f32, float, uint16_t>;

template <Kind K>
inline __attribute__((always_inline)) double block_sum(const elem_t<K>* __restrict x, int64_t n) {
    double total = 0.0;
    int64_t i = 0;
    for (; i + kSub <= n; i += kSub) {
        float acc[kLanes] = {};
        for (int64_t j = 0; j < kSub; j += kLanes) {
            for (int l = 0; l < kLanes; ++l) {
                float f = load_as_float<K>(x, i + j + l);
                acc[l] += f * f;
            }
        }
        double sub = 0.0;
        for (int l = 0; l < kLanes; ++l) sub += double(acc[l]);
        total += sub;
    }
    for (; i < n; ++i) {
        double f = double(load_as_float<K>(x, i));
        total += f * f;
    }
    return total;
}

using SumFn = double (*)(const void*, int64_t);

#define TSA_DEFINE_SUM(NAME, TARGET)                                  \
    template <Kind K>                                                 \
    TARGET double NAME(const void* x, int64_t n) {                    \
        return block_sum<K>(static_cast<const elem_t<K>*>(x), n);     \
    }

TSA_DEFINE_SUM(sum_baseline, )
TSA_DEFINE_SUM(sum_avx2, TSA_TARGET_AVX2)
TSA_DEFINE_SUM(sum_avx512, TSA_TARGET_AVX512)

template <Kind K>
SumFn pick_isa(Isa isa) {
    switch (isa) {
        case Isa::avx512: return &sum_avx512<K>;
        case Isa::avx2: return &sum_avx2<K>;
        default: return &sum_baseline<K>;
    }
}

SumFn pick(Kind kind, Isa isa) {
    switch (kind) {
        case Kind::bf16: return pick_isa<Kind::bf16>(isa);
        case Kind::f16: return pick_isa<Kind::f16>(isa);
        default: return pick_isa<Kind::f32>(isa);
    }
}

struct Block {
    const void* data;
    int64_t n;
    SumFn fn;
};

}  // namespace

double sum_of_squares(const std::vector<NormSegment>& segments, int max_threads) {
    std::vector<Block> blocks;
    const Isa isa = active_isa();
    for (const NormSegment& s : segments) {
        const SumFn fn = pick(s.kind, isa);
        const size_t bytes = s.kind == Kind::f32 ? 4 : 2;
        for (int64_t at = 0; at < s.n; at += kBlock)
            blocks.push_back({static_cast<const char*>(s.data) + size_t(at) * bytes, std::min(kBlock, s.n - at), fn});
    }
    std::vector<double> partial(blocks.size(), 0.0);
    ts::host_pool().parallel_for(
        int64_t(blocks.size()), 2,
        [&](int64_t begin, int64_t end) {
            for (int64_t b = begin; b < end; ++b) partial[b] = blocks[b].fn(blocks[b].data, blocks[b].n);
        },
        max_threads);
    double total = 0.0;
    for (double x : partial) total += x;
    return total;
}

}  // namespace ts_adamw
