// Helpers for tensors that cross the boundary as nb::ndarray (DLPack).
//
// Functions that accept several dtypes take a dtype-less ndarray and dispatch
// on ScalarKind; bf16, fp16 and fp8 have no C++ scalar type in nanobind.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

#include "ts/errors.h"

namespace ts {

namespace nb = nanobind;

enum class ScalarKind { float32, bfloat16, float16, float8_e4m3, uint8, int8, int32, int64, other };

inline ScalarKind scalar_kind(nb::dlpack::dtype dtype) {
    using code = nb::dlpack::dtype_code;
    const auto c = static_cast<code>(dtype.code);
    if (dtype.lanes != 1) return ScalarKind::other;
    switch (dtype.bits) {
        case 32:
            if (c == code::Float) return ScalarKind::float32;
            if (c == code::Int) return ScalarKind::int32;
            break;
        case 16:
            if (c == code::Bfloat) return ScalarKind::bfloat16;
            if (c == code::Float) return ScalarKind::float16;
            break;
        case 8:
            if (c == code::UInt) return ScalarKind::uint8;
            if (c == code::Int) return ScalarKind::int8;
            // DLPack 1.1 gives e4m3fn its own code; older exporters used Float.
            if (c == code::Float || static_cast<int>(c) == 10) return ScalarKind::float8_e4m3;
            break;
        case 64:
            if (c == code::Int) return ScalarKind::int64;
            break;
        default:
            break;
    }
    return ScalarKind::other;
}

inline const char* scalar_kind_name(ScalarKind kind) {
    switch (kind) {
        case ScalarKind::float32: return "float32";
        case ScalarKind::bfloat16: return "bfloat16";
        case ScalarKind::float16: return "float16";
        case ScalarKind::float8_e4m3: return "float8_e4m3fn";
        case ScalarKind::uint8: return "uint8";
        case ScalarKind::int8: return "int8";
        case ScalarKind::int32: return "int32";
        case ScalarKind::int64: return "int64";
        default: return "an unsupported dtype";
    }
}

template <typename Array>
bool is_cuda(const Array& array) {
    return array.device_type() == nb::device::cuda::value;
}

template <typename Array>
bool is_cpu(const Array& array) {
    return array.device_type() == nb::device::cpu::value;
}

// True when the array is C-contiguous (DLPack strides are in elements).
template <typename Array>
bool is_contiguous(const Array& array) {
    int64_t expected = 1;
    for (size_t d = array.ndim(); d-- > 0;) {
        if (array.shape(d) != 1 && array.stride(d) != expected) return false;
        expected *= static_cast<int64_t>(array.shape(d));
    }
    return true;
}

template <typename Array>
size_t nbytes_of(const Array& array) {
    return array.size() * (array.dtype().bits / 8);
}

// ValueError unless `array` is contiguous; `what` names the argument.
template <typename Array>
void require_contiguous(const Array& array, const char* what) {
    TS_CHECK_ARG(is_contiguous(array), what,
                 " must be contiguous; call .contiguous() on it first");
}

}  // namespace ts
