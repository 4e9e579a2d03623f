// Python bindings of ts_peer._core. Every CUDA entry point is bound in both
// builds; without CUDA it raises ts::cuda_unavailable() naming the call, so
// `import ts_peer` works everywhere and cuda_available() says False.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "peer.h"
#include "ts/bindings.h"
#include "ts/cuda_check.h"

namespace nb = nanobind;
using namespace ts_peer;

namespace {

#ifdef TS_WITH_CUDA
#define TS_PEER_CUDA(what, ...) __VA_ARGS__
#else
#define TS_PEER_CUDA(what, ...) ts::cuda_unavailable(what)
#endif

bool cuda_available() { return ts::cuda_device_present(); }

// One cudaMalloc allocation, the unit that CUDA IPC exports. Freed by
// release() or when the object dies; views from tensor() keep it alive.
class DeviceBuffer {
public:
    DeviceBuffer(int device, int64_t nbytes) {
        TS_CHECK_ARG(nbytes > 0, "DeviceBuffer: nbytes must be positive, got ", nbytes);
        TS_PEER_CUDA("DeviceBuffer", ptr_ = device_alloc(device, static_cast<size_t>(nbytes)));
        device_ = device;
        nbytes_ = nbytes;
    }
    ~DeviceBuffer() {
        try {
            release();
        } catch (...) {
        }
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    void release() {
        if (ptr_ == 0) return;
        const uintptr_t ptr = ptr_;
        ptr_ = 0;
        TS_PEER_CUDA("DeviceBuffer.release", device_free(device_, ptr));
    }
    uintptr_t ptr() const { return ptr_; }
    int device() const { return device_; }
    int64_t nbytes() const { return nbytes_; }
    bool released() const { return ptr_ == 0; }
    void check_live(const char* what) const {
        if (ptr_ == 0) ts::throw_runtime_error("DeviceBuffer.", what, ": the buffer was released");
    }

private:
    uintptr_t ptr_ = 0;
    int device_ = -1;
    int64_t nbytes_ = 0;
};

std::tuple<nb::bytes, uint64_t, uint64_t, int> export_tuple(uintptr_t ptr) {
#ifdef TS_WITH_CUDA
    IpcExport e = ipc_export(ptr);
    return {nb::bytes(e.handle.data(), e.handle.size()), e.offset, e.size, e.device};
#else
    ts::cuda_unavailable("ipc_export");
#endif
}

std::string handle_arg(const nb::bytes& handle) { return std::string(handle.c_str(), handle.size()); }

}  // namespace

NB_MODULE(_core, m) {
    ts::register_common(m);
    m.attr("IPC_HANDLE_BYTES") = kIpcHandleBytes;
    m.def("cuda_available", &cuda_available,
          "True when this core was built with CUDA and a CUDA device and driver are present.");
    m.def(
        "device_count",
        [] {
#ifdef TS_WITH_CUDA
            return device_count();
#else
            return 0;
#endif
        },
        "CUDA devices visible to this process (0 without a driver, and in a build without CUDA).");
    m.def(
        "can_access_peer",
        [](int device, int peer) { TS_PEER_CUDA("can_access_peer", return can_access_peer(device, peer)); },
        nb::arg("device"), nb::arg("peer"),
        "True when `device` can read and write `peer`'s memory directly (NVLink or PCIe peer access); a device "
        "and itself: True.");
    m.def(
        "enable_peer_access",
        [](int device, int peer) -> std::string {
#ifdef TS_WITH_CUDA
            switch (enable_peer_access(device, peer)) {
                case PeerAccess::enabled: return "enabled";
                case PeerAccess::already_enabled: return "already_enabled";
                default: return "same_device";
            }
#else
            ts::cuda_unavailable("enable_peer_access");
#endif
        },
        nb::arg("device"), nb::arg("peer"),
        "Lets `device` access `peer`'s memory. Idempotent: returns 'enabled' (now), 'already_enabled' or "
        "'same_device'. RuntimeError when the pair has no peer path.");
    m.def(
        "pci_bus_id", [](int device) { TS_PEER_CUDA("pci_bus_id", return pci_bus_id(device)); },
        nb::arg("device"), "The device's PCI bus id ('0000:3b:00.0'): the same GPU in every process.");
    m.def(
        "device_from_pci_bus_id",
        [](const std::string& bus) { TS_PEER_CUDA("device_from_pci_bus_id", return device_from_pci_bus_id(bus)); },
        nb::arg("bus_id"), "This process's index of the GPU with that PCI bus id, or -1 when it is not visible.");
    m.def("ipc_export", &export_tuple, nb::arg("ptr"),
          "(handle: bytes, offset, size, device) of the cudaMalloc allocation containing device pointer `ptr`: "
          "the 64-byte cudaIpcMemHandle_t, ptr's offset from the allocation's base, the allocation's bytes and "
          "its device.");
    m.def(
        "ipc_open",
        [](const nb::bytes& handle, int device) -> uintptr_t {
            TS_PEER_CUDA("ipc_open", return ipc_open(handle_arg(handle), device));
        },
        nb::arg("handle"), nb::arg("device"),
        "Maps another process's exported allocation on `device` (its GPU as numbered in this process) and "
        "returns its base address. Cached per (handle, device): opening again adds a reference.");
    m.def(
        "ipc_release",
        [](const nb::bytes& handle, int device) -> int {
            TS_PEER_CUDA("ipc_release", return ipc_release(handle_arg(handle), device));
        },
        nb::arg("handle"), nb::arg("device"),
        "Drops one reference to an opened handle and closes the mapping when none is left; returns the "
        "references left. ValueError when it is not open.");
    m.def(
        "ipc_open_count", []() -> size_t { TS_PEER_CUDA("ipc_open_count", return ipc_open_count()); },
        "Handles mapped in this process now.");
    m.def(
        "copy_async",
        [](uintptr_t dst, int dst_device, uintptr_t src, int src_device, int64_t nbytes, uintptr_t stream) {
            TS_CHECK_ARG(nbytes >= 0, "copy_async: nbytes must be >= 0, got ", nbytes);
            TS_PEER_CUDA("copy_async",
                         copy_async(dst, dst_device, src, src_device, static_cast<size_t>(nbytes), stream));
        },
        nb::arg("dst"), nb::arg("dst_device"), nb::arg("src"), nb::arg("src_device"), nb::arg("nbytes"),
        nb::arg("stream") = 0,
        "Enqueues a device-to-device copy of `nbytes` on `stream` (a cudaStream_t of dst_device, as an int): "
        "cudaMemcpyAsync on one device, cudaMemcpyPeerAsync across two. Never synchronizes.");

    nb::class_<DeviceBuffer>(m, "DeviceBuffer",
                             "One cudaMalloc allocation on a device (exportable by CUDA IPC, unlike PyTorch's "
                             "expandable segments). Freed by release() or when it dies.")
        .def(nb::init<int, int64_t>(), nb::arg("device"), nb::arg("nbytes"))
        .def_prop_ro("ptr", &DeviceBuffer::ptr)
        .def_prop_ro("device", &DeviceBuffer::device)
        .def_prop_ro("nbytes", &DeviceBuffer::nbytes)
        .def_prop_ro("released", &DeviceBuffer::released)
        .def(
            "tensor",
            [](nb::handle self) {
                DeviceBuffer& b = nb::cast<DeviceBuffer&>(self);
                b.check_live("tensor");
                const size_t shape[1] = {static_cast<size_t>(b.nbytes())};
                return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>>(
                    reinterpret_cast<void*>(b.ptr()), 1, shape, self, nullptr, nb::dtype<uint8_t>(),
                    nb::device::cuda::value, b.device());
            },
            "A torch uint8 tensor over the whole buffer; it keeps the buffer object alive (release() still "
            "frees the memory: drop the views first).")
        .def(
            "ipc_export",
            [](DeviceBuffer& b) {
                b.check_live("ipc_export");
                return export_tuple(b.ptr());
            },
            "(handle, offset, size, device) of this buffer, as ipc_export(ptr).")
        .def("release", &DeviceBuffer::release, "Frees the memory now (cudaFree: synchronizes the device).");
}
