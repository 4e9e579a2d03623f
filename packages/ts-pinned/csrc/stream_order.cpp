#include "stream_order.h"

#include <cstdint>
#include <string>

#include "ts/cuda_check.h"
#include "ts/errors.h"

#ifdef TS_WITH_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

namespace nb = nanobind;

namespace ts_pinned {

namespace {

// Arguments arrive as Python ints and are checked here (not by nanobind's
// uint64_t caster, which would raise TypeError for -1): ValueError when out
// of [0, 2**64), TypeError when not an int. A bool is refused: True is not
// an address or a counter value.
uint64_t as_u64(nb::handle h, const char* fn, const char* name) {
    PyObject* o = h.ptr();
    if (!PyLong_Check(o) || PyBool_Check(o)) {
        throw nb::type_error(ts::concat(fn, ": ", name, " must be an int, got ",
                                        nb::type_name(h.type()).c_str())
                                 .c_str());
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // OverflowError for negatives and for >= 2**64
        nb::str text(h);
        ts::throw_value_error(fn, ": ", name, " must be in [0, 2**64), got ", text.c_str());
    }
    return static_cast<uint64_t>(v);
}

struct Args {
    uint64_t stream, address, value;
};

Args check_args(nb::handle stream, nb::handle address, nb::handle value, const char* fn) {
    Args a{as_u64(stream, fn, "stream"), as_u64(address, fn, "address"), as_u64(value, fn, "value")};
    TS_CHECK_ARG(a.address != 0 && a.address % 8 == 0, fn, ": address must be a non-null, 8-byte aligned device "
                 "pointer (e.g. an int64 CUDA tensor's data_ptr()), got ", a.address);
    return a;
}

#ifdef TS_WITH_CUDA

struct DriverOps {
    PFN_cuStreamWriteValue64_v11070 write = nullptr;
    PFN_cuStreamWaitValue64_v11070 wait = nullptr;
    PFN_cuDeviceGet_v2000 device_get = nullptr;
    PFN_cuDeviceGetAttribute_v2000 attribute = nullptr;
    PFN_cuGetErrorName_v6000 error_name = nullptr;
    std::string missing;  // why the operations cannot run here; empty when they can
};

template <typename Fn>
void lookup(DriverOps& ops, const char* symbol, Fn& out) {
    if (!ops.missing.empty()) return;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    // 12000: the ABI of these symbols as of CUDA 12 (the _v2 stream mem ops);
    // legacy default stream semantics for handle 0, as torch uses it.
    cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found);
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
        cudaGetLastError();
        ops.missing = ts::concat("the CUDA driver does not provide ", symbol, " (",
                                 status != cudaSuccess ? cudaGetErrorName(status) : "symbol not found", ")");
        return;
    }
    out = reinterpret_cast<Fn>(fn);
}

// Looked up once per process (thread-safe static); never throws.
const DriverOps& driver_ops() {
    static const DriverOps ops = [] {
        DriverOps o;
        if (!ts::cuda_device_present()) {
            o.missing = "no CUDA device or driver is present";
            return o;
        }
        lookup(o, "cuStreamWriteValue64", o.write);
        lookup(o, "cuStreamWaitValue64", o.wait);
        lookup(o, "cuDeviceGet", o.device_get);
        lookup(o, "cuDeviceGetAttribute", o.attribute);
        lookup(o, "cuGetErrorName", o.error_name);
        return o;
    }();
    return ops;
}

const DriverOps& usable_ops(const char* fn) {
    const DriverOps& ops = driver_ops();
    if (!ops.missing.empty()) {
        ts::throw_runtime_error(fn, ": stream memory operations are unavailable: ", ops.missing,
                                ". Check ts_pinned.stream_value_ops_available() and fall back to events.");
    }
    return ops;
}

[[noreturn]] void driver_failed(const DriverOps& ops, CUresult r, const char* fn, const char* call, const Args& a) {
    const char* name = nullptr;
    if (ops.error_name == nullptr || ops.error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
    ts::throw_runtime_error(fn, ": ", call, " failed with ", name, " (", static_cast<int>(r), ") for stream 0x",
                            std::hex, a.stream, ", address 0x", a.address, std::dec, ", value ", a.value,
                            ". The address must be device memory (not managed) of the stream's device; "
                            "see ts_pinned.stream_value_ops_available().");
}

// Runs a driver stream operation with the stream's device current, and
// restores the caller's device. A thread that never used the runtime has no
// current context, which the driver needs for handle 0: bind the device's
// primary context (cudaSetDevice) and retry once. The common path costs two
// runtime queries; cudaSetDevice only when the devices differ.
template <typename Op>
CUresult on_stream_device(cudaStream_t stream, Op op) {
    int previous = 0, device = 0;
    TS_CUDA_CHECK(cudaGetDevice(&previous));
    TS_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
    if (device != previous) TS_CUDA_CHECK(cudaSetDevice(device));
    CUresult r = op();
    if (r == CUDA_ERROR_INVALID_CONTEXT && cudaSetDevice(device) == cudaSuccess) r = op();
    if (device != previous) cudaSetDevice(previous);
    return r;
}

void write_value(nb::handle stream, nb::handle address, nb::handle value) {
    const char* fn = "stream_write_value";
    Args a = check_args(stream, address, value, fn);
    const DriverOps& ops = usable_ops(fn);
    auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(a.stream));
    // Default flags: the write is a memory barrier, ordered after every
    // prior write of the stream (the upload it announces is visible first).
    CUresult r = on_stream_device(s, [&] {
        return ops.write(reinterpret_cast<CUstream>(s), static_cast<CUdeviceptr>(a.address),
                         static_cast<cuuint64_t>(a.value), CU_STREAM_WRITE_VALUE_DEFAULT);
    });
    if (r != CUDA_SUCCESS) driver_failed(ops, r, fn, "cuStreamWriteValue64", a);
}

void wait_value(nb::handle stream, nb::handle address, nb::handle value) {
    const char* fn = "stream_wait_value";
    Args a = check_args(stream, address, value, fn);
    const DriverOps& ops = usable_ops(fn);
    auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(a.stream));
    CUresult r = on_stream_device(s, [&] {
        return ops.wait(reinterpret_cast<CUstream>(s), static_cast<CUdeviceptr>(a.address),
                        static_cast<cuuint64_t>(a.value), CU_STREAM_WAIT_VALUE_GEQ);
    });
    if (r != CUDA_SUCCESS) driver_failed(ops, r, fn, "cuStreamWaitValue64", a);
}

bool value_ops_available(int device) {
    TS_CHECK_ARG(device >= 0, "stream_value_ops_available: device must be >= 0, got ", device);
    const DriverOps& ops = driver_ops();
    if (!ops.missing.empty()) return false;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    TS_CHECK_ARG(device < count, "stream_value_ops_available: device ", device, " does not exist (", count,
                 " visible CUDA devices)");
    CUdevice handle = 0;
    int supported = 0;
    // The 64-bit attribute is the one the driver documents for
    // cuStreamWriteValue64/cuStreamWaitValue64 (GEQ needs no NOR support).
    if (ops.device_get(&handle, device) != CUDA_SUCCESS ||
        ops.attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, handle) != CUDA_SUCCESS) {
        return false;
    }
    return supported != 0;
}

#else  // no CUDA in this build

[[noreturn]] void no_cuda(const char* fn) {
    ts::throw_runtime_error(fn, ": ts-pinned was built without CUDA, so it cannot enqueue stream memory "
                            "operations. Reinstall it with a CUDA toolkit on PATH (TS_ENABLE_CUDA=ON), or "
                            "check ts_pinned.stream_value_ops_available() and fall back to events.");
}

void write_value(nb::handle stream, nb::handle address, nb::handle value) {
    check_args(stream, address, value, "stream_write_value");
    no_cuda("stream_write_value");
}

void wait_value(nb::handle stream, nb::handle address, nb::handle value) {
    check_args(stream, address, value, "stream_wait_value");
    no_cuda("stream_wait_value");
}

bool value_ops_available(int device) {
    TS_CHECK_ARG(device >= 0, "stream_value_ops_available: device must be >= 0, got ", device);
    return false;
}

#endif

}  // namespace

void register_stream_order(nb::module_& m) {
    // Checked by hand (as_u64), so None and bools reach the clear errors.
    m.def("stream_write_value", &write_value, nb::arg("stream").none(), nb::arg("address").none(),
          nb::arg("value").none(), nb::sig("def stream_write_value(stream: int, address: int, value: int) -> None"),
          "Enqueues on CUDA stream `stream` (an int handle) a write of the uint64 `value` to the device "
          "address `address`, after all prior work of the stream (with a memory barrier). Never blocks.");
    m.def("stream_wait_value", &wait_value, nb::arg("stream").none(), nb::arg("address").none(),
          nb::arg("value").none(), nb::sig("def stream_wait_value(stream: int, address: int, value: int) -> None"),
          "Enqueues on CUDA stream `stream` a wait until the uint64 at device address `address` is >= "
          "`value` (cyclic: (int64)(*address - value) >= 0); later work of the stream waits. Never blocks. "
          "Enqueue it after the write that releases it: CUDA does not see this dependency (docs/pinned.md).");
    m.def("stream_value_ops_available", &value_ops_available, nb::arg("device") = 0,
          "True when stream_write_value/stream_wait_value can run on CUDA device `device`; False in a "
          "CPU-only build, without a driver, or when the device lacks 64-bit stream memory operations.");
}

}  // namespace ts_pinned
