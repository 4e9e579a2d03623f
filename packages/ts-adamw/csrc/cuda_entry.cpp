// Host side of cuda_adamw_step: placement checks and the device guard. Built
// with or without CUDA; without it the entry point raises a clear error.
#include <string>

#include "cuda_adamw.h"
#include "cuda_entry.h"
#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/ndarray.h"

namespace ts_adamw {

#ifdef TS_WITH_CUDA

namespace {


int pick_device(const std::vector<const std::vector<AnyArray>*>& lists) {
    for (const auto* list : lists)
        for (const AnyArray& a : *list)
            if (ts::is_cuda(a)) return a.device_id();
    int current = 0;
    TS_CUDA_CHECK(cudaGetDevice(&current));
    return current;
}

// Where the kernels reach a tensor: its device address, or a page-locked host tensor's mapped one.
PlaceFn placer(int device, const char* fn) {
    return [device, fn](const AnyArray& a, const char* what) -> void* {
        if (a.size() == 0) return a.data();
        if (ts::is_cuda(a)) {
            TS_CHECK_ARG(a.device_id() == device, fn, ": ", what, " is on cuda:", a.device_id(),
                         " but the other tensors are on cuda:", device, "; put all of them on one GPU");
            return a.data();
        }
        TS_CHECK_ARG(ts::is_cpu(a), fn, ": ", what,
                     " must be a CUDA tensor or a page-locked (pinned) CPU tensor");
        cudaPointerAttributes attr{};
        cudaError_t status = cudaPointerGetAttributes(&attr, a.data());
        if (status != cudaSuccess) cudaGetLastError();
        TS_CHECK_ARG(status == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr,
                     fn, ": ", what,
                     " is an ordinary (pageable) CPU tensor; the GPU can only reach page-locked memory. "
                     "Allocate it with pin_memory() (or ts_pinned) or move it to the GPU");
        return attr.devicePointer;
    };
}

}  // namespace

void cuda_step(const std::vector<AnyArray>& params, const std::vector<AnyArray>& grads,
               const std::vector<AnyArray>& exp_avgs, const std::vector<AnyArray>& exp_avg_sqs,
               const std::vector<AnyArray>& outs, const std::vector<uint32_t>& slots,
               const std::vector<int64_t>& offsets, const StepArgs& args, uintptr_t stream) {
    if (!ts::cuda_device_present())
        ts::throw_runtime_error("cuda_adamw_step: no CUDA device or driver is present on this machine");
    const int device = pick_device({&grads, &params, &exp_avgs, &exp_avg_sqs, &outs});
    ts::CudaDeviceGuard guard(device);
    Plan plan = build_plan("cuda_adamw_step", params, grads, exp_avgs, exp_avg_sqs, outs, slots, args,
                           placer(device, "cuda_adamw_step"));
    assign_offsets("cuda_adamw_step", plan.segments, offsets);
    launch_cuda_step(plan, stream);
}

PreparedCudaStep prepare_cuda_step(std::vector<AnyArray> params, std::vector<AnyArray> exp_avgs,
                                   std::vector<AnyArray> exp_avg_sqs, std::vector<AnyArray> outs,
                                   const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets,
                                   const std::vector<int>& grad_kinds) {
    if (!ts::cuda_device_present())
        ts::throw_runtime_error("CudaAdamWBatch: no CUDA device or driver is present on this machine");
    PreparedCudaStep step;
    step.device = pick_device({&params, &exp_avgs, &exp_avg_sqs, &outs});
    ts::CudaDeviceGuard guard(step.device);
    step.prepared = prepare_plan("CudaAdamWBatch", params, exp_avgs, exp_avg_sqs, outs, slots, grad_kinds,
                                 placer(step.device, "CudaAdamWBatch"));
    assign_offsets("CudaAdamWBatch", step.prepared.plan.segments, offsets);  // kept by every with_grads() copy
    for (auto* list : {&params, &exp_avgs, &exp_avg_sqs, &outs})
        for (AnyArray& a : *list) step.arrays.push_back(std::move(a));
    return step;
}

void PreparedCudaStep::launch(const std::vector<uintptr_t>& grads, const StepArgs& args, uintptr_t stream) const {
    ts::CudaDeviceGuard guard(device);
    launch_cuda_step(prepared.with_grads("CudaAdamWBatch.step", grads, args), stream);
}

#else

void cuda_step(const std::vector<AnyArray>&, const std::vector<AnyArray>&, const std::vector<AnyArray>&,
               const std::vector<AnyArray>&, const std::vector<AnyArray>&, const std::vector<uint32_t>&,
               const std::vector<int64_t>&, const StepArgs&, uintptr_t) {
    ts::cuda_unavailable("cuda_adamw_step");
}

PreparedCudaStep prepare_cuda_step(std::vector<AnyArray>, std::vector<AnyArray>, std::vector<AnyArray>,
                                   std::vector<AnyArray>, const std::vector<uint32_t>&, const std::vector<int64_t>&,
                                   const std::vector<int>&) {
    ts::cuda_unavailable("CudaAdamWBatch");
}

void PreparedCudaStep::launch(const std::vector<uintptr_t>&, const StepArgs&, uintptr_t) const {
    ts::cuda_unavailable("CudaAdamWBatch");
}

#endif

}  // namespace ts_adamw
