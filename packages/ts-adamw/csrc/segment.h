// One validated AdamW call as the kernels see it: the step's scalars and one
// Segment per tensor set. No nanobind here, so CUDA sources can include it.
#pragma once

#include <cstdint>
#include <vector>

#include "adamw_math.h"

namespace ts_adamw {

// One tensor set: param (fp32), grad, two moments, optional rounded copy.
struct Segment {
    float* param;
    const void* grad;
    void* exp_avg;
    void* exp_avg_sq;
    void* out;  // nullptr when out_kind == Kind::none
    int64_t n;  // elements
    Kind grad_kind;
    Kind out_kind;
    uint32_t key;  // stochastic-rounding key of this tensor
    // Index of element 0 in the stochastic-rounding stream of its tensor: a
    // piece of a larger tensor (a disk tier segment, a data-parallel rank's
    // piece) rounds as that tensor does in one call. Host and CUDA kernels.
    int64_t first_index = 0;
};

struct Plan {
    Hyper hyper;
    Kind moment_kind = Kind::f32;
    std::vector<Segment> segments;
    int max_threads = 0;  // 0: the whole host pool
    int64_t total() const;
};

size_t kind_bytes(Kind kind);

}  // namespace ts_adamw
