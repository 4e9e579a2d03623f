// Host path of the page copies: the same geometry as the CUDA path, so the CPU
// tests exercise the page table and slot arithmetic the GPU runs.
#include <algorithm>
#include <cstring>

#include "pages.h"
#include "ts/thread_pool.h"

namespace ts_kvcache {

void copy_pages_cpu(const PageCopy& job) {
    const int64_t items = job.count * job.rows;  // one page row each
    if (items == 0) return;
    // Small copies stay on the calling thread: waking workers costs more.
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(job.width, 1));
    ts::host_pool().parallel_for(items, grain, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t page = item / job.rows, row = item % job.rows;
            char* in_slot = job.slot + row * job.row_pitch + (job.first_page + page) * job.page_width + job.column;
            char* in_page = reinterpret_cast<char*>(job.pages[page]) + row * job.page_width + job.column;
            if (job.to_pages)
                std::memcpy(in_page, in_slot, job.width);
            else
                std::memcpy(in_slot, in_page, job.width);
        }
    });
}

}  // namespace ts_kvcache
