// The host AdamW engine: one pass over memory per element, spread over the
// shared host pool in contiguous chunks.
#pragma once

#include "plan.h"

namespace ts_adamw {

// Runs the validated plan on the calling thread and the host pool. Call
// without the GIL.
void run_host_step(const Plan& plan);

}  // namespace ts_adamw
