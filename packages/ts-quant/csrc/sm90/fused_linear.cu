// Fused dequantize + matmul on Hopper (sm_90a): y[m, n] = x[m, k] @ W[n, k]^T
// + bias, with W in int8, NF4 or NVFP4 codes, never written out as bf16.
//
// The product is computed transposed, y^T = W x^T, so the quantized weight is
// wgmma's A operand, which may come from registers: each consumer thread loads
// its own codes straight from global memory, decodes them to bf16 pairs in
// registers (code value * block scale in fp32, rounded to bf16: the same bf16
// weight `dequantize` writes) and hands them to wgmma; x^T is the B operand,
// brought into shared memory by TMA. Decoding tile k+1 overlaps the tensor
// cores working on tile k.
//
// Register fragments want, per k16 step, the columns {2t, 2t+1, 2t+8, 2t+9}
// of two rows for lane t of a quad. The codes of a row come in storage order,
// so lane t instead loads the 16 consecutive values 16t..16t+15 of each
// 64-wide k tile (one 8- or 16-byte load) and uses them as those fragment
// columns; x's columns are permuted the same way within each 64-block before
// the matmul (permute_x_kernel), which leaves the sum over k unchanged:
//   logical column 16s + 8h + 2t + e  <-  stored column 16t + 4s + 2h + e.
//
// CTA: two consumer warpgroups (64 weight rows each) and one producer
// warpgroup, one lane of which streams 64-column tiles of the permuted x
// through a kStages ring.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "fused_linear.h"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

using namespace sm90;

constexpr int kTileK = 64;
constexpr int kStages = 4;
constexpr int kConsumerGroups = 2;
constexpr int kTileN = 64 * kConsumerGroups;                 // weight rows per CTA
constexpr int kConsumerWarps = 4 * kConsumerGroups;
constexpr int kFusedThreads = 32 * kConsumerWarps + 128;     // + the producer warpgroup
// Register split (setmaxnreg): each SM sub-partition runs two consumer warps
// and one producer warp, 2 * 232 + 40 = 504 registers a lane of its 512.
constexpr int kConsumerRegisters = 232;
constexpr int kProducerRegisters = 40;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TS_SM90A_DEVICE 1
#endif

__constant__ float kFusedNf4[16] = {TS_QUANT_NF4_CODES};
__constant__ float kFusedE2m1[16] = {TS_QUANT_E2M1_VALUES, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct FusedArgs {
    const uint8_t* codes;
    const void* scales;        // fp32 per block, or e4m3 bytes (nvfp4)
    const float* global_scale; // nvfp4 only
    const __nv_bfloat16* bias; // may be null
    __nv_bfloat16* out;        // [m, n]
    int m, n, k;
    int block_shift;           // log2(block size)
};

// One thread's codes for one row and one 64-wide k tile: values 16t..16t+15.
template <Format F>
struct RowCodes {
    static constexpr bool kFourBit = F != Format::int8;
    uint32_t w[kFourBit ? 2 : 4];

    __device__ __forceinline__ void load(const uint8_t* row, int kt, int t) {
        if constexpr (kFourBit) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(row + kt * 32 + t * 8));
            w[0] = v.x, w[1] = v.y;
        } else {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + kt * 64 + t * 16));
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        }
    }

    // bf16 pair of stored values (2j, 2j+1) of the 16, j in 0..7 (compile time).
    __device__ __forceinline__ uint32_t pair(int j, float scale, const float* table) const {
        float first, second;
        if constexpr (kFourBit) {
            const uint32_t byte = (w[j >> 2] >> (8 * (j & 3))) & 0xffu;
            const uint32_t hi = byte >> 4, lo = byte & 0xfu;
            // nf4 stores the first value in the high nibble, nvfp4 in the low one.
            first = table[F == Format::nf4 ? hi : lo];
            second = table[F == Format::nf4 ? lo : hi];
        } else {
            const uint32_t half = w[j >> 1] >> (16 * (j & 1));
            first = static_cast<float>(static_cast<int8_t>(half & 0xffu));
            second = static_cast<float>(static_cast<int8_t>((half >> 8) & 0xffu));
        }
        __nv_bfloat162 v = __floats2bfloat162_rn(first * scale, second * scale);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

template <Format F>
__device__ __forceinline__ float block_scale(const FusedArgs& a, int64_t first_value) {
    const int64_t slot = first_value >> a.block_shift;
    if constexpr (F == Format::nvfp4) {
        const uint32_t byte = __ldg(static_cast<const uint8_t*>(a.scales) + slot);
        const uint32_t em = byte & 0x7fu;  // exact e4m3 decode, as in the dequantize kernels
        const float magnitude = __uint_as_float(em << 20) * 0x1p120f;
        const float v = (byte & 0x80u) ? -magnitude : magnitude;
        return (em == 0x7fu ? __uint_as_float(0x7fc00000u) : v) * __ldg(a.global_scale);
    } else {
        return __ldg(static_cast<const float*>(a.scales) + slot);
    }
}

// The two rows (g and g + 8 of the warp's 16) one thread decodes.
template <Format F>
struct ThreadRows {
    const uint8_t* row[2];
    int64_t first[2];  // flat index of the row's first value
    RowCodes<F> codes[2];
    float scale[2];

    __device__ __forceinline__ void load(const FusedArgs& a, int kt, int t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            codes[r].load(row[r], kt, t);
            scale[r] = block_scale<F>(a, first[r] + kt * kTileK + 16 * t);
        }
    }

    // Fragments of the four k16 steps: {row0 cols 2t.., row1 cols 2t.., row0 cols 2t+8.., row1 cols 2t+8..}.
    __device__ __forceinline__ void decode(uint32_t (&frag)[4][4], const float* table) const {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                frag[s][2 * h] = codes[0].pair(2 * s + h, scale[0], table);
                frag[s][2 * h + 1] = codes[1].pair(2 * s + h, scale[1], table);
            }
        }
    }
};

template <Format F, int BM>
__global__ void __launch_bounds__(kFusedThreads, 1)
    fused_linear_kernel(const __grid_constant__ CUtensorMap x_map, const FusedArgs a) {
#if defined(TS_SM90A_DEVICE)
    extern __shared__ uint8_t smem_raw[];
    constexpr int kStageBytes = BM * kTileK * 2;
    // The 128-byte swizzle pattern repeats every 1024 bytes: stages start on that boundary.
    uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint64_t* full = reinterpret_cast<uint64_t*>(stages + kStages * kStageBytes);
    uint64_t* empty = full + kStages;
    float* table = reinterpret_cast<float*>(empty + kStages);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int tile_n = blockIdx.x * kTileN, tile_m = blockIdx.y * BM;
    const int k_tiles = a.k / kTileK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], kConsumerWarps);
        }
        mbar_fence_init();
    }
    if (threadIdx.x < 16) table[threadIdx.x] = F == Format::nvfp4 ? kFusedE2m1[threadIdx.x] : kFusedNf4[threadIdx.x];
    __syncthreads();

    if (warp >= kConsumerWarps) {  // producer warpgroup: one lane streams x tiles
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
        if (warp == kConsumerWarps && lane == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % kStages;
                if (kt >= kStages) mbar_wait(&empty[s], ((kt / kStages) - 1) & 1);
                mbar_arrive_expect_bytes(&full[s], kStageBytes);
                tma_load_2d(stages + s * kStageBytes, &x_map, &full[s], kt * kTileK, tile_m);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
    const int group = warp / 4, g = lane / 4, t = lane % 4;
    const int row0 = tile_n + group * 64 + (warp % 4) * 16 + g;
    ThreadRows<F> rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int n_row = min(row0 + 8 * r, a.n - 1);  // rows past n decode row n-1; never stored
        rows.first[r] = int64_t(n_row) * a.k;
        rows.row[r] = a.codes + (F == Format::int8 ? rows.first[r] : rows.first[r] / 2);
    }

    float acc[BM / 2];
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[i] = 0.0f;
    uint32_t frag[2][4][4];
    rows.load(a, 0, t);
    rows.decode(frag[0], table);
    if (k_tiles > 1) rows.load(a, 1, t);

    // One k tile: wait for x, issue 4 wgmmas from fragment buffer B, then
    // decode the next tile into the other buffer while they run.
    auto step = [&](int kt, uint32_t(&use)[4][4], uint32_t(&next)[4][4]) {
        const int s = kt % kStages;
        mbar_wait(&full[s], (kt / kStages) & 1);
        const uint64_t desc = kmajor_sw128_desc(stages + s * kStageBytes);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_bf16_rs<BM>(acc, use[ks], desc + 2 * ks);  // +32 bytes per k16
        wgmma_commit();
        wgmma_wait<1>();  // tile kt-1 is done: its x stage and fragment buffer are free
        if (kt > 0 && lane == 0) mbar_arrive(&empty[(kt - 1) % kStages]);
        if (kt + 1 < k_tiles) {
            rows.decode(next, table);
            if (kt + 2 < k_tiles) rows.load(a, kt + 2, t);
        }
    };
    int kt = 0;
    for (; kt + 1 < k_tiles; kt += 2) {
        step(kt, frag[0], frag[1]);
        step(kt + 1, frag[1], frag[0]);
    }
    if (kt < k_tiles) step(kt, frag[0], frag[1]);
    wgmma_wait<0>();
    fence_registers(acc);

    // Accumulator i holds y^T[row g (+8 if bit 1 of i)][col 8 * (i / 4) + 2t + (i & 1)].
    const float bias0 = a.bias && row0 < a.n ? __bfloat162float(a.bias[row0]) : 0.0f;
    const float bias1 = a.bias && row0 + 8 < a.n ? __bfloat162float(a.bias[row0 + 8]) : 0.0f;
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) {
        const int n_row = row0 + 8 * ((i >> 1) & 1);
        const int m_row = tile_m + 8 * (i >> 2) + 2 * t + (i & 1);
        if (n_row < a.n && m_row < a.m)
            a.out[int64_t(m_row) * a.n + n_row] = __float2bfloat16_rn(acc[i] + (((i >> 1) & 1) ? bias1 : bias0));
    }
#endif
}

// x [m, k] -> x_perm with each 64-column block permuted as in the header: one
// thread per (row, block), 128 bytes in and out.
__global__ void permute_x_kernel(const uint4* __restrict__ x, uint4* __restrict__ out, int64_t blocks) {
    const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (b >= blocks) return;
    uint32_t in[32], perm[32];  // 64 bf16 as 32 pairs; pairs never split (e is the pair's element)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint4 v = x[b * 8 + i];
        in[4 * i] = v.x, in[4 * i + 1] = v.y, in[4 * i + 2] = v.z, in[4 * i + 3] = v.w;
    }
    // logical pair (16s + 8h + 2t) / 2 = 8s + 4h + t  <-  stored pair (16t + 4s + 2h) / 2 = 8t + 2s + h
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int t = 0; t < 4; ++t) perm[8 * s + 4 * h + t] = in[8 * t + 2 * s + h];
#pragma unroll
    for (int i = 0; i < 8; ++i) out[b * 8 + i] = make_uint4(perm[4 * i], perm[4 * i + 1], perm[4 * i + 2], perm[4 * i + 3]);
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        TS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr)
            ts::throw_runtime_error("fused linear: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

CUtensorMap x_tensor_map(const void* x_perm, int m, int k, int box_rows) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(m)};
    const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
    const cuuint32_t box[2] = {cuuint32_t(kTileK), cuuint32_t(box_rows)};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(x_perm), dims,
                                            strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // rows past m read as zeros
    if (r != CUDA_SUCCESS) ts::throw_runtime_error("fused linear: cuTensorMapEncodeTiled failed with error ", int(r));
    return map;
}

template <Format F, int BM>
void launch(const CUtensorMap& map, const FusedArgs& a, cudaStream_t stream) {
    const size_t smem = 1024 + size_t(kStages) * BM * kTileK * 2 + 2 * kStages * sizeof(uint64_t) + 16 * sizeof(float);
    auto kernel = fused_linear_kernel<F, BM>;
    TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const dim3 grid((a.n + kTileN - 1) / kTileN, (a.m + BM - 1) / BM);
    kernel<<<grid, kFusedThreads, smem, stream>>>(map, a);
    TS_CUDA_CHECK_LAUNCH();
}

template <Format F>
void launch_format(const void* x_perm, const FusedArgs& a, cudaStream_t stream) {
    // The widest tile that the rows fill: less padding for small batches.
    if (a.m <= 64) return launch<F, 64>(x_tensor_map(x_perm, a.m, a.k, 64), a, stream);
    if (a.m <= 128) return launch<F, 128>(x_tensor_map(x_perm, a.m, a.k, 128), a, stream);
    launch<F, 256>(x_tensor_map(x_perm, a.m, a.k, 256), a, stream);
}

}  // namespace

bool fused_linear_supported(int device) {
    ts::CudaDeviceGuard guard(device);
    int major = 0, minor = 0;
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;
}

void fused_linear_sm90(Format format, const void* x, void* x_perm, int64_t m, int64_t k, const uint8_t* codes,
                       const void* scales, const float* global_scale, int64_t block, int64_t n, const void* bias,
                       void* out, int device, uintptr_t stream) {
    TS_CHECK_ARG(format != Format::fp8, "fused linear: fp8 weights take the scaled_mm path");
    TS_CHECK_ARG(k % kTileK == 0 && k > 0, "fused linear: in_features must be a positive multiple of 64, got ", k);
    TS_CHECK_ARG(block >= 16 && (block & (block - 1)) == 0, "fused linear: block size must be a power of two >= 16");
    TS_CHECK_ARG(m >= 0 && n > 0 && m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31),
                 "fused linear: sizes out of range");
    if (m == 0) return;
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int64_t blocks = m * (k / kTileK);
    permute_x_kernel<<<unsigned((blocks + 255) / 256), 256, 0, s>>>(static_cast<const uint4*>(x),
                                                                     static_cast<uint4*>(x_perm), blocks);
    TS_CUDA_CHECK_LAUNCH();
    int shift = 0;
    while ((int64_t(1) << shift) < block) ++shift;
    const FusedArgs a{codes, scales, global_scale, static_cast<const __nv_bfloat16*>(bias),
                      static_cast<__nv_bfloat16*>(out), int(m), int(n), int(k), shift};
    switch (format) {
        case Format::int8: return launch_format<Format::int8>(x_perm, a, s);
        case Format::nf4: return launch_format<Format::nf4>(x_perm, a, s);
        case Format::nvfp4: return launch_format<Format::nvfp4>(x_perm, a, s);
        default: break;
    }
}

}  // namespace ts_quant
