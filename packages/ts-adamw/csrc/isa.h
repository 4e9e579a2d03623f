// Run-time choice of the host SIMD variant. Each kernel is compiled three
// times (x86-64 baseline, AVX2+FMA, AVX-512) from one loop that GCC/Clang
// vectorize; the best one the CPU supports is used.
#pragma once

#include <string>

namespace ts_adamw {

enum class Isa : int { baseline = 0, avx2 = 1, avx512 = 2 };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TSA_X86 1
#define TSA_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2")))
#define TSA_TARGET_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")))
#else
#define TSA_TARGET_AVX2
#define TSA_TARGET_AVX512
#endif

// The best variant this CPU runs (or the one forced by set_isa).
Isa active_isa();
// Best variant the CPU supports.
Isa best_isa();
const char* isa_name(Isa isa);
// Forces a variant ("baseline", "avx2", "avx512" or "auto"); ValueError when
// unknown or unsupported here. For tests and benchmarks.
void set_isa(const std::string& name);

}  // namespace ts_adamw
