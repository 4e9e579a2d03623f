// What every core's NB_MODULE does first: exception translation, joining the
// process-wide host pool, and the host facts that tests and messages report.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "ts/cgroup.h"
#include "ts/cuda_check.h"
#include "ts/errors.h"
#include "ts/host_cpus.h"
#include "ts/host_memory_info.h"
#include "ts/page_lock.h"
#include "ts/thread_pool.h"

namespace ts {

namespace nb = nanobind;

// A Python int as int64 (set_host_pool_threads checks the range), else
// ValueError naming the limit: bools, floats and ints too large for C are
// refused alike, never with nanobind's TypeError.
inline int64_t thread_count_arg(nb::handle value) {
    if (PyBool_Check(value.ptr()) || !PyLong_Check(value.ptr()))
        throw_value_error("threads=", nb::repr(value).c_str(), " must be an int >= 1");
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0)
        throw_value_error("threads=", nb::repr(value).c_str(), " is out of range; ", host_threads_range());
    return n;
}

inline void register_common(nb::module_& m) {
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
        try {
            std::rethrow_exception(error);
        } catch (const memory_error& e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
        }
    });
    nb::str module_name = nb::borrow<nb::str>(m.attr("__name__"));
    const std::string warning = bind_process_host_pool(module_name.c_str());
    if (!warning.empty() && PyErr_WarnEx(PyExc_RuntimeWarning, warning.c_str(), 1) != 0) throw nb::python_error();

    m.attr("built_with_cuda") = built_with_cuda();
    m.def("cuda_device_present", &cuda_device_present,
          "True when this core was built with CUDA and a device and driver are present.");
    m.def("host_threads", &host_pool_threads,
          "Threads of the process-wide host pool (default: the physical cores this process may use).");
    m.def(
        "set_host_threads",
        [](nb::handle threads) {
            set_host_pool_threads(thread_count_arg(threads));
            return true;
        },
        nb::arg("threads").none(),
        "Sizes the process-wide host pool (every core's), applied at its next parallel loop. ValueError unless "
        "1 <= threads <= max_host_threads(). Returns True.");
    m.def("usable_cores", [] { return usable_cores(); },
          "Logical CPUs this process may run on at once: its affinity mask bounded by its cgroup CPU quota.");
    m.def("max_host_threads", [] { return max_host_threads(); },
          "The most host threads set_host_threads and threads= accept: 4 x usable_cores().");
    m.def(
        "host_cpus",
        [](std::optional<std::string> root) {
            HostCpuInfo info = host_cpu_info(root.value_or(""));
            nb::dict d;
            d["affinity"] = info.affinity;
            d["quota"] = info.quota > 0 ? nb::cast(info.quota) : nb::none();
            d["quota_source"] = info.quota_source;
            d["usable"] = info.usable;
            d["physical"] = info.physical;
            return d;
        },
        nb::arg("root") = nb::none(),
        "CPUs of this process: affinity, cgroup quota (CPUs or None) and its source, usable, physical. `root` "
        "(tests) reads the cgroup files under another directory, as TS_CGROUP_ROOT does.");
    m.def(
        "host_memory",
        [](std::optional<std::string> root) {
            HostMemoryInfo info = host_memory_info(root.value_or(""));
            nb::dict d;
            d["total"] = info.total;
            d["available"] = info.available;
            d["source"] = info.source;
            d["meminfo_total"] = info.meminfo_total;
            d["meminfo_available"] = info.meminfo_available;
            d["cgroup_version"] = info.cgroup_version;
            d["cgroup_limit"] = info.cgroup_version ? nb::cast(info.cgroup_limit) : nb::none();
            d["cgroup_usage"] = info.cgroup_version ? nb::cast(info.cgroup_usage) : nb::none();
            d["cgroup_reclaimable"] = info.cgroup_version ? nb::cast(info.cgroup_reclaimable) : nb::none();
            d["cgroup_dir"] = info.cgroup_dir;
            return d;
        },
        nb::arg("root") = nb::none(),
        "Host RAM in bytes: {'total', 'available', 'source', ...}; /proc/meminfo bounded by the cgroup (v1 or v2) "
        "memory limit where one is set ('source' says which bounds 'available'). `root` (tests) reads /proc and "
        "/sys/fs/cgroup under another directory, as TS_CGROUP_ROOT does.");
    m.def("memlock_limit", [] { return memlock_soft_limit(); },
          "The soft RLIMIT_MEMLOCK in bytes, or None when unlimited.");
    m.def(
        "page_lock_budget_bytes",
        [](uint64_t available, double fraction, int64_t processes, std::optional<uint64_t> memlock) {
            return page_lock_budget_bytes(available, fraction, processes, memlock);
        },
        nb::arg("available"), nb::arg("fraction") = 0.8, nb::arg("processes") = 1, nb::arg("memlock").none(),
        "Bytes one process may page-lock: `fraction` of its share of `available` bytes (split between `processes` "
        "on the machine), at most its share of `memlock` (the soft RLIMIT_MEMLOCK; None: unlimited) when that "
        "limit is 1 GiB or more (smaller ones are distribution defaults the CUDA driver ignores). The one rule "
        "ts-pinned's arena probe and ts-planner's budget share.");
    m.def("_host_pool_info", [] {
        const ts_host_pool_api& api = active_host_pool_api();
        PyObject* registered = PySys_GetObject(TS_HOST_POOL_ATTR);
        const bool shared = registered != nullptr && PyCapsule_IsValid(registered, TS_HOST_POOL_CAPSULE) &&
                            PyCapsule_GetPointer(registered, TS_HOST_POOL_CAPSULE) == &api;
        nb::dict d;
        d["id"] = reinterpret_cast<uintptr_t>(&api);
        d["provider"] = api.provider;
        d["abi_version"] = api.abi_version;
        d["shared"] = shared;
        d["own"] = &api == &local_host_pool_api();
        d["threads"] = api.threads();
        d["workers"] = api.workers();
        return d;
    }, "The pool this core uses: id, provider module, ABI version, shared (the process-wide one), threads, workers.");
    m.def(
        "_pool_test",
        [](int64_t items, double sleep_s, int max_threads, int64_t fail_at) {
            std::mutex mutex;
            std::set<std::thread::id> seen;
            nb::gil_scoped_release release;
            host_pool().parallel_for(items, 1, [&](int64_t begin, int64_t end) {
                for (int64_t i = begin; i < end; ++i) {
                    if (i == fail_at) throw_value_error("_pool_test: item ", i, " failed");
                    std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
                    std::lock_guard<std::mutex> lock(mutex);
                    seen.insert(std::this_thread::get_id());
                }
            }, max_threads);
            return seen.size();
        },
        nb::arg("items"), nb::arg("sleep_s") = 0.0, nb::arg("max_threads") = 0, nb::arg("fail_at") = -1,
        "Test hook: a parallel loop whose items sleep; returns how many threads ran items.");
}

}  // namespace ts
