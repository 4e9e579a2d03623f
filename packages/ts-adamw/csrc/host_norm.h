// Fused sum of squares over many host buffers (for global gradient clipping).
#pragma once

#include <cstdint>
#include <vector>

#include "adamw_math.h"

namespace ts_adamw {

struct NormSegment {
    const void* data;
    int64_t n;
    Kind kind;  // f32, bf16 or f16
};

// Sum of x*x over every element, deterministic for any thread count: fixed
// blocks of 2^16 elements, fp32 lanes inside a block, blocks added in fp64 in
// order. Call without the GIL.
double sum_of_squares(const std::vector<NormSegment>& segments, int max_threads);

}  // namespace ts_adamw
