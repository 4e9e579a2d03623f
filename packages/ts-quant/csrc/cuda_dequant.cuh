// Vectorized dequantize kernel (included by cuda_kernels.cu, inside its
// anonymous namespace).
//
// Work unit: a "group" of 8 consecutive values that share one scale slot,
// decoded from one 4-byte (4-bit formats) or 8-byte (int8, fp8) load and
// written with one 16-byte store (bf16/fp16; two for fp32). A warp handles
// 32 x G groups laid out so that every load and store instruction of the warp
// covers one contiguous span (lane l takes groups base + j*32 + l), and each
// thread issues all its loads before its first decode, so G loads per thread
// are in flight at once. No 64-bit division in the hot path: scale slots come
// from 32-bit multiply-high division by precomputed constants.
//
// Results equal the CPU's bit for bit: every value is code_value * scale in
// one fp32 multiply (the same operands as formats.h), rounded to the output
// type with round-to-nearest-even (hardware cvt.rn; NaNs stay NaN, their
// payload bits may differ from the CPU's).
#pragma once
// Needs <cuda_bf16.h> and <cuda_fp16.h>, included at the top of cuda_kernels.cu.

constexpr int kGroup = 8;  // values per group

// Unsigned 32-bit division by a runtime constant d >= 1 (Granlund-Montgomery,
// round-up multiplier): q = (umulhi(x, m) + x) >> l, exact for every 32-bit x.
struct FastDiv {
    uint32_t d = 1, m = 1, l = 0;
    FastDiv() = default;
    explicit FastDiv(uint32_t divisor) : d(divisor) {
        while ((uint64_t(1) << l) < d) ++l;
        m = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
    }
    __device__ __forceinline__ uint32_t div(uint32_t x) const {
        return static_cast<uint32_t>((uint64_t(__umulhi(x, m)) + x) >> l);
    }
};

struct VecGeo {
    uint32_t groups;     // groups in the vectorized part (n / 8)
    FastDiv per_slot;    // flat formats: groups per scale block (block / 8)
    FastDiv row_groups;  // fp8: groups per row (cols / 8)
    FastDiv tile;        // fp8: tile edge (rows per tile)
    FastDiv tile_groups; // fp8: groups per tile row (block / 8)
    uint32_t tiles_c;    // fp8: tiles per row of tiles
};

template <Format F>
__device__ __forceinline__ uint32_t group_slot(const VecGeo& v, uint32_t g) {
    if constexpr (F == Format::fp8) {
        const uint32_t row = v.row_groups.div(g);
        const uint32_t col_group = g - row * v.row_groups.d;
        return v.tile.div(row) * v.tiles_c + v.tile_groups.div(col_group);
    } else {
        return v.per_slot.div(g);
    }
}

template <Format F>
__device__ __forceinline__ float load_scale(const void* scales, uint32_t slot, float g) {
    if constexpr (F == Format::nvfp4) return e4m3_value(__ldg(static_cast<const uint8_t*>(scales) + slot)) * g;
    return __ldg(static_cast<const float*>(scales) + slot);
}

// Codes of one group: 4 bytes (4-bit formats) or 8 bytes.
template <Format F>
struct Codes {
    static constexpr bool kFourBit = F == Format::nf4 || F == Format::nvfp4;
    uint32_t lo = 0, hi = 0;
    __device__ __forceinline__ void load(const uint8_t* data, uint32_t g) {
        if constexpr (kFourBit) {
            lo = __ldg(reinterpret_cast<const uint32_t*>(data) + g);
        } else {
            const uint2 w = __ldg(reinterpret_cast<const uint2*>(data) + g);
            lo = w.x;
            hi = w.y;
        }
    }
    // Value k (0..7) of the group, before scaling. `table`: 16 code values.
    __device__ __forceinline__ float value(int k, const float* table) const {
        if constexpr (kFourBit) {
            const uint32_t byte = (lo >> (8 * (k >> 1))) & 0xffu;
            // nf4: first value in the high nibble; nvfp4: in the low nibble.
            const bool high = (F == Format::nf4) == ((k & 1) == 0);
            return table[high ? (byte >> 4) : (byte & 0x0fu)];
        } else {
            const uint32_t word = k < 4 ? lo : hi;
            const uint32_t byte = (word >> (8 * (k & 3))) & 0xffu;
            if constexpr (F == Format::int8) return static_cast<float>(static_cast<int8_t>(byte));
            return e4m3_value(byte);
        }
    }
};

__device__ __forceinline__ void store_group(const float (&v)[kGroup], float* out) {
    float4* dst = reinterpret_cast<float4*>(out);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ uint32_t pack2(__nv_bfloat162 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ uint32_t pack2(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

__device__ __forceinline__ void store_group(const float (&v)[kGroup], Bf16* out) {
    uint4 w;
    w.x = pack2(__floats2bfloat162_rn(v[0], v[1]));
    w.y = pack2(__floats2bfloat162_rn(v[2], v[3]));
    w.z = pack2(__floats2bfloat162_rn(v[4], v[5]));
    w.w = pack2(__floats2bfloat162_rn(v[6], v[7]));
    *reinterpret_cast<uint4*>(out) = w;
}

__device__ __forceinline__ void store_group(const float (&v)[kGroup], Fp16* out) {
    uint4 w;
    w.x = pack2(__floats2half2_rn(v[0], v[1]));
    w.y = pack2(__floats2half2_rn(v[2], v[3]));
    w.z = pack2(__floats2half2_rn(v[4], v[5]));
    w.w = pack2(__floats2half2_rn(v[6], v[7]));
    *reinterpret_cast<uint4*>(out) = w;
}

template <Format F>
__host__ __device__ constexpr int groups_per_lane() {
    return Codes<F>::kFourBit ? 8 : 4;  // 16 or 32 bytes of codes in flight per thread
}

template <Format F, class Out>
__global__ void __launch_bounds__(256) dequantize_group_kernel(VecGeo v, const uint8_t* __restrict__ data,
                                                               const void* __restrict__ scales,
                                                               const float* __restrict__ global_scale,
                                                               Out* __restrict__ out) {
    constexpr int G = groups_per_lane<F>();
    __shared__ float table[16];
    if constexpr (F == Format::nf4 || F == Format::nvfp4) {
        if (threadIdx.x < 16) table[threadIdx.x] = F == Format::nf4 ? kNf4Codes[threadIdx.x] : kE2m1Signed[threadIdx.x];
        __syncthreads();
    }
    const uint32_t lane = threadIdx.x & 31u;
    const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const uint32_t base = warp * (32u * G) + lane;
    const float g = F == Format::nvfp4 ? __ldg(global_scale) : 0.0f;
    Codes<F> codes[G];
    float scale[G];
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const uint32_t grp = base + 32u * j;
        if (grp < v.groups) {
            codes[j].load(data, grp);
            scale[j] = load_scale<F>(scales, group_slot<F>(v, grp), g);
        }
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
        const uint32_t grp = base + 32u * j;
        if (grp >= v.groups) break;
        float vals[kGroup];
#pragma unroll
        for (int k = 0; k < kGroup; ++k) vals[k] = codes[j].value(k, table) * scale[j];
        store_group(vals, out + size_t(grp) * kGroup);
    }
}

// Launches the group kernel over the first n / 8 * 8 values when the layout
// allows it; returns how many values it covered (0: use the scalar path).
template <Format F, class Out>
int64_t dequantize_groups(const Geometry& geo, const uint8_t* data, const void* scales, const float* g, Out* out,
                          cudaStream_t s) {
    constexpr bool four_bit = Codes<F>::kFourBit;
    const int64_t groups = geo.n / kGroup;
    if (groups == 0 || groups >= (int64_t(1) << 31)) return 0;
    if (reinterpret_cast<uintptr_t>(data) % (four_bit ? 4 : 8) != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
        return 0;
    if (geo.block % kGroup != 0 || geo.block >= (int64_t(1) << 31)) return 0;
    VecGeo v{};
    v.groups = static_cast<uint32_t>(groups);
    if (F == Format::fp8) {
        if (geo.cols % kGroup != 0 || geo.rows >= (int64_t(1) << 31)) return 0;
        v.row_groups = FastDiv(static_cast<uint32_t>(geo.cols / kGroup));
        v.tile = FastDiv(static_cast<uint32_t>(geo.block));
        v.tile_groups = FastDiv(static_cast<uint32_t>(geo.block / kGroup));
        v.tiles_c = static_cast<uint32_t>(geo.tiles_c());
    } else {
        v.per_slot = FastDiv(static_cast<uint32_t>(geo.block / kGroup));
    }
    constexpr int G = groups_per_lane<F>();
    constexpr int64_t per_block = int64_t(kThreads) / 32 * 32 * G;  // groups per thread block
    const int64_t blocks = (groups + per_block - 1) / per_block;
    dequantize_group_kernel<F, Out><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(v, data, scales, g, out);
    TS_CUDA_CHECK_LAUNCH();
    return groups * kGroup;
}
