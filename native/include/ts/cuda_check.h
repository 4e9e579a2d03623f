// CUDA availability and error checks. Compiled with or without a toolkit:
// without one (TS_WITH_CUDA undefined) the CUDA entry points of a core throw
// ts::cuda_unavailable() instead of calling into a runtime that is not there.
#pragma once

#include "ts/errors.h"

#ifdef TS_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace ts {

// True when the core was compiled with CUDA sources.
constexpr bool built_with_cuda() {
#ifdef TS_WITH_CUDA
    return true;
#else
    return false;
#endif
}

[[noreturn]] inline void cuda_unavailable(const char* what) {
    throw_runtime_error(what,
                        " needs CUDA, but this build has no CUDA support. Reinstall with a CUDA "
                        "toolkit on PATH (or TS_ENABLE_CUDA=ON) to build the CUDA kernels.");
}

#ifdef TS_WITH_CUDA
inline void cuda_check(cudaError_t status, const char* call, const char* file, int line) {
    if (status != cudaSuccess) {
        throw_runtime_error("CUDA error in ", call, " (", file, ":", line, "): ",
                            cudaGetErrorName(status), ": ", cudaGetErrorString(status));
    }
}
// True when a CUDA device and a working driver are present (cached).
bool cuda_device_present();
#else
inline bool cuda_device_present() { return false; }
#endif

}  // namespace ts

#ifdef TS_WITH_CUDA
#define TS_CUDA_CHECK(expr) ::ts::cuda_check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: surfaces launch-configuration errors without a sync.
#define TS_CUDA_CHECK_LAUNCH() TS_CUDA_CHECK(cudaGetLastError())
#endif

#ifdef TS_WITH_CUDA
namespace ts {

// Makes `device` current for a scope (the caller's tensors live there) and
// restores the previous device on exit, also when an exception unwinds.
class CudaDeviceGuard {
public:
    explicit CudaDeviceGuard(int device) {
        TS_CUDA_CHECK(cudaGetDevice(&previous_));
        if (previous_ != device) TS_CUDA_CHECK(cudaSetDevice(device));
    }
    ~CudaDeviceGuard() {
        int current = -1;
        if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
    }
    CudaDeviceGuard(const CudaDeviceGuard&) = delete;
    CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

private:
    int previous_ = -1;
};

}  // namespace ts
#endif
