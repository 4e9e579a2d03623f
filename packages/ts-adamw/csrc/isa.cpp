#include "isa.h"

#include <atomic>

#include "ts/errors.h"

namespace ts_adamw {

namespace {
std::atomic<int> forced{-1};
}

Isa best_isa() {
#ifdef TSA_X86
    static const Isa best = [] {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
            return Isa::avx512;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
            __builtin_cpu_supports("bmi2"))
            return Isa::avx2;
        return Isa::baseline;
    }();
    return best;
#else
    return Isa::baseline;
#endif
}

Isa active_isa() {
    int f = forced.load(std::memory_order_relaxed);
    return f < 0 ? best_isa() : static_cast<Isa>(f);
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::avx512: return "avx512";
        case Isa::avx2: return "avx2";
        default: return "baseline";
    }
}

void set_isa(const std::string& name) {
    if (name == "auto") {
        forced.store(-1);
        return;
    }
    Isa isa;
    if (name == "baseline") isa = Isa::baseline;
    else if (name == "avx2") isa = Isa::avx2;
    else if (name == "avx512") isa = Isa::avx512;
    else ts::throw_value_error("isa=\"", name, "\" is not a variant; use auto, baseline, avx2 or avx512");
    TS_CHECK_ARG(static_cast<int>(isa) <= static_cast<int>(best_isa()), "isa=\"", name,
                 "\" is not supported by this CPU (best: ", isa_name(best_isa()), ")");
    forced.store(static_cast<int>(isa));
}

}  // namespace ts_adamw
