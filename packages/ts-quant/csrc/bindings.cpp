// Python bindings of ts_quant._core: one quantize and one dequantize entry
// point for all formats; tensors cross as DLPack, on the CPU or one CUDA device.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "kernels.h"
#include "packed_bf16.h"
#include "sm90/fused_linear.h"  // declarations only: the definitions exist where TS_WITH_SM90A is set
#include "ts/bindings.h"
#include "ts/ndarray.h"

namespace nb = nanobind;
using namespace ts_quant;

namespace {

using AnyArray = nb::ndarray<nb::c_contig>;
using ByteArray = nb::ndarray<uint8_t, nb::c_contig>;
using FloatArray = nb::ndarray<float, nb::c_contig>;

Geometry make_geometry(int format, int64_t n, int64_t block, int64_t rows, int64_t cols) {
    TS_CHECK_ARG(format >= 0 && format <= 3, "unknown format id ", format);
    TS_CHECK_ARG(n >= 0 && block > 0, "n must be >= 0 and block > 0 (got n=", n, ", block=", block, ")");
    Geometry geo{static_cast<Format>(format), n, block, rows, cols};
    if (geo.format == Format::fp8) {
        TS_CHECK_ARG(rows >= 0 && cols > 0 && rows * cols == n, "fp8: rows * cols must equal n");
    } else {
        TS_CHECK_ARG(block % 2 == 0, "block size must be even, got ", block);
    }
    return geo;
}

size_t packed_bytes(const Geometry& geo) {
    bool four_bit = geo.format == Format::nf4 || geo.format == Format::nvfp4;
    return four_bit ? static_cast<size_t>((geo.n + 1) / 2) : static_cast<size_t>(geo.n);
}

// Common checks; returns the CUDA device id, or -1 for the CPU.
template <class A, class B, class C>
int check_arrays(const Geometry& geo, const A& values, const B& data, const C& scales, const FloatArray* global,
                 const char* what) {
    const bool cuda = ts::is_cuda(values);
    TS_CHECK_ARG(cuda || ts::is_cpu(values), what, ": tensors must be on the CPU or a CUDA device");
    auto same_place = [&](const auto& a) {
        return a.device_type() == values.device_type() && (!cuda || a.device_id() == values.device_id());
    };
    TS_CHECK_ARG(same_place(data) && same_place(scales) && (!global || same_place(*global)), what,
                 ": all tensors must be on the same device");
    TS_CHECK_ARG(values.size() == static_cast<size_t>(geo.n), what, ": expected ", geo.n, " values, got ",
                 values.size());
    TS_CHECK_ARG(data.size() >= packed_bytes(geo), what, ": data holds ", data.size(), " bytes, needs ",
                 packed_bytes(geo));
    const size_t scale_bytes = geo.format == Format::nvfp4 ? 1 : 4;
    TS_CHECK_ARG(scales.dtype().bits == scale_bytes * 8, what, ": scales must be ",
                 scale_bytes == 1 ? "e4m3 bytes (uint8)" : "float32");
    TS_CHECK_ARG(scales.size() * (scales.dtype().bits / 8) >= static_cast<size_t>(geo.scale_count()) * scale_bytes,
                 what, ": scales hold too few entries for ", geo.scale_count(), " blocks");
    TS_CHECK_ARG(geo.format != Format::nvfp4 || (global && global->size() >= 1), what,
                 ": nvfp4 needs its per-tensor scale");
    return cuda ? static_cast<int>(values.device_id()) : -1;
}

void quantize(int format, AnyArray x, ByteArray data, AnyArray scales, std::optional<FloatArray> global, int64_t n,
              int64_t block, int64_t rows, int64_t cols, uintptr_t stream) {
    Geometry geo = make_geometry(format, n, block, rows, cols);
    const FloatArray* g = global ? &*global : nullptr;
    int device = check_arrays(geo, x, data, scales, g, "quantize");
    ts::ScalarKind kind = ts::scalar_kind(x.dtype());
    const float* gptr = g ? g->data() : nullptr;
    if (geo.n == 0) return;
    if (device >= 0) {
#ifdef TS_WITH_CUDA
        quantize_cuda(geo, x.data(), kind, data.data(), scales.data(), gptr, device, stream);
#else
        ts::cuda_unavailable("quantize on a CUDA tensor");
#endif
        return;
    }
    nb::gil_scoped_release release;
    quantize_cpu(geo, x.data(), kind, data.data(), scales.data(), gptr);
}

void dequantize(int format, ByteArray data, AnyArray scales, std::optional<FloatArray> global, AnyArray out, int64_t n,
                int64_t block, int64_t rows, int64_t cols, uintptr_t stream) {
    Geometry geo = make_geometry(format, n, block, rows, cols);
    const FloatArray* g = global ? &*global : nullptr;
    int device = check_arrays(geo, out, data, scales, g, "dequantize");
    ts::ScalarKind kind = ts::scalar_kind(out.dtype());
    const float* gptr = g ? g->data() : nullptr;
    if (geo.n == 0) return;
    if (device >= 0) {
#ifdef TS_WITH_CUDA
        dequantize_cuda(geo, data.data(), scales.data(), gptr, out.data(), kind, device, stream);
#else
        ts::cuda_unavailable("dequantize on a CUDA tensor");
#endif
        return;
    }
    nb::gil_scoped_release release;
    dequantize_cpu(geo, data.data(), scales.data(), gptr, out.data(), kind);
}

void fp8_act_quant(AnyArray x, ByteArray codes, FloatArray scales, int64_t m, int64_t mp, int64_t k,
                   uintptr_t stream) {
    TS_CHECK_ARG(ts::is_cuda(x) && ts::is_cuda(codes) && ts::is_cuda(scales) && codes.device_id() == x.device_id() &&
                     scales.device_id() == x.device_id(),
                 "fp8_act_quant: x, codes and scales must be on the same CUDA device");
    TS_CHECK_ARG(m >= 0 && mp >= m && k > 0 && k % 128 == 0, "fp8_act_quant: need k % 128 == 0 and mp >= m (got m=", m,
                 ", mp=", mp, ", k=", k, ")");
    TS_CHECK_ARG(x.size() == static_cast<size_t>(m * k), "fp8_act_quant: x must hold m * k values");
    TS_CHECK_ARG(codes.size() == static_cast<size_t>(mp * k), "fp8_act_quant: codes must hold mp * k bytes");
    TS_CHECK_ARG(scales.size() == static_cast<size_t>(mp * (k / 128)), "fp8_act_quant: scales must hold mp * k / 128");
    const size_t align = ts::scalar_kind(x.dtype()) == ts::ScalarKind::float32 ? 16 : 8;
    TS_CHECK_ARG(reinterpret_cast<uintptr_t>(x.data()) % align == 0 && reinterpret_cast<uintptr_t>(codes.data()) % 4 == 0,
                 "fp8_act_quant: x must be ", align, "-byte aligned and codes 4-byte aligned");
#ifdef TS_WITH_CUDA
    fp8_act_quant_cuda(x.data(), ts::scalar_kind(x.dtype()), codes.data(), scales.data(), m, mp, k,
                       static_cast<int>(x.device_id()), stream);
#else
    ts::cuda_unavailable("fp8_act_quant");
#endif
}

constexpr bool built_with_sm90a() {
#ifdef TS_WITH_SM90A
    return true;
#else
    return false;
#endif
}

bool fused_linear_available(int device) {
#ifdef TS_WITH_SM90A
    return fused_linear_supported(device);
#else
    (void)device;
    return false;
#endif
}

// out [m, n] = x [m, k] @ dequantize(W [n, k])^T (+ bias) on Hopper, without a bf16 copy of W.
void fused_linear(int format, AnyArray x, ByteArray codes, AnyArray scales,
                  std::optional<FloatArray> global, int64_t block, int64_t n, std::optional<AnyArray> bias,
                  AnyArray out, FloatArray workspace, nb::ndarray<int32_t, nb::c_contig> flags,
                  nb::ndarray<int64_t, nb::c_contig> epoch, uintptr_t stream, int tile_m) {
    TS_CHECK_ARG(format == int(Format::int8) || format == int(Format::nf4) || format == int(Format::nvfp4),
                 "fused_linear: format must be int8, nf4 or nvfp4");
    TS_CHECK_ARG(x.ndim() == 2 && out.ndim() == 2, "fused_linear: x and out must be 2-D");
    const int64_t m = x.shape(0), k = x.shape(1);
    const int device = static_cast<int>(x.device_id());
    auto on_device = [&](const auto& a) { return ts::is_cuda(a) && static_cast<int>(a.device_id()) == device; };
    TS_CHECK_ARG(on_device(x) && on_device(codes) && on_device(scales) && on_device(out) &&
                     (!global || on_device(*global)) && (!bias || on_device(*bias)),
                 "fused_linear: every tensor must be on the same CUDA device");
    auto is_bf16 = [](const auto& a) { return ts::scalar_kind(a.dtype()) == ts::ScalarKind::bfloat16; };
    TS_CHECK_ARG(is_bf16(x) && is_bf16(out) && (!bias || is_bf16(*bias)),
                 "fused_linear: x, out and bias must be bfloat16");
    TS_CHECK_ARG(out.shape(0) == size_t(m) && out.shape(1) == size_t(n) && (!bias || bias->size() == size_t(n)),
                 "fused_linear: shapes disagree (x [m, k], out [m, n], bias [n])");
    const bool four_bit = format != int(Format::int8);
    TS_CHECK_ARG(codes.size() >= size_t(four_bit ? n * k / 2 : n * k), "fused_linear: codes hold too few bytes");
    const size_t scale_bytes = format == int(Format::nvfp4) ? 1 : 4;
    TS_CHECK_ARG(scales.dtype().bits == scale_bytes * 8 && block > 0 &&
                     scales.size() >= size_t((n * k + block - 1) / block),
                 "fused_linear: scales must hold one ", scale_bytes == 1 ? "e4m3 byte" : "float32", " per block");
    TS_CHECK_ARG(format != int(Format::nvfp4) || (global && global->size() >= 1),
                 "fused_linear: nvfp4 needs its per-tensor scale");
    auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    TS_CHECK_ARG(aligned(x.data()) && aligned(codes.data()) && aligned(scales.data()),
                 "fused_linear: x, codes and scales must be 16-byte aligned");
    TS_CHECK_ARG(on_device(workspace) && on_device(flags) && on_device(epoch) && flags.size() >= 1 &&
                     epoch.size() == 1 && reinterpret_cast<uintptr_t>(epoch.data()) % 8 == 0,
                 "fused_linear: workspace, flags and the one-word epoch must be on x's device");
    const int64_t slots = static_cast<int64_t>(flags.size());
    TS_CHECK_ARG(workspace.size() >= size_t(slots * kFusedSlotFloats), "fused_linear: the workspace needs ",
                 kFusedSlotFloats, " floats per flag");
    if (!built_with_sm90a())
        throw_fused_unavailable("fused_linear: this build is missing sm_90a (rebuild with 90 in "
                                "TS_CUDA_ARCHITECTURES, with a CUDA toolkit)");
    if (!fused_linear_available(device))
        throw_fused_unavailable("fused_linear: needs a compute capability 9.0 GPU (H100/H200); device ", device,
                                " is not one");
#ifdef TS_WITH_SM90A
    fused_linear_sm90(static_cast<Format>(format), x.data(), m, k, codes.data(), scales.data(),
                      global ? global->data() : nullptr, block, n, bias ? bias->data() : nullptr, out.data(), tile_m,
                      workspace.data(), flags.data(), slots, reinterpret_cast<unsigned long long*>(epoch.data()),
                      device, stream);
#endif
}

// ---- the hot path of quantized_linear (ts_quant._plan) --------------------------------------------
// Addresses (ints) instead of DLPack tensors: a tensor costs about 2 us to export, an int 0.04 us.
// The caller validated the tensors behind these addresses once, through the checked entry points
// above, and checks per call what can change; these functions can only check the scalars.

ts::ScalarKind out_kind_of(int kind) {
    TS_CHECK_ARG(kind >= 0 && kind <= 2, "out_kind must be 0 (float32), 1 (bfloat16) or 2 (float16), got ", kind);
    return static_cast<ts::ScalarKind>(kind);  // ScalarKind starts float32, bfloat16, float16
}

void dequantize_at(int format, uintptr_t data, uintptr_t scales, uintptr_t global, uintptr_t out, int out_kind,
                   int64_t n, int64_t block, int64_t rows, int64_t cols, int device, uintptr_t stream) {
    Geometry geo = make_geometry(format, n, block, rows, cols);
    const ts::ScalarKind kind = out_kind_of(out_kind);
    TS_CHECK_ARG(data && scales && out && (geo.format != Format::nvfp4 || global), "dequantize_at: a null address");
    const auto* d = reinterpret_cast<const uint8_t*>(data);
    const auto* s = reinterpret_cast<const void*>(scales);
    const auto* g = reinterpret_cast<const float*>(global);
    void* o = reinterpret_cast<void*>(out);
    if (geo.n == 0) return;
    if (device >= 0) {
#ifdef TS_WITH_CUDA
        dequantize_cuda(geo, d, s, g, o, kind, device, stream);
#else
        ts::cuda_unavailable("dequantize on a CUDA tensor");
#endif
        return;
    }
    nb::gil_scoped_release release;
    dequantize_cpu(geo, d, s, g, o, kind);
}

nb::bytes fused_code_map(int format, ByteArray codes, int64_t n, int64_t k) {
    TS_CHECK_ARG(format == int(Format::int8) || format == int(Format::nf4) || format == int(Format::nvfp4),
                 "fused_code_map: format must be int8, nf4 or nvfp4");
    TS_CHECK_ARG(ts::is_cuda(codes) && n > 0 && k > 0 &&
                     codes.size() >= size_t(format == int(Format::int8) ? n * k : n * k / 2),
                 "fused_code_map: codes must be a CUDA tensor of an [n, k] weight");
    TS_CHECK_ARG(reinterpret_cast<uintptr_t>(codes.data()) % 16 == 0, "fused_code_map: codes must be 16-byte aligned");
#ifdef TS_WITH_SM90A
    char map[kFusedCodeMapBytes];
    fused_code_map_sm90(static_cast<Format>(format), codes.data(), n, k, map);
    return nb::bytes(map, sizeof(map));
#else
    throw_fused_unavailable("fused_code_map: this build is missing sm_90a");
#endif
}

void fused_linear_at(int format, uintptr_t x, int64_t m, int64_t k, nb::bytes code_map, uintptr_t scales,
                     uintptr_t global, int64_t block, int64_t n, uintptr_t bias, uintptr_t out, uintptr_t workspace,
                     uintptr_t flags, int64_t slots, uintptr_t epoch, int device, uintptr_t stream, int tile_m) {
    TS_CHECK_ARG(format == int(Format::int8) || format == int(Format::nf4) || format == int(Format::nvfp4),
                 "fused_linear_at: format must be int8, nf4 or nvfp4");
    TS_CHECK_ARG(code_map.size() == kFusedCodeMapBytes, "fused_linear_at: code_map must come from fused_code_map");
    TS_CHECK_ARG(x && scales && out && workspace && flags && epoch && epoch % 8 == 0 && x % 16 == 0 &&
                     scales % 16 == 0 && (format != int(Format::nvfp4) || global),
                 "fused_linear_at: a null or misaligned address");
#ifdef TS_WITH_SM90A
    fused_linear_sm90_mapped(static_cast<Format>(format), reinterpret_cast<const void*>(x), m, k, code_map.c_str(),
                             reinterpret_cast<const void*>(scales), reinterpret_cast<const float*>(global), block, n,
                             reinterpret_cast<const void*>(bias), reinterpret_cast<void*>(out), tile_m,
                             reinterpret_cast<float*>(workspace), reinterpret_cast<int*>(flags), slots,
                             reinterpret_cast<unsigned long long*>(epoch), device, stream);
#else
    (void)m, (void)k, (void)block, (void)n, (void)bias, (void)device, (void)stream, (void)tile_m, (void)slots;
    throw_fused_unavailable("fused_linear_at: this build is missing sm_90a");
#endif
}

// ---- exponent-packed bf16 (packed_bf16.h) ----------------------------------------------------------
using Bf16Bits = nb::ndarray<int16_t, nb::c_contig>;  // bf16 values viewed as int16 (DLPack has no uint16 here)

PackedLayout checked_layout(int64_t n, int64_t k, int base, size_t segment_bytes, const char* what) {
    TS_CHECK_ARG(n >= 0 && k >= 0 && k <= n && n <= INT32_MAX, what, ": need 0 <= k <= n <= 2^31 - 1 (got n=", n,
                 ", k=", k, ")");
    TS_CHECK_ARG(base >= 0 && base + kPackedWindow <= 256, what, ": base must be 0 to ", 256 - kPackedWindow,
                 ", got ", base);
    PackedLayout l = packed_layout(n, k);
    TS_CHECK_ARG(segment_bytes >= size_t(l.total), what, ": the segment holds ", segment_bytes, " bytes, needs ",
                 l.total);
    return l;
}

nb::tuple packed_bf16_layout(int64_t n, int64_t k) {
    PackedLayout l = checked_layout(n, k, 0, SIZE_MAX, "packed_bf16_layout");
    return nb::make_tuple(l.nibbles, l.indices, l.values, l.total);
}

void exponent_histogram(Bf16Bits x, nb::ndarray<int64_t, nb::c_contig> counts) {
    TS_CHECK_ARG(ts::is_cpu(x) && ts::is_cpu(counts) && counts.size() == 256,
                 "exponent_histogram: x and counts (256 int64) must be CPU tensors");
    nb::gil_scoped_release release;
    exponent_histogram_cpu(reinterpret_cast<const uint16_t*>(x.data()), int64_t(x.size()), counts.data());
}

void pack_bf16(Bf16Bits x, ByteArray segment, int base, int64_t k) {
    TS_CHECK_ARG(ts::is_cpu(x) && ts::is_cpu(segment), "pack_bf16: x and segment must be CPU tensors");
    PackedLayout l = checked_layout(int64_t(x.size()), k, base, segment.size(), "pack_bf16");
    TS_CHECK_ARG(reinterpret_cast<uintptr_t>(segment.data()) % 16 == 0, "pack_bf16: the segment must be 16-byte aligned");
    nb::gil_scoped_release release;
    pack_bf16_cpu(reinterpret_cast<const uint16_t*>(x.data()), l, base, segment.data());
}

void unpack_bf16(ByteArray segment, Bf16Bits out, int base, int64_t k, uintptr_t stream) {
    const bool cuda = ts::is_cuda(segment);
    TS_CHECK_ARG(cuda ? ts::is_cuda(out) && out.device_id() == segment.device_id() : ts::is_cpu(segment) && ts::is_cpu(out),
                 "unpack_bf16: segment and out must be on the CPU or on the same CUDA device");
    PackedLayout l = checked_layout(int64_t(out.size()), k, base, segment.size(), "unpack_bf16");
    TS_CHECK_ARG(reinterpret_cast<uintptr_t>(segment.data()) % 16 == 0 && reinterpret_cast<uintptr_t>(out.data()) % 16 == 0,
                 "unpack_bf16: segment and out must be 16-byte aligned");
    auto* o = reinterpret_cast<uint16_t*>(out.data());
    if (cuda) {
#ifdef TS_WITH_CUDA
        unpack_bf16_cuda(segment.data(), l, base, o, static_cast<int>(segment.device_id()), stream);
#else
        ts::cuda_unavailable("unpack_bf16 on a CUDA tensor");
#endif
        return;
    }
    nb::gil_scoped_release release;
    unpack_bf16_cpu(segment.data(), l, base, o);
}

}  // namespace

NB_MODULE(_core, m) {
    ts::register_common(m);
    nb::exception<FusedLinearUnavailable>(m, "FusedLinearUnavailable", PyExc_RuntimeError);
    m.attr("built_with_sm90a") = built_with_sm90a();
    m.def("quantize", &quantize, nb::arg("format"), nb::arg("x"), nb::arg("data").noconvert(),
          nb::arg("scales").noconvert(), nb::arg("global_scale").none(), nb::arg("n"), nb::arg("block"),
          nb::arg("rows"), nb::arg("cols"), nb::arg("stream"),
          "Quantizes n values of x into data (packed codes) and scales. CUDA tensors: enqueued on `stream`.");
    m.def("dequantize", &dequantize, nb::arg("format"), nb::arg("data"), nb::arg("scales"),
          nb::arg("global_scale").none(), nb::arg("out").noconvert(), nb::arg("n"), nb::arg("block"),
          nb::arg("rows"), nb::arg("cols"), nb::arg("stream"),
          "Decodes n values into out (float32, bfloat16 or float16). CUDA tensors: enqueued on `stream`.");
    m.def("fp8_act_quant", &fp8_act_quant, nb::arg("x"), nb::arg("codes").noconvert(), nb::arg("scales").noconvert(),
          nb::arg("m"), nb::arg("mp"), nb::arg("k"), nb::arg("stream"),
          "FP8 1x128 activation quantization on CUDA: codes [mp, k] e4m3 bytes, scales [k/128, mp] fp32.");
    m.def("fused_linear_available", &fused_linear_available, nb::arg("device"),
          "Whether fused_linear runs on this CUDA device (compute capability 9.0 and an sm_90a build).");
    m.def("fused_linear", &fused_linear, nb::arg("format"), nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("global_scale").none(), nb::arg("block"), nb::arg("n"),
          nb::arg("bias").none(), nb::arg("out").noconvert(), nb::arg("workspace").noconvert(),
          nb::arg("flags").noconvert(), nb::arg("epoch").noconvert(), nb::arg("stream"), nb::arg("tile_m") = 0,
          "out = x @ dequantize(W)^T (+ bias) on Hopper tensor cores, decoding int8/nf4/nvfp4 codes in registers.");
    m.def("packed_bf16_layout", &packed_bf16_layout, nb::arg("n"), nb::arg("k"),
          "Byte offsets (nibbles, indices, values, total) of an exponent-packed bf16 segment of n values, k escapes.");
    m.def("exponent_histogram", &exponent_histogram, nb::arg("x"), nb::arg("counts").noconvert(),
          "Counts of each of the 256 bf16 exponents of x (bf16 bits as int16, CPU) into counts.");
    m.def("pack_bf16", &pack_bf16, nb::arg("x"), nb::arg("segment").noconvert(), nb::arg("base"), nb::arg("k"),
          "Packs bf16 x (bits as int16, CPU) into a segment: exponents base..base+14 in place, k escapes.");
    m.def("unpack_bf16", &unpack_bf16, nb::arg("segment"), nb::arg("out").noconvert(), nb::arg("base"), nb::arg("k"),
          nb::arg("stream"), "Restores every bit of a packed segment into out (bf16 bits as int16). CUDA: on `stream`.");
    m.def("dequantize_at", &dequantize_at, nb::arg("format"), nb::arg("data"), nb::arg("scales"), nb::arg("global_scale"),
          nb::arg("out"), nb::arg("out_kind"), nb::arg("n"), nb::arg("block"), nb::arg("rows"), nb::arg("cols"),
          nb::arg("device"), nb::arg("stream"),
          "dequantize by addresses (device -1: the CPU), for tensors validated once by the caller.");
    m.def("fused_code_map", &fused_code_map, nb::arg("format"), nb::arg("codes"), nb::arg("n"), nb::arg("k"),
          "The codes' TMA descriptor (opaque bytes) for fused_linear_at.");
    m.def("fused_linear_at", &fused_linear_at, nb::arg("format"), nb::arg("x"), nb::arg("m"), nb::arg("k"),
          nb::arg("code_map"), nb::arg("scales"), nb::arg("global_scale"), nb::arg("block"), nb::arg("n"),
          nb::arg("bias"), nb::arg("out"), nb::arg("workspace"), nb::arg("flags"), nb::arg("slots"), nb::arg("epoch"),
          nb::arg("device"), nb::arg("stream"), nb::arg("tile_m") = 0,
          "fused_linear by addresses, with a code map from fused_code_map, for operands validated once by the caller.");
}
