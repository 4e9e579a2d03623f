// CUDA AdamW: a multi-tensor kernel driven by pointer/size tables passed as
// kernel parameters, grid-stride over fixed tiles, vectorized 4-wide.
#pragma once

#include <cstdint>

#include "segment.h"

namespace ts_adamw {

// Enqueues the plan on `stream` (a cudaStream_t as an integer) of the current
// device. Every pointer in the plan must be valid on that device (device
// memory, or page-locked host memory through its mapped device pointer).
// Never synchronizes.
void launch_cuda_step(const Plan& plan, uintptr_t stream);

}  // namespace ts_adamw
