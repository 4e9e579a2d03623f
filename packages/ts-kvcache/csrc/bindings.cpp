// Python bindings of ts_kvcache._core: one entry point moves pages between a
// layer's slot and its host pages, on the CPU or enqueued on a CUDA stream.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "pages.h"
#include "ts/bindings.h"
#include "ts/ndarray.h"

namespace nb = nanobind;
using namespace ts_kvcache;

namespace {

using AddressArray = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using AnyArray = nb::ndarray<nb::c_contig>;

enum Method { kEngine = 0, kKernel = 1 };

void copy_pages(AddressArray pages, AnyArray slot, int64_t rows, int64_t row_pitch, int64_t page_width,
                int64_t first_page, bool to_pages, int method, uintptr_t stream, int64_t column, int64_t width) {
    const bool cuda = ts::is_cuda(slot);
    TS_CHECK_ARG(cuda || ts::is_cpu(slot), "copy_pages: the slot must be a CPU or CUDA tensor");
    TS_CHECK_ARG(method == kEngine || method == kKernel, "copy_pages: method must be 0 (engine) or 1 (kernel), got ",
                 method);
    TS_CHECK_ARG(rows >= 0 && row_pitch > 0 && page_width > 0 && first_page >= 0,
                 "copy_pages: rows, row_pitch, page_width and first_page must be positive (got ", rows, ", ",
                 row_pitch, ", ", page_width, ", ", first_page, ")");
    TS_CHECK_ARG(static_cast<uint64_t>(rows) * static_cast<uint64_t>(row_pitch) == ts::nbytes_of(slot),
                 "copy_pages: rows x row_pitch (", rows, " x ", row_pitch, ") must equal the slot's ",
                 ts::nbytes_of(slot), " bytes");
    if (width < 0) width = page_width - column;  // whole page rows from `column` on
    TS_CHECK_ARG(column >= 0 && width > 0 && column + width <= page_width, "copy_pages: bytes ", column, "..",
                 column + width, " of each page row must lie within its ", page_width, " bytes");
    const int64_t count = static_cast<int64_t>(pages.size());
    TS_CHECK_ARG(count == 0 || (first_page + count - 1) * page_width + column + width <= row_pitch, "copy_pages: pages ",
                 first_page, "..", first_page + count, " of ", page_width, " bytes (bytes ", column, "..",
                 column + width, " of each) run past the slot row of ", row_pitch, " bytes");
    PageCopy job;
    job.pages = reinterpret_cast<const uint64_t*>(pages.data());
    for (int64_t i = 0; i < count; ++i)
        TS_CHECK_ARG(job.pages[i] != 0, "copy_pages: page ", i, " has a null address");
    job.count = count;
    job.slot = static_cast<char*>(slot.data());
    job.rows = rows;
    job.row_pitch = row_pitch;
    job.page_width = page_width;
    job.first_page = first_page;
    job.column = column;
    job.width = width;
    job.to_pages = to_pages;
    if (count == 0 || rows == 0) return;
    if (cuda) {
#ifdef TS_WITH_CUDA
        const int device = static_cast<int>(slot.device_id());
        if (method == kKernel)
            copy_pages_cuda_kernel(job, device, stream);
        else
            copy_pages_cuda_engine(job, device, stream);
#else
        ts::cuda_unavailable("copy_pages on a CUDA slot");
#endif
        return;
    }
    nb::gil_scoped_release release;
    copy_pages_cpu(job);
}

}  // namespace

NB_MODULE(_core, m) {
    ts::register_common(m);
    m.def("copy_pages", &copy_pages, nb::arg("pages"), nb::arg("slot").noconvert(), nb::arg("rows"),
          nb::arg("row_pitch"), nb::arg("page_width"), nb::arg("first_page"), nb::arg("to_pages"),
          nb::arg("method") = 0, nb::arg("stream") = 0, nb::arg("column") = 0, nb::arg("width") = -1,
          "Copies `pages` (int64 addresses, logical pages first_page.. of the slot) into the slot, or the slot's "
          "pages into them when to_pages: bytes [column, column + width) of every page row (width -1: to the end "
          "of the row). CPU slots: host threads, GIL released. CUDA slots: enqueued on `stream` "
          "(method 0: cudaMemcpy2DAsync per page; 1: a kernel reading page-locked pages); never synchronizes.");
}
