// The host AdamW engine: one pass over memory per element, spread over the
// shared host pool in contiguous chunks.
#pragma once

#include <string>

#include "plan.h"

namespace ts_adamw {

// Runs the validated plan on the calling thread and the host pool. Call
// without the GIL.
void run_host_step(const Plan& plan);

// params_out stores: "auto" (streaming, non-temporal stores when the call
// writes >= 32 MiB of params_out), "on" or "off". Same bits either way; for
// tests and benchmarks. ValueError on another name.
void set_streaming_stores(const std::string& mode);
std::string streaming_stores();

}  // namespace ts_adamw
