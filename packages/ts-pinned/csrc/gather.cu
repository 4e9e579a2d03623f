// gather_rows_cuda: one thread block per looked-up row; 16-byte loads where the row and both
// pointers allow, bytes otherwise. Reads cross the link (tens of GB/s over PCIe; docs/pinned.md), so a
// lookup of a few thousand rows costs tens of microseconds and never waits for the host.
#include <cuda_runtime.h>

#include "gather.h"
#include "ts/cuda_check.h"

namespace ts_pinned {
namespace {

__global__ void gather_rows_kernel(const uint8_t* __restrict__ table, int64_t rows, int64_t row_bytes,
                                   const int64_t* __restrict__ ids, uint8_t* __restrict__ out, int* bad, bool wide) {
    const int64_t r = blockIdx.x;
    const int64_t id = ids[r];
    uint8_t* dst = out + r * row_bytes;
    const bool valid = id >= 0 && id < rows;
    if (!valid && threadIdx.x == 0) *bad = 1;
    const uint8_t* src = table + (valid ? id : 0) * row_bytes;
    if (wide) {
        const int64_t words = row_bytes / 16;
        for (int64_t w = threadIdx.x; w < words; w += blockDim.x) {
            reinterpret_cast<uint4*>(dst)[w] = valid ? reinterpret_cast<const uint4*>(src)[w] : make_uint4(0, 0, 0, 0);
        }
    } else {
        for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) dst[b] = valid ? src[b] : 0;
    }
}

}  // namespace

const void* device_view_of_host(const void* host, int device) {
    ts::CudaDeviceGuard guard(device);
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, host) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error of an unknown pointer
        return nullptr;
    }
    if (attributes.type != cudaMemoryTypeHost || attributes.devicePointer == nullptr) return nullptr;
    return attributes.devicePointer;
}

void gather_rows_cuda(const void* table, int64_t rows, int64_t row_bytes, const int64_t* ids, int64_t n, void* out,
                      int* bad, int device, uintptr_t stream) {
    if (n == 0 || row_bytes == 0) return;
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0;
    const int threads = row_bytes >= 16 * 256 ? 256 : 128;
    gather_rows_kernel<<<static_cast<unsigned>(n), threads, 0, s>>>(static_cast<const uint8_t*>(table), rows,
                                                                    row_bytes, ids, static_cast<uint8_t*>(out), bad,
                                                                    wide);
    TS_CUDA_CHECK_LAUNCH();
}

}  // namespace ts_pinned
