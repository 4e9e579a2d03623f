#include "ts/page_lock.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>

#include "ts/errors.h"

namespace ts {

std::optional<uint64_t> memlock_soft_limit() {
    struct rlimit limit {};
    if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
    return static_cast<uint64_t>(limit.rlim_cur);
}

uint64_t page_lock_budget_bytes(uint64_t available, double fraction, int64_t processes,
                                std::optional<uint64_t> memlock) {
    if (!(fraction > 0.0 && fraction <= 1.0)) throw_value_error("fraction=", fraction, " must be in (0, 1]");
    if (processes < 1) throw_value_error("processes=", processes, " must be an integer >= 1");
    const uint64_t n = static_cast<uint64_t>(processes);
    const uint64_t share = available / n;
    uint64_t budget = static_cast<uint64_t>(std::floor(static_cast<double>(share) * fraction));
    budget = std::min(budget, share);  // the double product may round up past the share
    if (memlock && *memlock >= kMemlockIsDeliberate) budget = std::min(budget, *memlock / n);
    return budget;
}

}  // namespace ts
