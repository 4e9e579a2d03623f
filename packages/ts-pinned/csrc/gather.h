// Rows of a table in page-locked host memory gathered straight into device memory by a kernel that
// reads the host pages over the link (unified addressing: a cudaHostAlloc'd or registered page is
// readable from the device), so a lookup needs no copy of the table and no host synchronization.
#pragma once

#include <cstdint>

namespace ts_pinned {

// out[r] = table[ids[r]] for r < n, each row row_bytes long; an id outside [0, rows) writes a zero
// row and sets *bad (host memory the kernel writes through the link) to 1. Enqueued on `stream`.
void gather_rows_cuda(const void* table, int64_t rows, int64_t row_bytes, const int64_t* ids, int64_t n, void* out,
                      int* bad, int device, uintptr_t stream);

// The device address of a page-locked host pointer (its own value under unified addressing), or
// nullptr when `host` is not page-locked memory the device can read.
const void* device_view_of_host(const void* host, int device);

}  // namespace ts_pinned
