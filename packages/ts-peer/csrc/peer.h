// Peer-GPU primitives of ts_peer._core: peer access, CUDA IPC export/open of
// device allocations, and device-to-device copies enqueued on a caller's
// stream. Everything here exists only in a CUDA build (TS_WITH_CUDA); the
// bindings raise ts::cuda_unavailable() otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ts_peer {

// sizeof(cudaIpcMemHandle_t): the exported bytes, checked in peer_cuda.cu.
constexpr size_t kIpcHandleBytes = 64;

enum class PeerAccess { enabled = 0, already_enabled = 1, same_device = 2 };

struct IpcExport {
    std::string handle;   // kIpcHandleBytes bytes of cudaIpcMemHandle_t
    uint64_t offset = 0;  // of the exported pointer from the allocation's base
    uint64_t size = 0;    // bytes of the whole allocation
    int device = -1;      // where the allocation lives
};

#ifdef TS_WITH_CUDA
// Devices visible to this process (0 when no driver or device).
int device_count();
// ValueError unless 0 <= device < device_count(); RuntimeError without devices.
void check_device(int device, const char* what);
bool can_access_peer(int device, int peer);
// Lets `device` read and write `peer`'s memory. Idempotent.
PeerAccess enable_peer_access(int device, int peer);
std::string pci_bus_id(int device);
// -1 when no visible device has that PCI bus id.
int device_from_pci_bus_id(const std::string& bus_id);

// The IPC handle of the cudaMalloc allocation that contains `ptr`.
IpcExport ipc_export(uintptr_t ptr);
// Maps another process's allocation into this one (on `device`, the owner's
// GPU as numbered here). Cached per (handle, device): a second open returns
// the same base pointer and adds a reference.
uintptr_t ipc_open(const std::string& handle, int device);
// Drops one reference; the mapping is closed when none is left. Returns the
// references left; ValueError when the handle is not open.
int ipc_release(const std::string& handle, int device);
size_t ipc_open_count();

// Enqueues nbytes from src (on src_device) to dst (on dst_device) on
// `stream` (a cudaStream_t of dst_device, 0 for its legacy default stream).
// Never synchronizes.
void copy_async(uintptr_t dst, int dst_device, uintptr_t src, int src_device, size_t nbytes, uintptr_t stream);

uintptr_t device_alloc(int device, size_t nbytes);
void device_free(int device, uintptr_t ptr);
#endif

}  // namespace ts_peer
