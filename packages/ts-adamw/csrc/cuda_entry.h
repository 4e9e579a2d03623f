// cuda_adamw_step's host side: placement checks, device guard, launch.
#pragma once

#include <cstdint>
#include <vector>

#include "plan.h"

namespace ts_adamw {

// Validates placement (CUDA tensors on one device, or page-locked host
// tensors), sets that device, and enqueues the step on `stream`. `offsets`:
// each tensor's first index in its rounding stream (assign_offsets; empty: 0).
void cuda_step(const std::vector<AnyArray>& params, const std::vector<AnyArray>& grads,
               const std::vector<AnyArray>& exp_avgs, const std::vector<AnyArray>& exp_avg_sqs,
               const std::vector<AnyArray>& outs, const std::vector<uint32_t>& slots,
               const std::vector<int64_t>& offsets, const StepArgs& args, uintptr_t stream);

// A fused step over a fixed parameter set on one GPU: the state tensors (device or page-locked)
// checked and placed once; each launch() takes the gradients as device addresses.
struct PreparedCudaStep {
    PreparedPlan prepared;
    int device = 0;
    std::vector<AnyArray> arrays;  // the state tensors, referenced for the object's life

    void launch(const std::vector<uintptr_t>& grads, const StepArgs& args, uintptr_t stream) const;
};

PreparedCudaStep prepare_cuda_step(std::vector<AnyArray> params, std::vector<AnyArray> exp_avgs,
                                   std::vector<AnyArray> exp_avg_sqs, std::vector<AnyArray> outs,
                                   const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets,
                                   const std::vector<int>& grad_kinds);

}  // namespace ts_adamw
