// One host thread pool per process, shared by every TrainStream core.
//
// parallel_for splits [0, n) into chunks that the pool's workers and the
// calling thread take in turn. One parallel_for runs at a time, across all
// cores of the process (the host's memory bandwidth is the shared resource, so
// two would only slow each other); a call from inside a chunk runs inline so
// nesting cannot deadlock.
//
// Each core carries this implementation, but at import (register_common) the
// first core publishes its pool as a C table (ts/host_pool_abi.h) and the
// others use that one, so the process has one set of workers. The pool starts
// its workers at the first parallel_for, sized to the physical cores this
// process may use (affinity and cgroup quota, ts/host_cpus.h); a child forked
// at any time gets a fresh pool at its first parallel_for.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>

#include "ts/host_cpus.h"
#include "ts/host_pool_abi.h"

namespace ts {

class HostPool {
public:
    // chunk_fn(begin, end) handles one contiguous range.
    using ChunkFn = std::function<void(int64_t, int64_t)>;

    // Runs chunk_fn over [0, n) in chunks of at least `grain` items, using at
    // most `max_threads` threads (0: all). Rethrows the first exception (the
    // remaining chunks are skipped).
    void parallel_for(int64_t n, int64_t grain, const ChunkFn& chunk_fn, int max_threads = 0) const;

    // Threads the next parallel_for may use, the caller included.
    int size() const;
};

// The pool this core uses (the process-wide one once register_common ran).
const HostPool& host_pool();

// Threads of the pool in use (its configured size).
int host_pool_threads();

// Sizes the pool in use; the workers are started or stopped at the next
// parallel_for (after any running one). ValueError unless
// 1 <= threads <= max_host_threads().
void set_host_pool_threads(int64_t threads);

// "use 1 to N (...)": the accepted thread counts, for messages.
std::string host_threads_range();

// This core's own pool as a C table (what it publishes).
const ts_host_pool_api& local_host_pool_api(const char* provider_name = nullptr);

// The table parallel_for goes through; set once at module init by the registry.
const ts_host_pool_api& active_host_pool_api();
void use_host_pool_api(const ts_host_pool_api& api);

// Finds the process-wide pool on `sys` or publishes this core's (needs the
// GIL: call from module init). Returns "" or a warning explaining why this
// core falls back to its own pool.
std::string bind_process_host_pool(const char* module_name);

// A single background thread that runs tasks in submission order: the place
// for asynchronous host work (an optimizer step while backward continues).
// Tasks may call parallel_for.
class AsyncLane {
public:
    AsyncLane();
    ~AsyncLane();
    AsyncLane(const AsyncLane&) = delete;
    AsyncLane& operator=(const AsyncLane&) = delete;

    std::shared_future<void> submit(std::function<void()> task);
    // Waits until every task submitted so far has finished.
    void drain();

private:
    void loop();
    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<std::packaged_task<void()>> queue_;
    std::shared_future<void> last_;
    bool stop_ = false;
    // Last, and started in the constructor body: the thread runs loop() at
    // once, so every member it touches must already be constructed.
    std::thread thread_;
};

}  // namespace ts
