// Page copies between a layer's device slot and its host pages.
//
// A slot holds one layer's keys and values as [2, batch, kv_heads, capacity,
// head_dim]: `rows` = 2 * batch * kv_heads rows of `row_pitch` bytes. A page
// holds `page_tokens` tokens of every row, contiguously: rows x `page_width`
// bytes, where page_width = page_tokens * head_dim * itemsize. Logical page k
// of the layer covers bytes [k * page_width, (k + 1) * page_width) of each
// slot row. A gather copies pages into the slot, a scatter the reverse.
#pragma once

#include <cstdint>

namespace ts_kvcache {

struct PageCopy {
    const uint64_t* pages = nullptr;  // addresses of the pages, in logical order
    int64_t count = 0;                // pages to copy
    char* slot = nullptr;             // base of the slot
    int64_t rows = 0;
    int64_t row_pitch = 0;            // bytes between slot rows
    int64_t page_width = 0;           // bytes of one row of one page
    int64_t first_page = 0;           // logical index of pages[0]
    int64_t column = 0;               // first byte copied in each page row
    int64_t width = 0;                // bytes copied per page row (column + width <= page_width)
    bool to_pages = false;            // true: slot -> pages (scatter)
};

// Memory copies on the host pool's threads (slot and pages in host memory).
void copy_pages_cpu(const PageCopy& job);

#ifdef TS_WITH_CUDA
// One strided cudaMemcpy2DAsync per page on `stream` (the copy engines).
void copy_pages_cuda_engine(const PageCopy& job, int device, uintptr_t stream);
// One kernel launch per 64 pages that reads or writes the page-locked pages
// directly through their unified addresses (the SMs; for narrow pages, where
// the copy engines pay per row). Pages must be page-locked.
void copy_pages_cuda_kernel(const PageCopy& job, int device, uintptr_t stream);
#endif

}  // namespace ts_kvcache
