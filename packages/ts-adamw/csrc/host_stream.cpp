// STREAM-style kernels (see host_stream.h). The plain loops are vectorized by
// the compiler per ISA (as the AdamW kernels are); the non-temporal stores use
// intrinsics, since compilers do not emit streaming stores on their own.
#include "host_stream.h"

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "isa.h"
#include "ts/thread_pool.h"

#ifdef TSA_X86
#include <immintrin.h>
#endif

namespace ts_adamw {

namespace {

// 64K floats (256 KB per stream) per chunk at least; parallel_for hands each
// thread a few large contiguous chunks.
constexpr int64_t kGrain = int64_t(1) << 16;

inline __attribute__((always_inline)) void triad_loop(float* __restrict a, const float* __restrict b,
                                                      const float* __restrict c, float s, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

inline __attribute__((always_inline)) void rmw_loop(float* __restrict p, const float* __restrict g,
                                                    float* __restrict m, float* __restrict v, float s, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float pi = p[i], gi = g[i];
        p[i] = pi + s * gi;
        m[i] = m[i] + s * gi;
        v[i] = v[i] + s * pi;
    }
}

using TriadFn = void (*)(float*, const float*, const float*, float, int64_t);
using RmwFn = void (*)(float*, const float*, float*, float*, float, int64_t);
using CopyFn = void (*)(void*, const void*, int64_t);

#define TSA_DEFINE_STREAM(SUFFIX, TARGET)                                                        \
    TARGET void triad_##SUFFIX(float* a, const float* b, const float* c, float s, int64_t n) {   \
        triad_loop(a, b, c, s, n);                                                               \
    }                                                                                            \
    TARGET void rmw_##SUFFIX(float* p, const float* g, float* m, float* v, float s, int64_t n) { \
        rmw_loop(p, g, m, v, s, n);                                                              \
    }

TSA_DEFINE_STREAM(baseline, )
TSA_DEFINE_STREAM(avx2, TSA_TARGET_AVX2)
TSA_DEFINE_STREAM(avx512, TSA_TARGET_AVX512)

#ifdef TSA_X86
// Triad with streaming stores: scalar head until `a` is aligned, then vectors.
TSA_TARGET_AVX512 void triad_nt_avx512(float* a, const float* b, const float* c, float s, int64_t n) {
    int64_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(a + i) & 63) != 0; ++i) a[i] = b[i] + s * c[i];
    const __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16)
        _mm512_stream_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(b + i), _mm512_mul_ps(vs, _mm512_loadu_ps(c + i))));
    for (; i < n; ++i) a[i] = b[i] + s * c[i];
}

TSA_TARGET_AVX2 void triad_nt_avx2(float* a, const float* b, const float* c, float s, int64_t n) {
    int64_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(a + i) & 31) != 0; ++i) a[i] = b[i] + s * c[i];
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8)
        _mm256_stream_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(vs, _mm256_loadu_ps(c + i))));
    for (; i < n; ++i) a[i] = b[i] + s * c[i];
}

void triad_nt_baseline(float* a, const float* b, const float* c, float s, int64_t n) {
    int64_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(a + i) & 15) != 0; ++i) a[i] = b[i] + s * c[i];
    const __m128 vs = _mm_set1_ps(s);
    for (; i + 4 <= n; i += 4)
        _mm_stream_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(vs, _mm_loadu_ps(c + i))));
    for (; i < n; ++i) a[i] = b[i] + s * c[i];
}

TSA_TARGET_AVX512 void copy_nt_avx512(void* dst, const void* src, int64_t bytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    for (int64_t i = 0; i < bytes; i += 64)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
}

TSA_TARGET_AVX2 void copy_nt_avx2(void* dst, const void* src, int64_t bytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    for (int64_t i = 0; i < bytes; i += 32)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
}

void copy_nt_baseline(void* dst, const void* src, int64_t bytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    for (int64_t i = 0; i < bytes; i += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
}
#else
void triad_nt_baseline(float* a, const float* b, const float* c, float s, int64_t n) { triad_loop(a, b, c, s, n); }
void copy_nt_baseline(void* dst, const void* src, int64_t bytes) {
    auto* d = static_cast<char*>(dst);
    auto* s = static_cast<const char*>(src);
    for (int64_t i = 0; i < bytes; ++i) d[i] = s[i];
}
#endif

TriadFn pick_triad(Isa isa, bool nontemporal) {
#ifdef TSA_X86
    switch (isa) {
        case Isa::avx512: return nontemporal ? &triad_nt_avx512 : &triad_avx512;
        case Isa::avx2: return nontemporal ? &triad_nt_avx2 : &triad_avx2;
        default: break;
    }
#else
    (void)isa;
#endif
    return nontemporal ? &triad_nt_baseline : &triad_baseline;
}

RmwFn pick_rmw(Isa isa) {
    switch (isa) {
        case Isa::avx512: return &rmw_avx512;
        case Isa::avx2: return &rmw_avx2;
        default: return &rmw_baseline;
    }
}

CopyFn pick_copy(Isa isa) {
#ifdef TSA_X86
    switch (isa) {
        case Isa::avx512: return &copy_nt_avx512;
        case Isa::avx2: return &copy_nt_avx2;
        default: break;
    }
#else
    (void)isa;
#endif
    return &copy_nt_baseline;
}

template <typename Body>
double timed_parallel(int64_t n, int threads, const Body& body) {
    const auto start = std::chrono::steady_clock::now();
    ts::host_pool().parallel_for(n, kGrain, body, threads);
    const auto stop = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(stop - start).count();
}

}  // namespace

void stream_fence() {
#ifdef TSA_X86
    _mm_sfence();
#endif
}

void nt_copy(void* dst, const void* src, int64_t bytes) { pick_copy(active_isa())(dst, src, bytes); }

double stream_triad(float* a, const float* b, const float* c, float s, int64_t n, bool nontemporal, int threads) {
    const TriadFn fn = pick_triad(active_isa(), nontemporal);
    return timed_parallel(n, threads, [&](int64_t begin, int64_t end) {
        fn(a + begin, b + begin, c + begin, s, end - begin);
        if (nontemporal) stream_fence();
    });
}

double stream_rmw(float* p, const float* g, float* m, float* v, float s, int64_t n, int threads) {
    const RmwFn fn = pick_rmw(active_isa());
    return timed_parallel(n, threads, [&](int64_t begin, int64_t end) {
        fn(p + begin, g + begin, m + begin, v + begin, s, end - begin);
    });
}

}  // namespace ts_adamw
