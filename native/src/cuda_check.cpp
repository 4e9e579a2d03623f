#include "ts/cuda_check.h"

#ifdef TS_WITH_CUDA
namespace ts {

bool cuda_device_present() {
    static const bool present = [] {
        int count = 0;
        cudaError_t status = cudaGetDeviceCount(&count);
        if (status != cudaSuccess) {
            cudaGetLastError();  // clear the sticky "no driver" error
            return false;
        }
        return count > 0;
    }();
    return present;
}

}  // namespace ts
#endif
