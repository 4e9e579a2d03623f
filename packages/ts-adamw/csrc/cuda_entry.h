// cuda_adamw_step's host side: placement checks, device guard, launch.
#pragma once

#include <cstdint>
#include <vector>

#include "plan.h"

namespace ts_adamw {

// Validates placement (CUDA tensors on one device, or page-locked host
// tensors), sets that device, and enqueues the step on `stream`.
void cuda_step(const std::vector<AnyArray>& params, const std::vector<AnyArray>& grads,
               const std::vector<AnyArray>& exp_avgs, const std::vector<AnyArray>& exp_avg_sqs,
               const std::vector<AnyArray>& outs, const std::vector<uint32_t>& slots, const StepArgs& args,
               uintptr_t stream);

}  // namespace ts_adamw
