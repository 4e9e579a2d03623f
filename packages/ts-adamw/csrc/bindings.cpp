// Python bindings of ts_adamw._core. Tensors cross as dtype-less DLPack arrays
// (noconvert: a wrong dtype or a strided view is refused, never copied), are
// validated into a Plan, and the work runs without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include <unistd.h>

#include "cuda_entry.h"
#include "disk_state.h"
#include "host_adamw.h"
#include "host_norm.h"
#include "host_stream.h"
#include "isa.h"
#include "plan.h"
#include "ts/bindings.h"
#include "ts/errors.h"
#include "ts/ndarray.h"
#include "ts/thread_pool.h"

namespace nb = nanobind;
using namespace ts_adamw;
using Arrays = std::vector<AnyArray>;

namespace {

// The lane that runs asynchronous steps in submission order. Never destroyed:
// its thread must not be joined during static destruction at exit (Python's
// atexit drains it instead, see _drain_async). A child created by fork() has
// the parent's lane object but not its thread, so it gets a fresh lane (the
// old one is leaked: its mutex may have been held at the fork).
ts::AsyncLane& step_lane() {
    static std::mutex mutex;
    static ts::AsyncLane* lane = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(mutex);
    if (lane == nullptr || owner != getpid()) {
        lane = new ts::AsyncLane();
        owner = getpid();
    }
    return *lane;
}

// A submitted step. Holds the arrays (and the caller's Python objects) until
// the step is waited on or the handle dies; both happen on a thread that
// holds the GIL, never on the worker (the task itself captures only raw
// pointers). The lane task never references the handle, so a handle may die
// at any time: its destructor waits for the task first.
struct StepHandle {
    std::shared_future<void> future;
    Arrays arrays;
    nb::object keepalive;

    ~StepHandle() {
        if (future.valid() && !ready()) {
            nb::gil_scoped_release release;
            future.wait();
        }
    }
    bool ready() const { return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
    void wait() {
        if (future.valid() && !ready()) {
            nb::gil_scoped_release release;
            future.wait();
        }
        // Move the references out before dropping them: dropping a tensor can run Python code that lets
        // another thread in, which may call wait() on this handle too; each caller then drops only what
        // it took, never the same vector twice.
        Arrays dead_arrays;
        dead_arrays.swap(arrays);
        nb::object dead_keepalive = std::move(keepalive);
        keepalive = nb::object();
        dead_arrays.clear();
        dead_keepalive = nb::object();
        if (future.valid()) future.get();  // rethrows the step's error, every time
    }
};

void* host_place(const AnyArray& a, const char* what) {
    TS_CHECK_ARG(ts::is_cpu(a), "adamw_step: ", what,
                 " is not a CPU tensor; the host engine updates CPU tensors (use cuda_adamw_step for GPU tensors)");
    return a.data();
}

StepArgs make_args(double lr, double beta1, double beta2, double eps, double wd, int64_t step, bool maximize,
                   double grad_scale, uint64_t seed) {
    return StepArgs{lr, beta1, beta2, eps, wd, step, maximize, grad_scale, seed};
}

Plan host_plan(const Arrays& params, const Arrays& grads, const Arrays& ms, const Arrays& vs, const Arrays& outs,
               const std::vector<uint32_t>& slots, const StepArgs& args, int threads) {
    TS_CHECK_ARG(threads >= 0, "adamw_step: threads=", threads, " must be >= 1 (or None for the whole pool)");
    Plan plan = build_plan("adamw_step", params, grads, ms, vs, outs, slots, args, host_place);
    plan.max_threads = threads;
    return plan;
}

void step_sync(const Arrays& params, const Arrays& grads, const Arrays& ms, const Arrays& vs, const Arrays& outs,
               const std::vector<uint32_t>& slots, double lr, double beta1, double beta2, double eps, double wd,
               int64_t step, bool maximize, double grad_scale, uint64_t seed, int threads) {
    Plan plan = host_plan(params, grads, ms, vs, outs, slots,
                          make_args(lr, beta1, beta2, eps, wd, step, maximize, grad_scale, seed), threads);
    nb::gil_scoped_release release;
    run_host_step(plan);
}

// step() over pieces of larger tensors: offsets[i] is the index of element 0
// of tensor i in its whole tensor's stochastic-rounding stream, so a tensor
// updated piece by piece (the disk tier's segments, a data-parallel rank's
// pieces) gets the bits of one call. Empty offsets: every tensor is a whole.
void step_pieces(const Arrays& params, const Arrays& grads, const Arrays& ms, const Arrays& vs, const Arrays& outs,
                 const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets, double lr, double beta1,
                 double beta2, double eps, double wd, int64_t step, bool maximize, double grad_scale, uint64_t seed,
                 int threads) {
    Plan plan = host_plan(params, grads, ms, vs, outs, slots,
                          make_args(lr, beta1, beta2, eps, wd, step, maximize, grad_scale, seed), threads);
    assign_offsets("adamw_step", plan.segments, offsets);
    nb::gil_scoped_release release;
    run_host_step(plan);
}

// The Python face of a StateFile: holds each request's buffer (its DLPack
// reference keeps the tensor alive) until the ticket is waited or the file
// closed, so a Python caller cannot free memory an I/O thread still writes
// (disk_state.h, invariant 3). `held` is touched only with the GIL.
struct DiskFile {
    std::unique_ptr<StateFile> file;
    std::unordered_map<uint64_t, AnyArray> held;

    DiskFile(const std::string& directory, uint64_t nbytes, int io_threads, int direct, bool anonymous) {
        nb::gil_scoped_release release;  // posix_fallocate may write the whole file where it is emulated
        file = std::make_unique<StateFile>(directory, nbytes, io_threads, direct, anonymous);
    }
    ~DiskFile() {
        if (file && !file->owned_here()) {  // a child of fork(): close its descriptor, leak the rest
            file->close();
            (void)file.release();
            return;
        }
        close();
    }

    uint64_t submit(IoOp op, uint64_t offset, AnyArray buffer, std::optional<uint64_t> nbytes) {
        const char* fn = op == IoOp::read ? "StateFile.read" : "StateFile.write";
        TS_CHECK_ARG(ts::is_cpu(buffer), fn, ": the buffer is not a CPU tensor; disk I/O moves host memory");
        TS_CHECK_ARG(ts::is_contiguous(buffer), fn, ": the buffer must be contiguous");
        const uint64_t have = ts::nbytes_of(buffer);
        const uint64_t n = nbytes.value_or(have);
        TS_CHECK_ARG(n <= have, fn, ": nbytes=", n, " is more than the buffer's ", have, " bytes");
        const uint64_t ticket = file->submit(op, offset, buffer.data(), n);
        held.emplace(ticket, std::move(buffer));
        return ticket;
    }
    void wait(uint64_t ticket) {
        try {
            nb::gil_scoped_release release;
            file->wait(ticket);
        } catch (...) {
            held.erase(ticket);
            throw;
        }
        held.erase(ticket);
    }
    void close() {
        {
            nb::gil_scoped_release release;
            file->close();
        }
        held.clear();
    }
};

IoOp io_op(const std::string& name) {
    if (name == "read") return IoOp::read;
    if (name == "write") return IoOp::write;
    ts::throw_value_error("op \"", name, "\" is not read or write");
}

IoFault io_fault(const std::string& name) {
    if (name == "partial") return IoFault::partial;
    if (name == "short") return IoFault::short_eof;
    if (name == "eio") return IoFault::eio;
    if (name == "none") return IoFault::none;
    ts::throw_value_error("fault \"", name, "\" is not partial, short, eio or none");
}

PyObject* disk_io_error = nullptr;  // ts_adamw._core.DiskIOError, created once by the module

std::unique_ptr<StepHandle> step_async(Arrays params, Arrays grads, Arrays ms, Arrays vs, Arrays outs,
                                       const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets,
                                       double lr, double beta1, double beta2, double eps, double wd, int64_t step,
                                       bool maximize, double grad_scale, uint64_t seed, int threads,
                                       nb::object keepalive) {
    Plan plan = host_plan(params, grads, ms, vs, outs, slots,
                          make_args(lr, beta1, beta2, eps, wd, step, maximize, grad_scale, seed), threads);
    assign_offsets("adamw_step_async", plan.segments, offsets);
    auto handle = std::make_unique<StepHandle>();
    handle->keepalive = std::move(keepalive);
    for (Arrays* list : {&params, &grads, &ms, &vs, &outs})
        for (AnyArray& a : *list) handle->arrays.push_back(std::move(a));
    handle->future = step_lane().submit([plan = std::move(plan)] { run_host_step(plan); });
    return handle;
}

void step_cuda(const Arrays& params, const Arrays& grads, const Arrays& ms, const Arrays& vs, const Arrays& outs,
               const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets, double lr, double beta1,
               double beta2, double eps, double wd, int64_t step, bool maximize, double grad_scale, uint64_t seed,
               uintptr_t stream) {
    cuda_step(params, grads, ms, vs, outs, slots, offsets,
              make_args(lr, beta1, beta2, eps, wd, step, maximize, grad_scale, seed), stream);
}

std::unique_ptr<PreparedCudaStep> prepare_cuda(Arrays params, Arrays ms, Arrays vs, Arrays outs,
                                               const std::vector<uint32_t>& slots, const std::vector<int64_t>& offsets,
                                               const std::vector<int>& grad_kinds) {
    return std::make_unique<PreparedCudaStep>(prepare_cuda_step(std::move(params), std::move(ms), std::move(vs),
                                                                std::move(outs), slots, offsets, grad_kinds));
}

void launch_prepared(const PreparedCudaStep& step, const std::vector<uintptr_t>& grads, double lr, double beta1,
                     double beta2, double eps, double wd, int64_t n, bool maximize, double grad_scale, uint64_t seed,
                     uintptr_t stream) {
    step.launch(grads, make_args(lr, beta1, beta2, eps, wd, n, maximize, grad_scale, seed), stream);
}

double squares(const Arrays& tensors, int threads) {
    TS_CHECK_ARG(threads >= 0, "sum_of_squares: threads=", threads, " must be >= 1 (or None for the whole pool)");
    std::vector<NormSegment> segments;
    segments.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
        const AnyArray& a = tensors[i];
        Kind kind = kind_of(a);
        TS_CHECK_ARG(kind != Kind::none, "sum_of_squares: tensors[", i, "] is ", kind_name(kind),
                     "; use float32, bfloat16 or float16");
        TS_CHECK_ARG(ts::is_cpu(a), "sum_of_squares: tensors[", i, "] is not a CPU tensor");
        TS_CHECK_ARG(ts::is_contiguous(a), "sum_of_squares: tensors[", i,
                     "] must be contiguous; call .contiguous() on it first");
        segments.push_back({a.data(), int64_t(a.size()), kind});
    }
    nb::gil_scoped_release release;
    return sum_of_squares(segments, threads);
}

// Checks the buffers of a bandwidth kernel: fp32, CPU, contiguous, one element
// count, and no two overlapping (the kernels assume distinct streams).
int64_t stream_buffers(const char* fn, const std::vector<std::pair<const AnyArray*, const char*>>& arrays,
                       int threads) {
    TS_CHECK_ARG(threads >= 0, fn, ": threads=", threads, " must be >= 1 (or 0 for the whole pool)");
    const int64_t n = int64_t(arrays[0].first->size());
    for (const auto& [a, name] : arrays) {
        TS_CHECK_ARG(kind_of(*a) == Kind::f32, fn, ": ", name, " is ", kind_name(kind_of(*a)), "; use float32");
        TS_CHECK_ARG(ts::is_cpu(*a), fn, ": ", name, " is not a CPU tensor");
        TS_CHECK_ARG(ts::is_contiguous(*a), fn, ": ", name, " must be contiguous; call .contiguous() on it first");
        TS_CHECK_ARG(int64_t(a->size()) == n, fn, ": ", name, " has ", a->size(), " elements but ",
                     arrays[0].second, " has ", n, "; all buffers must have the same element count");
    }
    for (size_t i = 0; i < arrays.size(); ++i)
        for (size_t j = i + 1; j < arrays.size(); ++j) {
            auto* a = static_cast<const char*>(arrays[i].first->data());
            auto* b = static_cast<const char*>(arrays[j].first->data());
            const size_t bytes = size_t(n) * 4;
            TS_CHECK_ARG(n == 0 || a + bytes <= b || b + bytes <= a, fn, ": ", arrays[i].second, " and ",
                         arrays[j].second, " overlap; pass distinct buffers");
        }
    return n;
}

double triad(const AnyArray& a, const AnyArray& b, const AnyArray& c, double scalar, int threads, bool nontemporal) {
    const int64_t n = stream_buffers("stream_triad", {{&a, "a"}, {&b, "b"}, {&c, "c"}}, threads);
    TS_CHECK_ARG(std::isfinite(scalar), "stream_triad: scalar=", scalar, " must be finite");
    nb::gil_scoped_release release;
    return stream_triad(static_cast<float*>(a.data()), static_cast<const float*>(b.data()),
                        static_cast<const float*>(c.data()), float(scalar), n, nontemporal, threads);
}

double rmw(const AnyArray& p, const AnyArray& g, const AnyArray& m, const AnyArray& v, double scalar, int threads) {
    const int64_t n = stream_buffers("stream_rmw", {{&p, "p"}, {&g, "g"}, {&m, "m"}, {&v, "v"}}, threads);
    TS_CHECK_ARG(std::isfinite(scalar), "stream_rmw: scalar=", scalar, " must be finite");
    nb::gil_scoped_release release;
    return stream_rmw(static_cast<float*>(p.data()), static_cast<const float*>(g.data()), static_cast<float*>(m.data()),
                      static_cast<float*>(v.data()), float(scalar), n, threads);
}

// Test hook: a handle whose task fails with `message` (ValueError on wait).
std::unique_ptr<StepHandle> failing_handle(const std::string& message) {
    auto handle = std::make_unique<StepHandle>();
    handle->future = step_lane().submit([message] { ts::throw_value_error(message); });
    return handle;
}

}  // namespace

NB_MODULE(_core, m) {
    ts::register_common(m);

    nb::class_<StepHandle>(m, "StepHandle",
                           "An AdamW step running on the host pool. wait() blocks (GIL released) and re-raises "
                           "the step's error; the tensors stay referenced until then.")
        .def("wait", &StepHandle::wait, "Blocks until the step finished; re-raises its error.")
        .def("done", &StepHandle::ready, "True when the step has finished (successfully or not).");

    auto step_args = [](auto&&... extra) {
        return std::make_tuple(nb::arg("params").noconvert(), nb::arg("grads").noconvert(),
                               nb::arg("exp_avgs").noconvert(), nb::arg("exp_avg_sqs").noconvert(),
                               nb::arg("params_out").noconvert(), nb::arg("slots"), nb::arg("lr"), nb::arg("beta1"),
                               nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"), nb::arg("step"),
                               nb::arg("maximize"), nb::arg("grad_scale"), nb::arg("seed"), extra...);
    };
    // The same with `offsets` (each tensor's first index in its rounding stream; empty: all 0) after `slots`.
    auto piece_args = [](auto&&... extra) {
        return std::make_tuple(nb::arg("params").noconvert(), nb::arg("grads").noconvert(),
                               nb::arg("exp_avgs").noconvert(), nb::arg("exp_avg_sqs").noconvert(),
                               nb::arg("params_out").noconvert(), nb::arg("slots"), nb::arg("offsets"), nb::arg("lr"),
                               nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
                               nb::arg("step"), nb::arg("maximize"), nb::arg("grad_scale"), nb::arg("seed"), extra...);
    };
    std::apply([&](auto&&... a) { m.def("step", &step_sync, a..., "Fused AdamW over CPU tensor lists, in place."); },
               step_args(nb::arg("threads")));
    std::apply([&](auto&&... a) { m.def("step_async", &step_async, a..., "step_pieces() on the async lane."); },
               piece_args(nb::arg("threads"), nb::arg("keepalive")));
    std::apply([&](auto&&... a) { m.def("cuda_step", &step_cuda, a..., "Multi-tensor AdamW kernel on `stream`."); },
               piece_args(nb::arg("stream")));
    nb::class_<PreparedCudaStep>(m, "PreparedCudaStep",
                                 "The checked state of a fused CUDA AdamW over a fixed parameter set (see "
                                 "ts_adamw.CudaAdamWBatch); launch() takes the gradients as device addresses.")
        .def("launch", &launch_prepared, nb::arg("grads"), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"),
             nb::arg("eps"), nb::arg("weight_decay"), nb::arg("step"), nb::arg("maximize"), nb::arg("grad_scale"),
             nb::arg("seed"), nb::arg("stream"), "Enqueues one step on `stream` (never syncs).")
        .def_prop_ro("count", [](const PreparedCudaStep& s) { return s.prepared.plan.segments.size(); });
    m.def("prepare_cuda_step", &prepare_cuda, nb::arg("params").noconvert(), nb::arg("exp_avgs").noconvert(),
          nb::arg("exp_avg_sqs").noconvert(), nb::arg("params_out").noconvert(), nb::arg("slots"),
          nb::arg("offsets"), nb::arg("grad_kinds"), "Checks and places the state tensors of a CudaAdamWBatch once.");
    m.def("sum_of_squares", &squares, nb::arg("tensors").noconvert(), nb::arg("threads"),
          "Sum of x*x over CPU tensors (fp64 result, deterministic for any thread count).");
    m.def("host_isa", [] { return std::string(isa_name(active_isa())); }, "SIMD variant the host kernels use.");
    m.def("best_host_isa", [] { return std::string(isa_name(best_isa())); }, "Best SIMD variant this CPU runs.");
    m.def("_set_host_isa", &set_isa, nb::arg("name"), "Forces a SIMD variant (tests, benchmarks) or \"auto\".");
    m.def("stream_triad", &triad, nb::arg("a").noconvert(), nb::arg("b").noconvert(), nb::arg("c").noconvert(),
          nb::arg("scalar"), nb::arg("threads") = 0, nb::arg("nontemporal") = false,
          "STREAM triad a = b + scalar*c over fp32 CPU buffers on the host pool (GIL released); returns seconds. "
          "Bytes moved: 12 per element, plus 4 of write-allocate reads unless nontemporal=True.");
    m.def("stream_rmw", &rmw, nb::arg("p").noconvert(), nb::arg("g").noconvert(), nb::arg("m").noconvert(),
          nb::arg("v").noconvert(), nb::arg("scalar"), nb::arg("threads") = 0,
          "AdamW's pattern (read p, g, m, v; write p, m, v in place): p += s*g; m += s*g; v += s*p_old. "
          "Returns seconds; 28 bytes per element, no write-allocate traffic.");
    m.def("_set_streaming_stores", &set_streaming_stores, nb::arg("mode"),
          "params_out written with streaming stores: \"auto\" (>= 32 MiB per call), \"on\" or \"off\" "
          "(tests, benchmarks).");
    m.def("_streaming_stores", &streaming_stores, "The params_out store mode: auto, on or off.");
    m.def(
        "_drain_async",
        [] {
            nb::gil_scoped_release release;
            step_lane().drain();
        },
        "Waits (GIL released) until every submitted async step has finished; run at interpreter exit.");
    std::apply(
        [&](auto&&... a) {
            m.def("step_pieces", &step_pieces, a...,
                  "step() over pieces of larger tensors: offsets[i] is element 0's index in its tensor's rounding "
                  "stream (empty: all 0).");
        },
        piece_args(nb::arg("threads")));

    disk_io_error = PyErr_NewExceptionWithDoc(
        "ts_adamw._core.DiskIOError",
        "A disk-state I/O failure: an OSError whose errno is set and whose message names the file, the offset "
        "and the bytes.",
        PyExc_OSError, nullptr);
    if (disk_io_error == nullptr) throw nb::python_error();
    m.attr("DiskIOError") = nb::borrow(disk_io_error);
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
        try {
            std::rethrow_exception(error);
        } catch (const DiskError& e) {
            PyObject* args = Py_BuildValue("(is)", e.error, e.what());
            if (args != nullptr) {
                PyErr_SetObject(disk_io_error, args);
                Py_DECREF(args);
            }
        }
    });
    m.attr("DISK_ALIGN") = kDiskAlign;
    m.attr("DISK_CHUNK_BYTES") = kDiskChunkBytes;
    m.attr("MAX_IO_THREADS") = kMaxIoThreads;
    nb::class_<DiskFile>(m, "StateFile", "A scratch file of optimizer state; see ts_adamw.StateFile.")
        .def(nb::init<const std::string&, uint64_t, int, int, bool>(), nb::arg("directory"), nb::arg("nbytes"),
             nb::arg("io_threads"), nb::arg("direct"), nb::arg("anonymous"))
        .def("submit",
             [](DiskFile& f, const std::string& op, uint64_t offset, AnyArray buffer, std::optional<uint64_t> n) {
                 return f.submit(io_op(op), offset, std::move(buffer), n);
             },
             nb::arg("op"), nb::arg("offset"), nb::arg("buffer").noconvert(), nb::arg("nbytes").none())
        .def("wait", &DiskFile::wait, nb::arg("ticket"))
        .def("done", [](DiskFile& f, uint64_t ticket) { return f.file->done(ticket); }, nb::arg("ticket"))
        .def("close", &DiskFile::close)
        .def("_fail_next",
             [](DiskFile& f, const std::string& fault, const std::string& op, uint64_t after) {
                 f.file->fail_next(io_op(op), io_fault(fault), after);
             },
             nb::arg("fault"), nb::arg("op"), nb::arg("after"))
        .def_prop_ro("directory", [](DiskFile& f) { return f.file->directory(); })
        .def_prop_ro("path", [](DiskFile& f) { return f.file->path(); })
        .def_prop_ro("direct", [](DiskFile& f) { return f.file->direct(); })
        .def_prop_ro("anonymous", [](DiskFile& f) { return f.file->anonymous(); })
        .def_prop_ro("size", [](DiskFile& f) { return f.file->size(); })
        .def_prop_ro("io_threads", [](DiskFile& f) { return f.file->io_threads(); })
        .def_prop_ro("closed", [](DiskFile& f) { return f.file->closed(); })
        .def_prop_ro("pending", [](DiskFile& f) { return f.file->pending(); });
    m.def("_simulate_direct_refused", &simulate_direct_refused, nb::arg("on"),
          "Test hook: while on, new StateFiles act as if their filesystem refused O_DIRECT.");
    m.def("_failing_handle", &failing_handle, nb::arg("message"), "Test hook: a handle that fails on wait().");
}
