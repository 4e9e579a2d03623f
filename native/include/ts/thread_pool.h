// One host thread pool per process, sized to the physical cores.
//
// parallel_for splits [0, n) into chunks that the pool's workers and the
// calling thread take in turn. One parallel_for runs at a time (the host's
// memory bandwidth is the shared resource, so two would only slow each other);
// a call from inside a worker runs inline so nesting cannot deadlock.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace ts {

// Cores that are not hyper-thread siblings, read from /proc/cpuinfo; falls back
// to std::thread::hardware_concurrency().
int physical_core_count();

class ThreadPool {
public:
    // chunk_fn(begin, end) handles one contiguous range.
    using ChunkFn = std::function<void(int64_t, int64_t)>;

    explicit ThreadPool(int threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    // Runs chunk_fn over [0, n) in chunks of at least `grain` items, using at
    // most `max_threads` threads (0: all). Rethrows the first exception.
    void parallel_for(int64_t n, int64_t grain, const ChunkFn& chunk_fn, int max_threads = 0);

    int size() const { return static_cast<int>(workers_.size()) + 1; }

private:
    struct Job;
    void worker_loop();
    static void run_chunks(Job& job);

    std::vector<std::thread> workers_;
    std::mutex submit_mutex_;  // one parallel_for at a time
    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    Job* job_ = nullptr;
    uint64_t generation_ = 0;
    int busy_ = 0;
    bool stop_ = false;
};

// The process-wide pool (created on first use with physical_core_count()).
ThreadPool& host_pool();

// Threads the pool was created with, or will be.
int host_pool_threads();

// Sets the size of the process-wide pool; only before its first use.
// Returns false when the pool already exists.
bool set_host_pool_threads(int threads);

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
