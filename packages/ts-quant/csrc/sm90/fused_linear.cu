// Fused dequantize + matmul on Hopper (sm_90a): y[m, n] = x[m, k] @ W[n, k]^T
// + bias, with W in int8, NF4 or NVFP4 codes, never written out as bf16.
//
// The product is computed transposed, y^T = W x^T, so the quantized weight is
// wgmma's A operand, which may come from registers: the codes and scales of a
// 64-wide k tile reach shared memory by TMA and cp.async, each consumer thread
// decodes its fragment to bf16 pairs in registers (code value * block scale
// in fp32, rounded to bf16: the same bf16 weight `dequantize` writes) and
// hands them to wgmma; x^T is the B operand, brought in by TMA. Decoding tile
// k+1 overlaps the tensor cores working on tile k.
//
// Register fragments want, per k16 step s, columns 16s + {2t, 2t+1, 2t+8,
// 2t+9} of two rows for lane t of a quad: with 4-bit codes those pairs are
// bytes 8s + t and 8s + 4 + t of the row's 32 bytes, so every lane reads the
// whole row (16-byte loads, broadcast within the quad) and takes byte t of
// each word; int8 pairs are 16-bit halves, picked the same way.
//
// CTA: two consumer warpgroups (64 weight rows each) and one producer
// warpgroup: one lane streams 64-column tiles of x and the codes by TMA,
// every lane one row's scales by cp.async, through a ring of as many stages
// as shared memory holds.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstring>

#include "cuda_decode.cuh"
#include "fused_linear.h"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "ts/cuda_check.h"

namespace ts_quant {
namespace {

using namespace sm90;

constexpr int kTileK = 64;
constexpr int kMaxSmem = 227 * 1024;  // dynamic shared memory one block may have on sm_90
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
__constant__ float kFusedE2m1[16] = {TS_QUANT_E2M1_SIGNED_VALUES};

struct FusedArgs {
    const uint8_t* scales;     // fp32 per block, or e4m3 bytes (nvfp4)
    const float* global_scale; // nvfp4 only
    const __nv_bfloat16* bias; // may be null
    __nv_bfloat16* out;        // [m, n]
    int m, n, k;
    int block_shift;           // log2(block size)
};

// Shared memory of one pipeline stage: the x tile (TMA, 128-byte swizzle),
// the weight codes of the CTA's 128 rows (TMA, plain rows) and their scales
// (cp.async by the producer warpgroup, 8 bytes a row: one or two fp32
// block scales, or four e4m3 NVFP4 scales).
template <Format F, int BM>
struct StageLayout {
    static constexpr int kCodeRowBytes = F == Format::int8 ? kTileK : kTileK / 2;
    static constexpr int kScaleRowBytes = 8;
    static constexpr int kXBytes = BM * kTileK * 2;
    static constexpr int kCodeBytes = kTileN * kCodeRowBytes;
    static constexpr int kScaleBytes = kTileN * kScaleRowBytes;
    static constexpr int kBytes = kXBytes + kCodeBytes + kScaleBytes;  // a multiple of 1024
    static_assert(kBytes % 1024 == 0, "stages must keep the 1024-byte alignment of the swizzled x tile");
    // As many stages as fit (at most 12): a stage is refilled two tiles after
    // it was consumed, so the loads have (stages - 2) tiles of time to land,
    // which is what short tiles (small m) need to stay busy.
    // Output tile [BM][kTileN] bf16 staged for 16-byte stores, rows padded by
    // 16 bytes against bank conflicts; its own space, as the producer is
    // already filling stages for the next tile while it is stored. Where it
    // would leave fewer than 4 stages (int8 at BM = 256), stages win and the
    // accumulators are stored straight from registers.
    static constexpr int kOutRowBytes = kTileN * 2 + 16;
    static constexpr int kBarrierBytes = 2 * 12 * sizeof(uint64_t);
    static constexpr int kStagesIfStaged = (kMaxSmem - 1024 - kBarrierBytes - BM * kOutRowBytes) / kBytes;
    static constexpr bool kStagedOut = kStagesIfStaged >= 4;
    static constexpr int kOutBytes = kStagedOut ? BM * kOutRowBytes : 0;
    static constexpr int kRoom = (kMaxSmem - 1024 - kBarrierBytes - kOutBytes) / kBytes;
    static constexpr int kStages = kRoom < 12 ? kRoom : 12;
    static_assert(kStages >= 3, "a stage is too large for the pipeline");
    static constexpr size_t kSmem = 1024 + size_t(kStages) * kBytes + kOutBytes + 2 * kStages * sizeof(uint64_t);
};

// One row's codes and scales for one 64-wide k tile, as lane t of its quad
// decodes them.
template <Format F>
struct RowCodes {
    static constexpr bool kFourBit = F != Format::int8;
    static constexpr int kWords = kFourBit ? 8 : 16;  // the row's 32 or 64 bytes
    uint32_t w[kWords];
    float scale[4];  // of each k16 step

    __device__ __forceinline__ void load(const uint8_t* codes, const uint8_t* scales, int block_shift, float global) {
#pragma unroll
        for (int i = 0; i < kWords / 4; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(codes)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
        if constexpr (F == Format::nvfp4) {  // blocks of 16: one e4m3 scale per k16 step
            const uint32_t bytes = *reinterpret_cast<const uint32_t*>(scales);
#pragma unroll
            for (int s = 0; s < 4; ++s) scale[s] = e4m3_value((bytes >> (8 * s)) & 0xffu) * global;
        } else {  // blocks of 32 (steps 0-1 and 2-3) or >= 64 (one scale)
            const float2 f = *reinterpret_cast<const float2*>(scales);
#pragma unroll
            for (int s = 0; s < 4; ++s) scale[s] = block_shift >= 6 || s < 2 ? f.x : f.y;
        }
    }

    // bf16 pair of columns 16s + 8h + 2t, +1 (s, h compile time; t the lane in the quad).
    __device__ __forceinline__ uint32_t pair(int s, int h, int t, const float* table) const {
        float first, second;
        if constexpr (kFourBit) {
            const uint32_t byte = __byte_perm(w[2 * s + h], 0, 0x4440 | t);  // byte t, zero-extended
            const uint32_t hi = byte >> 4, lo = byte & 0xfu;
            // nf4 stores the first value in the high nibble, nvfp4 in the low one.
            first = table[F == Format::nf4 ? hi : lo];
            second = table[F == Format::nf4 ? lo : hi];
        } else {  // bytes 16s + 8h + 2t, +1: half (t & 1) of word 4s + 2h + (t >> 1)
            const uint32_t word = (t & 2) ? w[4 * s + 2 * h + 1] : w[4 * s + 2 * h];
            const uint32_t half = word >> (16 * (t & 1));
            first = static_cast<float>(static_cast<int8_t>(half & 0xffu));
            second = static_cast<float>(static_cast<int8_t>((half >> 8) & 0xffu));
        }
        __nv_bfloat162 v = __floats2bfloat162_rn(first * scale[s], second * scale[s]);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

// Producer side of the scales: the bytes covering one row's 64 values of tile kt.
template <Format F>
__device__ __forceinline__ void stage_scales(uint8_t* dst, const FusedArgs& a, int64_t row_first_value, int kt) {
    const int64_t first_block = (row_first_value + int64_t(kt) * kTileK) >> a.block_shift;
    const uint32_t d = smem_addr(dst);
    if constexpr (F == Format::nvfp4) {
        cp_async(d, a.scales + first_block, 4);
    } else {
        const int count = a.block_shift >= 6 ? 1 : 2;  // blocks >= 64, or of 32
        cp_async(d, a.scales + first_block * 4, 4 * count);
    }
}

// Stream-K split of the work over a persistent grid: the (tile, k tile)
// iterations, tile-major, are cut into `grid` equal ranges, one per CTA. A
// tile is finished by the CTA that holds its k tile 0 (at the end of that
// CTA's range, the last work it does); the CTAs holding the rest of the tile
// (each at the start of its range) leave fp32 partial sums in their workspace
// slot and raise their flag first, so nobody waits on work that comes later.
// Every tile then sums the same partials in the same order: the result does
// not depend on timing.
struct Schedule {
    int tiles_n, k_tiles, grid;
    int64_t iterations;  // tiles * k_tiles
    __device__ __forceinline__ int64_t begin(int cta) const { return int64_t(cta) * iterations / grid; }
    __device__ __forceinline__ int owner(int64_t it) const { return int(((it + 1) * grid - 1) / iterations); }
};

// Which launch a flag belongs to is kept on the device, not passed by the host, so a captured CUDA
// graph replays correctly: a kernel argument would be frozen into the graph, and every replay would
// take the ready flags its previous replay left for this one (summing stale partials).
//
// `epoch` is one 64-bit word: high half the token of the last launch that completed on it, low half
// the CTAs of the running launch that have taken their ticket. Each CTA makes exactly one atomicAdd
// of 1 (its ticket) and derives the launch's token as high + 1 (0 skipped: zeroed flags hold it).
// All tickets of a launch see the same high half, as only the adds of this launch touch the word
// until the CTA whose ticket was grid - 1 (so the last: all others have taken theirs) stores
// {token, 0} (after its own add in the word's coherence order, being one thread on one address).
// The next launch on the stream starts after this one completed, so it reads the new word.
struct Partials {
    float* workspace;          // [grid][BM / 2][256] fp32: slot of each CTA, accumulator-major
    int* flags;                // [grid]: a slot is ready when its flag holds this launch's token
    unsigned long long* epoch; // {last token, tickets taken}, zeroed by the caller before first use
};

__device__ __forceinline__ int launch_token(unsigned long long ticket) {
    const uint32_t last = uint32_t(ticket >> 32);
    return int(last == 0xffffffffu ? 1u : last + 1u);  // 1, 2, ..., 2^32 - 1, 1, ...: never 0
}

template <Format F, int BM>
__global__ void __launch_bounds__(kFusedThreads, 1)
    fused_linear_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap code_map,
                        const FusedArgs a, const Schedule sched, const Partials partials) {
#if defined(TS_SM90A_DEVICE)
    using L = StageLayout<F, BM>;
    constexpr int kStages = L::kStages;
    constexpr int kConsumers = 32 * kConsumerWarps;
    extern __shared__ uint8_t smem_raw[];
    __shared__ float table[16];  // a static array: its loads compile to LDS with a constant address
    // The 128-byte swizzle pattern repeats every 1024 bytes: stages start on that boundary. Offsetting
    // smem_raw itself (not a cast integer) keeps every derived pointer known to be shared memory, so
    // the decode reads are LDS rather than generic 64-bit loads.
    uint8_t* stages = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    uint8_t* out_tile = stages + kStages * L::kBytes;
    uint64_t* full = reinterpret_cast<uint64_t*>(out_tile + L::kOutBytes);
    uint64_t* empty = full + kStages;
    auto x_tile = [&](int s) { return stages + s * L::kBytes; };
    auto code_tile = [&](int s) { return stages + s * L::kBytes + L::kXBytes; };
    auto scale_tile = [&](int s) { return stages + s * L::kBytes + L::kXBytes + L::kCodeBytes; };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kt_count = sched.k_tiles;
    const int64_t range_begin = sched.begin(blockIdx.x), range_end = sched.begin(blockIdx.x + 1);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(&full[s], 1 + kTileN);  // the TMA issuer's arrival + one cp.async arrival per row
            mbar_init(&empty[s], kConsumerWarps);
        }
        mbar_fence_init();
    }
    if (threadIdx.x < 16) table[threadIdx.x] = F == Format::nvfp4 ? kFusedE2m1[threadIdx.x] : kFusedNf4[threadIdx.x];
    __syncthreads();

    // Segments of this CTA's range: tile, first and end k tile.
    struct Segment {
        int tile, kb, ke;
    };
    auto segment_at = [&](int64_t it) {
        const int tile = int(it / kt_count), kb = int(it - int64_t(tile) * kt_count);
        const int64_t left = range_end - it;
        return Segment{tile, kb, int(left < kt_count - kb ? kb + left : kt_count)};
    };

    if (warp >= kConsumerWarps) {  // producer warpgroup: lane 0 issues the TMA, every thread one row's scales
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
        const int p = threadIdx.x - kConsumers;
        int j = 0;  // k tiles loaded so far: stage j % kStages, round j / kStages
        for (int64_t it = range_begin; it < range_end;) {
            const Segment seg = segment_at(it);
            const int tile_n = (seg.tile % sched.tiles_n) * kTileN, tile_m = (seg.tile / sched.tiles_n) * BM;
            const int row = tile_n + p;
            const int64_t row_first_value = int64_t(row) * a.k;
            for (int kt = seg.kb; kt < seg.ke; ++kt, ++j) {
                const int s = j % kStages;
                if (j >= kStages) mbar_wait(&empty[s], ((j / kStages) - 1) & 1);
                if (p == 0) {
                    mbar_arrive_expect_bytes(&full[s], L::kXBytes + L::kCodeBytes);
                    tma_load_2d(x_tile(s), &x_map, &full[s], kt * kTileK, tile_m);
                    tma_load_2d(code_tile(s), &code_map, &full[s], kt * L::kCodeRowBytes, tile_n);
                }
                if (row < a.n) stage_scales<F>(scale_tile(s) + p * L::kScaleRowBytes, a, row_first_value, kt);
                cp_async_arrive_noinc(&full[s]);  // arrives once this thread's copies land
            }
            it += seg.ke - seg.kb;
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
    // Thread 0 alone signals and waits on flags. Its ticket is first needed after the first segment's
    // main loop, so the atomic's latency hides behind the pipeline fill.
    unsigned long long ticket = 0;
    if (threadIdx.x == 0) ticket = atomicAdd(partials.epoch, 1ull);
    const int group = warp / 4, g = lane / 4, t = lane % 4;
    const int local0 = group * 64 + (warp % 4) * 16 + g;  // rows local0 and local0 + 8 of the CTA tile
    const float global = F == Format::nvfp4 ? __ldg(a.global_scale) : 0.0f;
    auto consumers_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); };

    float acc[BM / 2];
    uint32_t frag[3][4][4];  // fragment buffer of the segment's i-th k tile: frag[i % 3]
    int j0 = 0;              // k tiles consumed before this segment

    // Fragments of the four k16 steps of the k tile in `stage` (full):
    // {row0 cols 2t.., row1 cols 2t.., row0 cols 2t+8.., row1 cols 2t+8..}.
    auto decode = [&](int stage, uint32_t(&out)[4][4]) {
        RowCodes<F> rows[2];
#pragma unroll
        for (int r = 0; r < 2; ++r)
            rows[r].load(code_tile(stage) + (local0 + 8 * r) * L::kCodeRowBytes,
                         scale_tile(stage) + (local0 + 8 * r) * L::kScaleRowBytes, a.block_shift, global);
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                out[ks][2 * h] = rows[0].pair(ks, h, t, table);
                out[ks][2 * h + 1] = rows[1].pair(ks, h, t, table);
            }
        }
    };

    for (int64_t it = range_begin; it < range_end;) {
        const Segment seg = segment_at(it);
        const int len = seg.ke - seg.kb;
        const int tile_n = (seg.tile % sched.tiles_n) * kTileN, tile_m = (seg.tile / sched.tiles_n) * BM;

        // One k tile (the segment's i-th, global j0 + i): 4 wgmmas from `use`. Two tiles of wgmmas stay
        // in flight; once tile i-2 is done its stage goes back to the producer and its fragment buffer
        // takes tile i+1, decoded while i-1 and i run.
        auto step = [&](int i, uint32_t(&use)[4][4], uint32_t(&next)[4][4]) {
            const int j = j0 + i;
            const uint64_t desc = kmajor_sw128_desc(x_tile(j % kStages));
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks) wgmma_bf16_rs<BM>(acc, use[ks], desc + 2 * ks);  // +32 bytes per k16
            wgmma_commit();
            wgmma_wait<2>();
            if (i >= 2 && lane == 0) mbar_arrive(&empty[(j - 2) % kStages]);
            if (i + 1 < len) {
                mbar_wait(&full[(j + 1) % kStages], ((j + 1) / kStages) & 1);
                decode((j + 1) % kStages, next);
            }
        };
#pragma unroll
        for (int i = 0; i < BM / 2; ++i) acc[i] = 0.0f;
        mbar_wait(&full[j0 % kStages], (j0 / kStages) & 1);
        decode(j0 % kStages, frag[0]);
        int i = 0;
        for (; i + 2 < len; i += 3) {
            step(i, frag[0], frag[1]);
            step(i + 1, frag[1], frag[2]);
            step(i + 2, frag[2], frag[0]);
        }
        if (i < len) step(i, frag[0], frag[1]);
        if (i + 1 < len) step(i + 1, frag[1], frag[2]);
        wgmma_wait<0>();
        fence_registers(acc);
        if (lane == 0)  // the last two stages of the segment were not handed back by step()
            for (int r = len > 2 ? len - 2 : 0; r < len; ++r) mbar_arrive(&empty[(j0 + r) % kStages]);
        j0 += len;
        it += len;

        // Accumulator e holds y^T[row g (+8 if bit 1 of e)][col 8 * (e / 4) + 2t + (e & 1)].
        float* slot = partials.workspace + size_t(blockIdx.x) * (BM / 2) * kConsumers + threadIdx.x;
        if (seg.kb > 0) {  // not the tile's k tile 0: leave the partial sum for the finishing CTA
#pragma unroll
            for (int e = 0; e < BM / 2; ++e) __stcg(slot + e * kConsumers, acc[e]);
            __threadfence();
            consumers_sync();
            if (threadIdx.x == 0) atomicExch(partials.flags + blockIdx.x, launch_token(ticket));
            continue;
        }
        // Finishing CTA: add the partials of the CTAs that hold the rest of the tile, in k order.
        for (int64_t rest = int64_t(seg.tile) * kt_count + seg.ke; rest < int64_t(seg.tile + 1) * kt_count;) {
            const int cta = sched.owner(rest);
            if (threadIdx.x == 0) {
                const int token = launch_token(ticket);
                while (atomicAdd(partials.flags + cta, 0) != token) __nanosleep(256);
                __threadfence();
            }
            consumers_sync();
            const float* other = partials.workspace + size_t(cta) * (BM / 2) * kConsumers + threadIdx.x;
#pragma unroll
            for (int e = 0; e < BM / 2; ++e) acc[e] += __ldcg(other + e * kConsumers);
            rest = sched.begin(cta + 1);
        }

        const int row0 = tile_n + local0;
        const float bias0 = a.bias && row0 < a.n ? __bfloat162float(a.bias[row0]) : 0.0f;
        const float bias1 = a.bias && row0 + 8 < a.n ? __bfloat162float(a.bias[row0 + 8]) : 0.0f;
        if constexpr (!L::kStagedOut) {  // straight from registers: 16 bytes per 8 lanes
#pragma unroll
            for (int e = 0; e < BM / 2; ++e) {
                const int n_row = row0 + 8 * ((e >> 1) & 1);
                const int m_row = tile_m + 8 * (e >> 2) + 2 * t + (e & 1);
                if (n_row < a.n && m_row < a.m)
                    a.out[int64_t(m_row) * a.n + n_row] = __float2bfloat16_rn(acc[e] + (((e >> 1) & 1) ? bias1 : bias0));
            }
            continue;
        }
        // Store: transpose through shared memory into [BM][128], then whole 16-byte row pieces.
        consumers_sync();  // the previous tile's pieces are all read
#pragma unroll
        for (int e = 0; e < BM / 2; ++e) {
            const int n_local = local0 + 8 * ((e >> 1) & 1);
            const int m_local = 8 * (e >> 2) + 2 * t + (e & 1);
            *reinterpret_cast<__nv_bfloat16*>(out_tile + m_local * L::kOutRowBytes + n_local * 2) =
                __float2bfloat16_rn(acc[e] + (((e >> 1) & 1) ? bias1 : bias0));
        }
        consumers_sync();
        constexpr int kPieces = kTileN / 8;  // 16-byte pieces per output row
        const bool vector_rows = a.n % 8 == 0;
        for (int idx = threadIdx.x; idx < BM * kPieces; idx += kConsumers) {
            const int m_local = idx / kPieces, n_local = (idx % kPieces) * 8;
            const int m_row = tile_m + m_local, n_col = tile_n + n_local;
            if (m_row >= a.m || n_col >= a.n) continue;
            const uint8_t* src = out_tile + m_local * L::kOutRowBytes + n_local * 2;
            __nv_bfloat16* dst = a.out + int64_t(m_row) * a.n + n_col;
            if (vector_rows && n_col + 8 <= a.n) {
                *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
            } else {
                for (int e = 0; e < 8 && n_col + e < a.n; ++e) dst[e] = reinterpret_cast<const __nv_bfloat16*>(src)[e];
            }
        }
    }
    // The CTA that took the launch's last ticket hands the next launch its epoch (see Partials).
    if (threadIdx.x == 0 && uint32_t(ticket) == uint32_t(sched.grid - 1))
        atomicExch(partials.epoch, static_cast<unsigned long long>(uint32_t(launch_token(ticket))) << 32);
#endif
}

// Errors by which the runtime says this kernel cannot run on this device and driver (no image for
// it, more shared memory or registers than it has): FusedLinearUnavailable. Anything else (a broken
// context, a capture gone wrong, memory) is a RuntimeError that must reach the caller.
bool means_unavailable(cudaError_t status) {
    switch (status) {
        case cudaErrorInvalidDeviceFunction:
        case cudaErrorNoKernelImageForDevice:
        case cudaErrorInvalidKernelImage:
        case cudaErrorUnsupportedPtxVersion:
        case cudaErrorInvalidConfiguration:
        case cudaErrorLaunchOutOfResources:
        case cudaErrorInvalidValue:  // cudaFuncSetAttribute: more dynamic shared memory than the device has
            return true;
        default:
            return false;
    }
}

void check_available(cudaError_t status, const char* call) {
    if (status == cudaSuccess) return;
    if (means_unavailable(status))
        throw_fused_unavailable("fused linear: ", call, " failed with ", cudaGetErrorName(status), " (",
                                cudaGetErrorString(status), "): this device or build cannot run the sm_90a kernel");
    ts::cuda_check(status, call, __FILE__, __LINE__);
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
        TS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == nullptr)
            throw_fused_unavailable("fused linear: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

CUtensorMap tensor_map_2d(CUtensorMapDataType type, const void* base, int64_t inner, int64_t outer,
                          int64_t row_bytes, int box_inner, int box_outer, CUtensorMapSwizzle swizzle) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {cuuint64_t(inner), cuuint64_t(outer)};
    const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
    const cuuint32_t box[2] = {cuuint32_t(box_inner), cuuint32_t(box_outer)};
    const cuuint32_t element_strides[2] = {1, 1};
    // Boxes past the tensor's edge (rows past m or n) read as zeros.
    const CUresult r = tensor_map_encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box,
                                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r == CUDA_ERROR_INVALID_VALUE)  // a geometry the tensor-memory accelerator does not take
        throw_fused_unavailable("fused linear: cuTensorMapEncodeTiled refused a ", outer, " x ", inner, " operand");
    if (r != CUDA_SUCCESS) ts::throw_runtime_error("fused linear: cuTensorMapEncodeTiled failed with error ", int(r));
    return map;
}

template <Format F>
constexpr int code_row_bytes() {
    return StageLayout<F, 64>::kCodeRowBytes;  // the same for every BM
}

static_assert(sizeof(CUtensorMap) == kFusedCodeMapBytes, "fused_linear.h's size of a tensor map");

CUtensorMap code_map_for(Format format, const uint8_t* codes, int64_t n, int64_t k) {
    const int box = format == Format::int8 ? code_row_bytes<Format::int8>() : code_row_bytes<Format::nf4>();
    static_assert(code_row_bytes<Format::nf4>() == code_row_bytes<Format::nvfp4>(), "4-bit rows agree");
    const int64_t row_bytes = k * box / kTileK;
    return tensor_map_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, codes, row_bytes, n, row_bytes, box, kTileN,
                         CU_TENSOR_MAP_SWIZZLE_NONE);
}

// cudaFuncSetAttribute costs a driver call per launch; it holds per (kernel, device) once it succeeded.
// Devices 0..63 are remembered in one bit each (3 formats x 3 tile widths); others set it every time.
std::atomic<uint64_t> g_smem_set[3][3];

int tile_index(int bm) { return bm == 64 ? 0 : (bm == 128 ? 1 : 2); }

template <Format F, int BM>
void launch(const void* x, const CUtensorMap& code_map, const FusedArgs& a, const Partials& partials, int max_grid,
            int device, cudaStream_t stream) {
    using L = StageLayout<F, BM>;
    const CUtensorMap x_map = tensor_map_2d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, x, a.k, a.m, int64_t(a.k) * 2,
                                            kTileK, BM, CU_TENSOR_MAP_SWIZZLE_128B);
    auto kernel = fused_linear_kernel<F, BM>;
    std::atomic<uint64_t>& set = g_smem_set[int(F) == int(Format::int8) ? 0 : (F == Format::nf4 ? 1 : 2)][tile_index(BM)];
    const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
    if (!bit || !(set.load(std::memory_order_relaxed) & bit)) {
        check_available(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::kSmem)),
                        "cudaFuncSetAttribute");
        set.fetch_or(bit, std::memory_order_relaxed);
    }
    Schedule sched{};
    sched.tiles_n = (a.n + kTileN - 1) / kTileN;
    sched.k_tiles = a.k / kTileK;
    sched.iterations = int64_t(sched.tiles_n) * ((a.m + BM - 1) / BM) * sched.k_tiles;
    sched.grid = int(sched.iterations < max_grid ? sched.iterations : max_grid);
    kernel<<<sched.grid, kFusedThreads, L::kSmem, stream>>>(x_map, code_map, a, sched, partials);
    check_available(cudaGetLastError(), "the kernel launch");
}

template <Format F>
void launch_format(const void* x, const CUtensorMap& code_map, const FusedArgs& a, int tile_m, const Partials& p,
                   int max_grid, int device, cudaStream_t stream) {
    switch (tile_m) {
        case 64: return launch<F, 64>(x, code_map, a, p, max_grid, device, stream);
        case 128: return launch<F, 128>(x, code_map, a, p, max_grid, device, stream);
        case 256: return launch<F, 256>(x, code_map, a, p, max_grid, device, stream);
        default: ts::throw_value_error("fused linear: tile_m must be 0 (auto), 64, 128 or 256, got ", tile_m);
    }
}

// The SM count per device (constant for the process; a driver query per call otherwise).
std::atomic<int> g_sms[64];

int sm_count(int device) {
    if (device >= 0 && device < 64) {
        if (const int cached = g_sms[device].load(std::memory_order_relaxed)) return cached;
    }
    int sms = 0;
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (device >= 0 && device < 64) g_sms[device].store(sms, std::memory_order_relaxed);
    return sms;
}

void check_geometry(Format format, int64_t m, int64_t k, int64_t block, int64_t n) {
    TS_CHECK_ARG(format != Format::fp8, "fused linear: fp8 weights take the scaled_mm path");
    TS_CHECK_ARG(k % kTileK == 0 && k > 0, "fused linear: in_features must be a positive multiple of 64, got ", k);
    TS_CHECK_ARG((block & (block - 1)) == 0 && (format == Format::nvfp4 ? block == 16 : block >= 32),
                 "fused linear: int8 and nf4 blocks must be a power of two >= 32 (nvfp4: 16), got ", block);
    TS_CHECK_ARG(m >= 0 && n > 0 && m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31),
                 "fused linear: sizes out of range");
}

}  // namespace

bool fused_linear_supported(int device) {
    ts::CudaDeviceGuard guard(device);
    int major = 0, minor = 0;
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major == 9 && minor == 0;
}

void fused_code_map_sm90(Format format, const uint8_t* codes, int64_t n, int64_t k, void* map_out) {
    check_geometry(format, 0, k, format == Format::nvfp4 ? 16 : 32, n);
    const CUtensorMap map = code_map_for(format, codes, n, k);
    std::memcpy(map_out, &map, sizeof(CUtensorMap));
}

void fused_linear_sm90_mapped(Format format, const void* x, int64_t m, int64_t k, const void* code_map,
                              const void* scales, const float* global_scale, int64_t block, int64_t n,
                              const void* bias, void* out, int tile_m, float* workspace, int* flags, int64_t slots,
                              unsigned long long* epoch, int device, uintptr_t stream) {
    check_geometry(format, m, k, block, n);
    if (m == 0) return;
    if (tile_m == 0) tile_m = m <= 64 ? 64 : (m <= 128 ? 128 : 256);  // the widest tile the rows fill
    TS_CHECK_ARG(slots >= 1, "fused linear: the workspace needs at least one slot");
    ts::CudaDeviceGuard guard(device);
    auto s = reinterpret_cast<cudaStream_t>(stream);
    const int sms = sm_count(device);
    const int max_grid = int(slots < sms ? slots : sms);  // one resident CTA per SM, one slot per CTA
    const Partials partials{workspace, flags, epoch};
    int shift = 0;
    while ((int64_t(1) << shift) < block) ++shift;
    const FusedArgs a{static_cast<const uint8_t*>(scales), global_scale, static_cast<const __nv_bfloat16*>(bias),
                      static_cast<__nv_bfloat16*>(out), int(m), int(n), int(k), shift};
    alignas(64) CUtensorMap map;  // the kernel takes it by value (__grid_constant__): 64-byte aligned here
    std::memcpy(&map, code_map, sizeof(CUtensorMap));
    switch (format) {
        case Format::int8: return launch_format<Format::int8>(x, map, a, tile_m, partials, max_grid, device, s);
        case Format::nf4: return launch_format<Format::nf4>(x, map, a, tile_m, partials, max_grid, device, s);
        case Format::nvfp4: return launch_format<Format::nvfp4>(x, map, a, tile_m, partials, max_grid, device, s);
        default: break;
    }
}

void fused_linear_sm90(Format format, const void* x, int64_t m, int64_t k, const uint8_t* codes,
                       const void* scales, const float* global_scale, int64_t block, int64_t n, const void* bias,
                       void* out, int tile_m, float* workspace, int* flags, int64_t slots,
                       unsigned long long* epoch, int device, uintptr_t stream) {
    check_geometry(format, m, k, block, n);
    if (m == 0) return;
    const CUtensorMap map = code_map_for(format, codes, n, k);
    fused_linear_sm90_mapped(format, x, m, k, &map, scales, global_scale, block, n, bias, out, tile_m, workspace,
                             flags, slots, epoch, device, stream);
}

}  // namespace ts_quant
