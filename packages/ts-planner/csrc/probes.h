// Hardware probes: what the planner measures instead of assuming.
#pragma once

#include <cstddef>

namespace ts_planner {

// Host memory copy rate, GB/s counting bytes read plus bytes written, with
// `threads` threads of the host pool (0: all); best of `repeats` copies.
double host_copy_gbps(size_t bytes, int threads, int repeats);

struct LinkRates {
    double h2d_gbps = 0;   // pinned host -> device alone
    double d2h_gbps = 0;   // device -> pinned host alone
    double both_gbps = 0;  // both directions at once, total
};

// Host<->device rates over page-locked memory on `device`, best of `repeats`.
// Synchronizes the device (it is a measurement). Throws without CUDA.
LinkRates link_gbps(size_t bytes, int device, int repeats);

}  // namespace ts_planner
