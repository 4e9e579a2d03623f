// A validated AdamW call: the step's scalars and one Segment per tensor set.
// Built (and every argument checked) before any memory is touched, so a call
// that raises leaves parameters and moments unchanged.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "segment.h"

namespace ts_adamw {

namespace nb = nanobind;
using AnyArray = nb::ndarray<>;

// Hyper-parameters as Python passes them (validated by build_plan).
struct StepArgs {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    bool maximize;
    double grad_scale;
    uint64_t seed;
};

// Where a tensor may live: returns the pointer the kernels use, or throws
// ValueError naming `what` (e.g. "grads[2]").
using PlaceFn = std::function<void*(const AnyArray&, const char* what)>;

// Checks every tensor (kinds, element counts, contiguity, placement) and the
// hyper-parameters; `fn` names the Python function in messages.
Plan build_plan(const char* fn, const std::vector<AnyArray>& params, const std::vector<AnyArray>& grads,
                const std::vector<AnyArray>& exp_avgs, const std::vector<AnyArray>& exp_avg_sqs,
                const std::vector<AnyArray>& outs, const std::vector<uint32_t>& slots, const StepArgs& args,
                const PlaceFn& place);

Kind kind_of(const AnyArray& array);
const char* kind_name(Kind kind);

}  // namespace ts_adamw
