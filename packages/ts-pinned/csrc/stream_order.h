// Stream memory operations: a 64-bit counter in device memory that one CUDA
// stream writes and another waits on, on the device, without the host
// blocking (cuStreamWriteValue64 / cuStreamWaitValue64).
//
// The driver functions are looked up at run time through the runtime's
// driver entry-point API, so the module links only cudart_static and still
// imports where no driver is installed.
#pragma once

#include <nanobind/nanobind.h>

namespace ts_pinned {

// Adds stream_write_value, stream_wait_value and stream_value_ops_available.
void register_stream_order(nanobind::module_& m);

}  // namespace ts_pinned
