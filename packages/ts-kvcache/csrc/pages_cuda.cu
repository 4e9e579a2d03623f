// CUDA path of the page copies, enqueued on the caller's stream; nothing here
// synchronizes. Pages live in page-locked host memory (or, for tests, device
// memory): both are reachable through unified addresses, so the copy engine
// takes cudaMemcpyDefault and the kernel dereferences the page addresses.
#include <cuda_runtime.h>

#include <algorithm>

#include "pages.h"
#include "ts/cuda_check.h"

namespace ts_kvcache {
namespace {

constexpr int kPagesPerLaunch = 64;  // 512 bytes of kernel parameters
constexpr int kThreads = 256;

struct PageTable {
    char* page[kPagesPerLaunch];
};

template <class V>
__global__ void copy_pages_kernel(PageTable table, char* slot, int64_t rows, int64_t row_pitch, int64_t page_width,
                                  int64_t first_page, int64_t column, int64_t width, bool to_pages) {
    const int64_t page = blockIdx.z;
    const int64_t vectors = width / int64_t(sizeof(V));
    for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
        V* in_slot = reinterpret_cast<V*>(slot + row * row_pitch + (first_page + page) * page_width + column);
        V* in_page = reinterpret_cast<V*>(table.page[page] + row * page_width + column);
        for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vectors;
             i += int64_t(gridDim.x) * blockDim.x) {
            if (to_pages)
                in_page[i] = in_slot[i];
            else
                in_slot[i] = in_page[i];
        }
    }
}

// The widest access every address and length of the job is aligned to.
int vector_bytes(const PageCopy& job) {
    uint64_t bits = reinterpret_cast<uint64_t>(job.slot) | uint64_t(job.row_pitch) | uint64_t(job.page_width) |
                    uint64_t(job.first_page * job.page_width) | uint64_t(job.column) | uint64_t(job.width);
    for (int64_t i = 0; i < job.count; ++i) bits |= job.pages[i];
    if (bits % 16 == 0) return 16;
    if (bits % 4 == 0) return 4;
    return 1;
}

template <class V>
void launch(const PageCopy& job, cudaStream_t stream) {
    const int64_t vectors = job.width / int64_t(sizeof(V));
    const unsigned x = static_cast<unsigned>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 16));
    const unsigned y = static_cast<unsigned>(std::min<int64_t>(job.rows, 4096));
    for (int64_t start = 0; start < job.count; start += kPagesPerLaunch) {
        const int64_t n = std::min<int64_t>(kPagesPerLaunch, job.count - start);
        PageTable table{};
        for (int64_t i = 0; i < n; ++i) table.page[i] = reinterpret_cast<char*>(job.pages[start + i]);
        dim3 grid(std::max(x, 1u), std::max(y, 1u), static_cast<unsigned>(n));
        copy_pages_kernel<V><<<grid, kThreads, 0, stream>>>(table, job.slot, job.rows, job.row_pitch,
                                                            job.page_width, job.first_page + start, job.column,
                                                            job.width, job.to_pages);
        TS_CUDA_CHECK_LAUNCH();
    }
}

}  // namespace

void copy_pages_cuda_engine(const PageCopy& job, int device, uintptr_t stream) {
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    for (int64_t i = 0; i < job.count; ++i) {
        char* in_slot = job.slot + (job.first_page + i) * job.page_width + job.column;
        char* page = reinterpret_cast<char*>(job.pages[i]) + job.column;
        if (job.to_pages)
            TS_CUDA_CHECK(cudaMemcpy2DAsync(page, job.page_width, in_slot, job.row_pitch, job.width, job.rows,
                                            cudaMemcpyDefault, s));
        else
            TS_CUDA_CHECK(cudaMemcpy2DAsync(in_slot, job.row_pitch, page, job.page_width, job.width, job.rows,
                                            cudaMemcpyDefault, s));
    }
}

void copy_pages_cuda_kernel(const PageCopy& job, int device, uintptr_t stream) {
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    switch (vector_bytes(job)) {
        case 16: launch<uint4>(job, s); break;
        case 4: launch<uint32_t>(job, s); break;
        default: launch<uint8_t>(job, s); break;
    }
}

}  // namespace ts_kvcache
