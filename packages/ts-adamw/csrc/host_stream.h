// STREAM-style host memory bandwidth kernels on the shared host pool, so the
// benchmark compares AdamW with what this machine's memory actually sustains
// under the same threads, ISA and chunking.
#pragma once

#include <cstdint>

namespace ts_adamw {

// a[i] = b[i] + s * c[i] over n floats (STREAM triad). `nontemporal` writes `a`
// with streaming stores (no write-allocate read). Returns the seconds of the
// threaded pass. Call without the GIL.
double stream_triad(float* a, const float* b, const float* c, float s, int64_t n, bool nontemporal, int threads);

// AdamW's memory pattern without its arithmetic: 4 streams read, 3 written in
// place (every written line was read, so no write-allocate traffic):
//   p = p + s*g;  m = m + s*g;  v = v + s*p_old
// Returns the seconds of the threaded pass. Call without the GIL.
double stream_rmw(float* p, const float* g, float* m, float* v, float s, int64_t n, int threads);

// Copies `bytes` (a multiple of 64) from `src` to the 64-byte aligned `dst`
// with non-temporal stores, using the active ISA. No fence: call
// stream_fence() before the data is handed to another thread or device.
void nt_copy(void* dst, const void* src, int64_t bytes);
void stream_fence();

}  // namespace ts_adamw
