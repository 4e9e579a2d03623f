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

// The state half of a plan (master weights, moments, rounded copies), checked once and reused by
// every later call with new gradients: a fused step over a fixed parameter set then costs one
// pointer per gradient instead of a DLPack import of every tensor (issue 13: ~12 us per tensor).
struct PreparedPlan {
    Plan plan;                     // every segment's grad is nullptr; hyper and keys are set per call
    std::vector<uint32_t> slots;   // rounding keys (empty: the tensor's position)
    std::vector<Kind> grad_kinds;  // the gradients' dtypes, fixed for the plan's life
    // Byte ranges of every written buffer, sorted by start and disjoint (prepare_plan refuses
    // overlaps): a gradient is checked against them with one binary search.
    std::vector<std::pair<uintptr_t, uintptr_t>> written;

    // The plan of one call: `grads` are addresses the kernels can read (device or mapped memory),
    // one per parameter, in `grad_kinds`; each is checked against the written ranges.
    Plan with_grads(const char* fn, const std::vector<uintptr_t>& grads, const StepArgs& args) const;
};

PreparedPlan prepare_plan(const char* fn, const std::vector<AnyArray>& params, const std::vector<AnyArray>& exp_avgs,
                          const std::vector<AnyArray>& exp_avg_sqs, const std::vector<AnyArray>& outs,
                          const std::vector<uint32_t>& slots, const std::vector<int>& grad_kinds,
                          const PlaceFn& place);

// Sets each segment's first_index (segment.h) from `offsets`: one per segment, each from 0 to
// kMaxFirstIndex; empty: all 0 (each tensor is a whole). ValueError naming `fn` otherwise.
constexpr int64_t kMaxFirstIndex = int64_t(1) << 62;
void assign_offsets(const char* fn, std::vector<Segment>& segments, const std::vector<int64_t>& offsets);

Kind kind_of(const AnyArray& array);
const char* kind_name(Kind kind);

}  // namespace ts_adamw
