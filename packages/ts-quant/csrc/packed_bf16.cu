// Exponent-packed bf16 decoding on the GPU: 8 values per thread (an 8-byte load of low bytes, a
// 4-byte load of offsets, one 16-byte store), then one thread per escape. Bandwidth-bound: it reads
// 1.5 bytes and writes 2 per value.
#include <cuda_runtime.h>

#include <algorithm>

#include "packed_bf16.h"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

constexpr int kThreads = 256;

__global__ void unpack_groups_kernel(const uint2* __restrict__ low, const uint32_t* __restrict__ nibbles,
                                     uint4* __restrict__ out, int64_t groups, uint32_t base) {
    for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
        const uint2 l = low[g];
        const uint32_t h = nibbles[g];
        uint32_t v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t bytes = j < 2 ? l.x : l.y;
            const int shift = (j % 2) * 16;
            const uint32_t a = packed_value(bytes >> shift, h >> (8 * j), base);
            const uint32_t b = packed_value(bytes >> (shift + 8), h >> (8 * j + 4), base);
            v[j] = a | (b << 16);
        }
        out[g] = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

__global__ void unpack_tail_kernel(const uint8_t* __restrict__ low, const uint8_t* __restrict__ nibbles,
                                   uint16_t* __restrict__ out, int64_t begin, int64_t n, uint32_t base) {
    const int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i < n) out[i] = packed_value(low[i], (nibbles[i / 2] >> ((i % 2) * 4)) & 0xFu, base);
}

__global__ void escapes_kernel(const int32_t* __restrict__ indices, const uint16_t* __restrict__ values,
                               uint16_t* __restrict__ out, int64_t k) {
    const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (j < k) out[indices[j]] = values[j];
}

unsigned blocks_for(int64_t items, int64_t cap) {
    return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, cap)));
}

}  // namespace

void unpack_bf16_cuda(const uint8_t* segment, const PackedLayout& l, int base, uint16_t* out, int device,
                      uintptr_t stream) {
    if (l.n == 0) return;
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int64_t groups = l.n / 8;
    if (groups > 0) {
        unpack_groups_kernel<<<blocks_for(groups, 4096), kThreads, 0, s>>>(
            reinterpret_cast<const uint2*>(segment), reinterpret_cast<const uint32_t*>(segment + l.nibbles),
            reinterpret_cast<uint4*>(out), groups, uint32_t(base));
        TS_CUDA_CHECK_LAUNCH();
    }
    const int64_t rest = l.n - groups * 8;
    if (rest > 0) {
        unpack_tail_kernel<<<blocks_for(rest, 1), kThreads, 0, s>>>(segment, segment + l.nibbles, out, groups * 8, l.n,
                                                                   uint32_t(base));
        TS_CUDA_CHECK_LAUNCH();
    }
    if (l.k > 0) {
        escapes_kernel<<<blocks_for(l.k, int64_t(1) << 30), kThreads, 0, s>>>(
            reinterpret_cast<const int32_t*>(segment + l.indices), reinterpret_cast<const uint16_t*>(segment + l.values),
            out, l.k);
        TS_CUDA_CHECK_LAUNCH();
    }
}

}  // namespace ts_quant
