// How many bytes one process may page-lock: the one rule every core uses
// (ts-pinned's probe and ts-planner's budget both call it through their
// bindings), so the arena and the plan never disagree on the number.
#pragma once

#include <cstdint>
#include <optional>

namespace ts {

// Below this a soft RLIMIT_MEMLOCK is a distribution default (64 KiB, 8 MiB)
// that the CUDA driver's own page-locking ignores in practice; from here on it
// was raised on purpose and bounds the plan.
constexpr uint64_t kMemlockIsDeliberate = uint64_t(1) << 30;

// The soft RLIMIT_MEMLOCK in bytes, or nullopt when unlimited (or unreadable).
std::optional<uint64_t> memlock_soft_limit();

// `fraction` of this process's share of `available` bytes (split evenly between
// `processes` on the machine), and no more than its share of a deliberate
// memlock limit. `memlock`: nullopt when unlimited.
uint64_t page_lock_budget_bytes(uint64_t available, double fraction, int64_t processes,
                                std::optional<uint64_t> memlock);

}  // namespace ts
