#include "probes.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/thread_pool.h"

namespace ts_planner {

namespace {

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};

void parallel_copy(char* dst, const char* src, size_t bytes, int threads) {
    constexpr int64_t kPiece = 1 << 20;
    int64_t pieces = static_cast<int64_t>((bytes + kPiece - 1) / kPiece);
    ts::host_pool().parallel_for(
        pieces, 1,
        [&](int64_t begin, int64_t end) {
            size_t from = static_cast<size_t>(begin) * kPiece;
            size_t to = std::min(bytes, static_cast<size_t>(end) * kPiece);
            std::memcpy(dst + from, src + from, to - from);
        },
        threads);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double host_copy_gbps(size_t bytes, int threads, int repeats) {
    TS_CHECK_ARG(bytes >= (1u << 20), "host_copy_gbps: bytes must be at least 1 MiB, got ", bytes);
    TS_CHECK_ARG(repeats >= 1 && threads >= 0, "host_copy_gbps: repeats >= 1 and threads >= 0 required");
    void* a = nullptr;
    void* b = nullptr;
    if (posix_memalign(&a, 4096, bytes) != 0 || posix_memalign(&b, 4096, bytes) != 0) {
        std::free(a);
        ts::throw_memory_error("host_copy_gbps: could not allocate 2 x ", bytes, " bytes");
    }
    std::unique_ptr<void, FreeDeleter> keep_a(a), keep_b(b);
    // First touch from the pool, so pages land near the threads that copy them.
    ts::host_pool().parallel_for(
        static_cast<int64_t>(bytes >> 20), 1,
        [&](int64_t begin, int64_t end) {
            std::memset(static_cast<char*>(a) + (begin << 20), 1, static_cast<size_t>(end - begin) << 20);
            std::memset(static_cast<char*>(b) + (begin << 20), 0, static_cast<size_t>(end - begin) << 20);
        },
        threads);
    double best = 0;
    for (int r = 0; r < repeats; ++r) {
        auto start = std::chrono::steady_clock::now();
        parallel_copy(static_cast<char*>(b), static_cast<const char*>(a), bytes, threads);
        best = std::max(best, 2.0 * double(bytes) / seconds_since(start) / 1e9);
    }
    return best;
}

#ifdef TS_WITH_CUDA
LinkRates link_gbps(size_t bytes, int device, int repeats) {
    TS_CHECK_ARG(bytes >= (1u << 20) && repeats >= 1, "link_gbps: bytes >= 1 MiB and repeats >= 1 required");
    if (!ts::cuda_device_present()) ts::throw_runtime_error("link_gbps: no CUDA device or driver");
    ts::CudaDeviceGuard guard(device);
    void* host[2] = {nullptr, nullptr};
    void* dev[2] = {nullptr, nullptr};
    cudaStream_t streams[2] = {nullptr, nullptr};
    cudaEvent_t marks[4] = {nullptr, nullptr, nullptr, nullptr};
    auto release = [&] {
        for (void* p : host) cudaFreeHost(p);
        for (void* p : dev) cudaFree(p);
        for (cudaStream_t s : streams) if (s) cudaStreamDestroy(s);
        for (cudaEvent_t e : marks) if (e) cudaEventDestroy(e);
    };
    try {
        for (int i = 0; i < 2; ++i) {
            TS_CUDA_CHECK(cudaHostAlloc(&host[i], bytes, cudaHostAllocPortable));
            TS_CUDA_CHECK(cudaMalloc(&dev[i], bytes));
            TS_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
        }
        for (cudaEvent_t& e : marks) TS_CUDA_CHECK(cudaEventCreate(&e));
        auto timed = [&](bool h2d, bool d2h) {
            float best_ms = 1e30f;
            for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up
                TS_CUDA_CHECK(cudaEventRecord(marks[0], streams[0]));
                TS_CUDA_CHECK(cudaStreamWaitEvent(streams[1], marks[0], 0));
                if (h2d) TS_CUDA_CHECK(cudaMemcpyAsync(dev[0], host[0], bytes, cudaMemcpyHostToDevice, streams[0]));
                if (d2h) TS_CUDA_CHECK(cudaMemcpyAsync(host[1], dev[1], bytes, cudaMemcpyDeviceToHost, streams[1]));
                TS_CUDA_CHECK(cudaEventRecord(marks[1], streams[1]));
                TS_CUDA_CHECK(cudaStreamWaitEvent(streams[0], marks[1], 0));
                TS_CUDA_CHECK(cudaEventRecord(marks[2], streams[0]));
                TS_CUDA_CHECK(cudaEventSynchronize(marks[2]));
                float ms = 0;
                TS_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[0], marks[2]));
                if (r > 0) best_ms = std::min(best_ms, ms);
            }
            return (double(bytes) * (int(h2d) + int(d2h))) / (double(best_ms) * 1e-3) / 1e9;
        };
        LinkRates rates;
        rates.h2d_gbps = timed(true, false);
        rates.d2h_gbps = timed(false, true);
        rates.both_gbps = timed(true, true);
        release();
        return rates;
    } catch (...) {
        release();
        throw;
    }
}
#else
LinkRates link_gbps(size_t, int, int) { ts::cuda_unavailable("link_gbps"); }
#endif

}  // namespace ts_planner
