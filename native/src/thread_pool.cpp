#include "ts/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <utility>

namespace ts {

int physical_core_count() {
    std::ifstream cpuinfo("/proc/cpuinfo");
    std::set<std::pair<int, int>> cores;  // (physical id, core id)
    int physical = 0;
    std::string line;
    while (std::getline(cpuinfo, line)) {
        auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::string key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
        const char* value = line.c_str() + colon + 1;
        if (key == "physical id") physical = std::atoi(value);
        if (key == "core id") cores.emplace(physical, std::atoi(value));
    }
    int logical = static_cast<int>(std::thread::hardware_concurrency());
    int found = static_cast<int>(cores.size());
    if (found <= 0) return std::max(1, logical);
    return std::max(1, std::min(found, logical > 0 ? logical : found));
}

struct ThreadPool::Job {
    const ChunkFn* fn;
    int64_t n;
    int64_t chunk;
    std::atomic<int64_t> next{0};
    int seats;                  // threads allowed to join, caller included
    std::atomic<int> joined{0};
    std::mutex error_mutex;
    std::exception_ptr error;
};

namespace {
thread_local bool inside_pool_worker = false;
}

ThreadPool::ThreadPool(int threads) {
    int extra = std::max(0, threads - 1);
    workers_.reserve(extra);
    for (int i = 0; i < extra; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
}

void ThreadPool::run_chunks(Job& job) {
    if (job.joined.fetch_add(1) >= job.seats) return;
    for (;;) {
        int64_t begin = job.next.fetch_add(job.chunk);
        if (begin >= job.n) return;
        int64_t end = std::min(job.n, begin + job.chunk);
        try {
            (*job.fn)(begin, end);
        } catch (...) {
            std::lock_guard<std::mutex> lock(job.error_mutex);
            if (!job.error) job.error = std::current_exception();
            job.next.store(job.n);  // stop handing out chunks
        }
    }
}

void ThreadPool::worker_loop() {
    inside_pool_worker = true;
    uint64_t seen = 0;
    for (;;) {
        Job* job;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || (job_ != nullptr && generation_ != seen); });
            if (stop_) return;
            seen = generation_;
            job = job_;
            ++busy_;
        }
        run_chunks(*job);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            --busy_;
        }
        done_.notify_all();
    }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const ChunkFn& chunk_fn, int max_threads) {
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    int threads = size();
    if (max_threads > 0) threads = std::min(threads, max_threads);
    int64_t useful = (n + grain - 1) / grain;
    if (inside_pool_worker || threads <= 1 || useful <= 1) {
        chunk_fn(0, n);
        return;
    }
    threads = static_cast<int>(std::min<int64_t>(threads, useful));

    std::lock_guard<std::mutex> submit(submit_mutex_);
    Job job;
    job.fn = &chunk_fn;
    job.n = n;
    // A few chunks per thread balance uneven progress without much contention.
    job.chunk = std::max(grain, (n + threads * 4 - 1) / (threads * 4));
    job.seats = threads;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        job_ = &job;
        ++generation_;
    }
    wake_.notify_all();
    inside_pool_worker = true;
    run_chunks(job);
    inside_pool_worker = false;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        job_ = nullptr;  // late workers find no job and go back to sleep
        done_.wait(lock, [&] { return busy_ == 0; });
    }
    if (job.error) std::rethrow_exception(job.error);
}

namespace {
std::mutex pool_mutex;
ThreadPool* pool_instance = nullptr;
int pool_threads = 0;
}  // namespace

int host_pool_threads() {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (pool_threads <= 0) pool_threads = physical_core_count();
    return pool_threads;
}

bool set_host_pool_threads(int threads) {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (pool_instance != nullptr) return false;
    pool_threads = std::max(1, threads);
    return true;
}

ThreadPool& host_pool() {
    std::lock_guard<std::mutex> lock(pool_mutex);
    if (pool_instance == nullptr) {
        if (pool_threads <= 0) pool_threads = physical_core_count();
        // Never destroyed: worker threads must not be joined during static
        // destruction at interpreter exit.
        pool_instance = new ThreadPool(pool_threads);
    }
    return *pool_instance;
}

AsyncLane::AsyncLane() { thread_ = std::thread([this] { loop(); }); }

AsyncLane::~AsyncLane() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
}

std::shared_future<void> AsyncLane::submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    std::shared_future<void> future = packaged.get_future().share();
    {
        std::lock_guard<std::mutex> lock(mutex_);
        queue_.push_back(std::move(packaged));
        last_ = future;
    }
    wake_.notify_one();
    return future;
}

void AsyncLane::drain() {
    std::shared_future<void> last;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        last = last_;
    }
    if (last.valid()) last.wait();
}

void AsyncLane::loop() {
    for (;;) {
        std::packaged_task<void()> task;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stop_ with nothing left
            task = std::move(queue_.front());
            queue_.pop_front();
        }
        task();  // exceptions land in the future
    }
}

}  // namespace ts
