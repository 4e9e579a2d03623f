#include "ts/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <system_error>
#include <utility>
#include <vector>

#include "ts/errors.h"

namespace ts {

namespace {

thread_local bool inside_pool_worker = false;

// The workers behind this core's C table. Only reached through local_* below.
class ThreadPool {
public:
    ThreadPool() = default;
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    // See ts_host_pool_api::parallel_for; `size` is the pool size wanted now.
    int run(void* ctx, ts_chunk_fn fn, int64_t n, int64_t grain, int max_threads, int size);
    int workers() const { return started_.load(); }

private:
    struct Job {
        void* ctx;
        ts_chunk_fn fn;
        int64_t n;
        int64_t chunk;
        std::atomic<int64_t> next{0};
        int seats;  // threads allowed to join, caller included
        std::atomic<int> joined{0};
        std::atomic<bool> failed{false};
    };
    void resize(int threads);  // submit_mutex_ held, no job running
    void worker_loop();
    static void run_chunks(Job& job);

    std::vector<std::thread> workers_;
    std::atomic<int> started_{0};
    std::mutex submit_mutex_;  // one parallel_for at a time
    std::mutex mutex_;
    std::condition_variable wake_;
    std::condition_variable done_;
    Job* job_ = nullptr;
    uint64_t generation_ = 0;
    int busy_ = 0;
    bool stop_ = false;
};

void ThreadPool::run_chunks(Job& job) {
    if (job.joined.fetch_add(1) >= job.seats) return;
    for (;;) {
        int64_t begin = job.next.fetch_add(job.chunk);
        if (begin >= job.n) return;
        int64_t end = std::min(job.n, begin + job.chunk);
        if (job.fn(job.ctx, begin, end) != 0) {
            job.failed.store(true);
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

void ThreadPool::resize(int threads) {
    const size_t wanted = size_t(std::max(0, threads - 1));
    if (workers_.size() == wanted) return;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
    started_.store(0);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = false;
    }
    workers_.reserve(wanted);
    for (size_t i = 0; i < wanted; ++i) {
        try {
            workers_.emplace_back([this] { worker_loop(); });
        } catch (const std::system_error&) {
            break;  // the OS refused more threads: run with those we have
        }
        started_.fetch_add(1);
    }
}

int ThreadPool::run(void* ctx, ts_chunk_fn fn, int64_t n, int64_t grain, int max_threads, int size) {
    if (n <= 0) return 0;
    grain = std::max<int64_t>(1, grain);
    int threads = size;
    if (max_threads > 0) threads = std::min(threads, max_threads);
    const int64_t useful = (n + grain - 1) / grain;
    if (inside_pool_worker || useful <= 1) return fn(ctx, 0, n) != 0 ? 1 : 0;
    // Inline without the lock, unless the pool must first grow or shrink to `size`.
    if (threads <= 1 && started_.load() == std::max(0, size - 1)) return fn(ctx, 0, n) != 0 ? 1 : 0;

    std::lock_guard<std::mutex> submit(submit_mutex_);
    resize(size);
    threads = static_cast<int>(std::min<int64_t>({int64_t(threads), useful, int64_t(workers_.size()) + 1}));
    if (threads <= 1) return fn(ctx, 0, n) != 0 ? 1 : 0;
    Job job;
    job.ctx = ctx;
    job.fn = fn;
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
    return job.failed.load() ? 1 : 0;
}

// ---- this core's pool behind its C table ------------------------------------
// state_mutex guards the pool pointer and the requested size. It is held
// across fork() (pthread_atfork), so the child sees a consistent state; the
// child drops the parent's pool (its workers do not exist there, its mutexes
// may be held by them) and creates a new one at its first parallel_for.
std::mutex state_mutex;
ThreadPool* pool = nullptr;  // never destroyed: workers must not be joined during static destruction
int requested = 0;           // 0: the default size
int default_size = 0;        // cached physical_core_count()

int wanted_size() {  // state_mutex held
    if (requested > 0) return requested;
    if (default_size <= 0) default_size = physical_core_count();
    return default_size;
}

void before_fork() { state_mutex.lock(); }
void after_fork_parent() { state_mutex.unlock(); }
void after_fork_child() {
    pool = nullptr;  // leaked on purpose, see above
    state_mutex.unlock();
}
[[maybe_unused]] const int atfork_registered = pthread_atfork(before_fork, after_fork_parent, after_fork_child);

int local_parallel_for(void* ctx, ts_chunk_fn fn, int64_t n, int64_t grain, int32_t max_threads) noexcept {
    if (n <= 0) return 0;
    if (inside_pool_worker) return fn(ctx, 0, n) != 0 ? 1 : 0;
    try {
        ThreadPool* p;
        int size;
        {
            std::lock_guard<std::mutex> lock(state_mutex);
            if (pool == nullptr) pool = new ThreadPool();
            p = pool;
            size = wanted_size();
        }
        return p->run(ctx, fn, n, grain, max_threads, size);
    } catch (...) {
        return -1;
    }
}

int32_t local_threads() noexcept {
    std::lock_guard<std::mutex> lock(state_mutex);
    return wanted_size();
}

int32_t local_set_threads(int32_t threads) noexcept {
    if (threads < 1) return -1;
    std::lock_guard<std::mutex> lock(state_mutex);
    requested = threads;
    return 0;
}

int32_t local_workers() noexcept {
    std::lock_guard<std::mutex> lock(state_mutex);
    return pool == nullptr ? 0 : pool->workers();
}

char provider_buffer[128] = "a TrainStream core";

ts_host_pool_api local_api = {
    TS_HOST_POOL_ABI_VERSION, sizeof(ts_host_pool_api), provider_buffer,
    local_parallel_for,       local_threads,            local_set_threads,
    local_workers,
};

std::atomic<const ts_host_pool_api*> active_api{&local_api};

// Carries a C++ chunk function and its first exception across the C table.
struct Trampoline {
    const HostPool::ChunkFn* fn;
    std::mutex mutex;
    std::exception_ptr error;
};

int run_trampoline(void* ctx, int64_t begin, int64_t end) noexcept {
    auto* t = static_cast<Trampoline*>(ctx);
    try {
        (*t->fn)(begin, end);
        return 0;
    } catch (...) {
        std::lock_guard<std::mutex> lock(t->mutex);
        if (!t->error) t->error = std::current_exception();
        return 1;
    }
}

const HostPool the_pool;

}  // namespace

void HostPool::parallel_for(int64_t n, int64_t grain, const ChunkFn& chunk_fn, int max_threads) const {
    if (n <= 0) return;
    Trampoline t;
    t.fn = &chunk_fn;
    const ts_host_pool_api* api = active_api.load();
    const int rc = api->parallel_for(&t, run_trampoline, n, grain, max_threads);
    if (t.error) std::rethrow_exception(t.error);
    if (rc != 0) throw_runtime_error("the host thread pool of ", api->provider, " failed to run a parallel loop");
}

int HostPool::size() const { return active_api.load()->threads(); }

const HostPool& host_pool() { return the_pool; }

int host_pool_threads() { return active_api.load()->threads(); }

std::string host_threads_range() {
    const int usable = usable_cores();
    return concat("use 1 to ", int64_t(kThreadsPerUsableCore) * usable, " (", kThreadsPerUsableCore, " x the ", usable,
                  " cores this process may use, from its CPU affinity and cgroup CPU quota)");
}

void set_host_pool_threads(int64_t threads) {
    TS_CHECK_ARG(threads >= 1 && threads <= max_host_threads(), "threads=", threads, " is out of range; ",
                 host_threads_range());
    if (active_api.load()->set_threads(int32_t(threads)) != 0)
        throw_runtime_error("the host thread pool refused threads=", threads);
}

const ts_host_pool_api& local_host_pool_api(const char* provider_name) {
    if (provider_name != nullptr) {
        std::strncpy(provider_buffer, provider_name, sizeof(provider_buffer) - 1);
        provider_buffer[sizeof(provider_buffer) - 1] = '\0';
    }
    return local_api;
}

const ts_host_pool_api& active_host_pool_api() { return *active_api.load(); }

void use_host_pool_api(const ts_host_pool_api& api) { active_api.store(&api); }

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
