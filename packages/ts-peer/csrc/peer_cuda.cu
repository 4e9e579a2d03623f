// CUDA runtime side of ts-peer. Only host code: the copies use the copy
// engines (cudaMemcpyAsync / cudaMemcpyPeerAsync), no kernels. Nothing here
// synchronizes the device except device_free (cudaFree does).
#include <cuda.h>  // types of the driver entry point only; libcuda is not linked
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "peer.h"
#include "ts/cuda_check.h"

namespace ts_peer {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "cudaIpcMemHandle_t changed size");

namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// cuMemGetAddressRange through the runtime's driver entry point, so the module
// links no libcuda and still imports on a machine without a driver.
GetAddressRange address_range_fn() {
    static GetAddressRange fn = [] {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        cudaError_t status = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &ptr, 12000,
                                                              cudaEnableDefault, &found);
#else
        cudaError_t status = cudaGetDriverEntryPoint("cuMemGetAddressRange", &ptr, cudaEnableDefault, &found);
#endif
        if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return static_cast<GetAddressRange>(nullptr);
        }
        return reinterpret_cast<GetAddressRange>(ptr);
    }();
    return fn;
}

struct Mapping {
    uintptr_t base = 0;
    int refs = 0;
};

std::mutex& cache_mutex() {
    static std::mutex m;
    return m;
}

// (handle bytes, device) -> open mapping. cudaIpcOpenMemHandle refuses a
// handle already open in this process, hence one mapping per handle.
std::map<std::pair<std::string, int>, Mapping>& cache() {
    static auto* c = new std::map<std::pair<std::string, int>, Mapping>();  // never destroyed at exit
    return *c;
}

}  // namespace

int device_count() {
    if (!ts::cuda_device_present()) return 0;
    int count = 0;
    TS_CUDA_CHECK(cudaGetDeviceCount(&count));
    return count;
}

void check_device(int device, const char* what) {
    const int count = device_count();
    if (count == 0)
        ts::throw_runtime_error(what, ": no CUDA device or driver is present in this process");
    TS_CHECK_ARG(device >= 0 && device < count, what, ": device ", device, " is not one of the ", count,
                 " visible CUDA devices (0..", count - 1, ")");
}

bool can_access_peer(int device, int peer) {
    check_device(device, "can_access_peer");
    check_device(peer, "can_access_peer");
    if (device == peer) return true;
    int ok = 0;
    TS_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device, peer));
    return ok != 0;
}

PeerAccess enable_peer_access(int device, int peer) {
    check_device(device, "enable_peer_access");
    check_device(peer, "enable_peer_access");
    if (device == peer) return PeerAccess::same_device;
    if (!can_access_peer(device, peer))
        ts::throw_runtime_error("enable_peer_access: device ", device, " cannot access device ", peer,
                                " (no NVLink or PCIe peer path); copies between them go through host memory");
    ts::CudaDeviceGuard guard(device);
    const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
    if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // not an error for us: clear it so later checks do not see it
        return PeerAccess::already_enabled;
    }
    TS_CUDA_CHECK(status);
    return PeerAccess::enabled;
}

std::string pci_bus_id(int device) {
    check_device(device, "pci_bus_id");
    char bus[64] = {0};
    TS_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
    return std::string(bus);
}

int device_from_pci_bus_id(const std::string& bus_id) {
    if (device_count() == 0) return -1;
    int device = -1;
    if (cudaDeviceGetByPCIBusId(&device, bus_id.c_str()) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return device;
}

IpcExport ipc_export(uintptr_t ptr) {
    TS_CHECK_ARG(ptr != 0, "ipc_export: the pointer is null");
    if (device_count() == 0) ts::throw_runtime_error("ipc_export: no CUDA device or driver is present");
    cudaPointerAttributes attr{};
    TS_CUDA_CHECK(cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(ptr)));
    TS_CHECK_ARG(attr.type == cudaMemoryTypeDevice, "ipc_export: 0x", std::hex, ptr,
                 " is not device memory; CUDA IPC exports cudaMalloc allocations only");
    ts::CudaDeviceGuard guard(attr.device);
    GetAddressRange range = address_range_fn();
    if (range == nullptr)
        ts::throw_runtime_error("ipc_export: the driver does not provide cuMemGetAddressRange; update the driver");
    CUdeviceptr base = 0;
    size_t size = 0;
    if (range(&base, &size, static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
        ts::throw_runtime_error("ipc_export: cuMemGetAddressRange failed for 0x", std::hex, ptr);
    cudaIpcMemHandle_t handle;
    const cudaError_t status = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (status != cudaSuccess) {
        cudaGetLastError();
        ts::throw_runtime_error("ipc_export: cudaIpcGetMemHandle failed (", cudaGetErrorName(status),
                                "): the memory is not a plain cudaMalloc allocation (PyTorch's "
                                "expandable_segments and cudaMallocAsync pools cannot be exported); allocate it "
                                "with ts_peer.DeviceBuffer");
    }
    IpcExport out;
    out.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    out.offset = static_cast<uint64_t>(ptr - static_cast<uintptr_t>(base));
    out.size = size;
    out.device = attr.device;
    return out;
}

uintptr_t ipc_open(const std::string& handle, int device) {
    TS_CHECK_ARG(handle.size() == kIpcHandleBytes, "ipc_open: a CUDA IPC handle has ", kIpcHandleBytes,
                 " bytes, got ", handle.size());
    check_device(device, "ipc_open");
    std::lock_guard<std::mutex> lock(cache_mutex());
    auto key = std::make_pair(handle, device);
    auto it = cache().find(key);
    if (it != cache().end()) {
        ++it->second.refs;
        return it->second.base;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    ts::CudaDeviceGuard guard(device);
    void* base = nullptr;
    const cudaError_t status = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
        cudaGetLastError();
        ts::throw_runtime_error("ipc_open: cudaIpcOpenMemHandle failed (", cudaGetErrorName(status), ": ",
                                cudaGetErrorString(status),
                                "). The exporting process must still hold the allocation, and a process cannot "
                                "open its own handle (use the pointer directly)");
    }
    cache()[key] = Mapping{reinterpret_cast<uintptr_t>(base), 1};
    return reinterpret_cast<uintptr_t>(base);
}

int ipc_release(const std::string& handle, int device) {
    std::lock_guard<std::mutex> lock(cache_mutex());
    auto it = cache().find(std::make_pair(handle, device));
    TS_CHECK_ARG(it != cache().end(), "ipc_release: this handle is not open on device ", device,
                 " (released twice?)");
    if (--it->second.refs > 0) return it->second.refs;
    const uintptr_t base = it->second.base;
    cache().erase(it);
    ts::CudaDeviceGuard guard(device);
    TS_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base)));
    return 0;
}

size_t ipc_open_count() {
    std::lock_guard<std::mutex> lock(cache_mutex());
    return cache().size();
}

void copy_async(uintptr_t dst, int dst_device, uintptr_t src, int src_device, size_t nbytes, uintptr_t stream) {
    if (nbytes == 0) return;
    TS_CHECK_ARG(dst != 0 && src != 0, "copy_async: null pointer (dst 0x", std::hex, dst, ", src 0x", src, ")");
    check_device(dst_device, "copy_async");
    check_device(src_device, "copy_async");
    ts::CudaDeviceGuard guard(dst_device);  // the stream belongs to the destination's device
    auto s = reinterpret_cast<cudaStream_t>(stream);
    if (dst_device == src_device)
        TS_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                                      cudaMemcpyDeviceToDevice, s));
    else
        TS_CUDA_CHECK(cudaMemcpyPeerAsync(reinterpret_cast<void*>(dst), dst_device,
                                          reinterpret_cast<const void*>(src), src_device, nbytes, s));
}

uintptr_t device_alloc(int device, size_t nbytes) {
    TS_CHECK_ARG(nbytes > 0, "DeviceBuffer: nbytes must be positive");
    check_device(device, "DeviceBuffer");
    ts::CudaDeviceGuard guard(device);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, nbytes);
    if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        size_t free_bytes = 0, total = 0;
        cudaMemGetInfo(&free_bytes, &total);
        ts::throw_memory_error("DeviceBuffer: cannot allocate ", nbytes, " bytes on CUDA device ", device, " (",
                               free_bytes, " of ", total, " bytes free); place fewer blocks in this rank's pool");
    }
    TS_CUDA_CHECK(status);
    return reinterpret_cast<uintptr_t>(ptr);
}

void device_free(int device, uintptr_t ptr) {
    if (ptr == 0) return;
    ts::CudaDeviceGuard guard(device);
    TS_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr)));
}

}  // namespace ts_peer
