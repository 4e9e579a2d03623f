// What every core's NB_MODULE does first: exception translation and the
// build facts that tests and error messages report.
#pragma once

#include <nanobind/nanobind.h>

#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/host_memory_info.h"
#include "ts/thread_pool.h"

namespace ts {

namespace nb = nanobind;

inline void register_common(nb::module_& m) {
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
        try {
            std::rethrow_exception(error);
        } catch (const memory_error& e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
        }
    });
    m.attr("built_with_cuda") = built_with_cuda();
    m.def("cuda_device_present", &cuda_device_present,
          "True when this core was built with CUDA and a device and driver are present.");
    m.def("host_threads", &host_pool_threads, "Threads of the host pool (physical cores by default).");
    m.def("host_memory", [] {
        HostMemoryInfo info = host_memory_info();
        nb::dict d;
        d["total"] = info.total;
        d["available"] = info.available;
        return d;
    }, "Host RAM in bytes from /proc/meminfo: {'total', 'available'} (zeros where unreadable).");
    m.def("set_host_threads", &set_host_pool_threads, nb::arg("threads"),
          "Sizes the host pool; only before its first use. Returns False when it already runs.");
}

}  // namespace ts
