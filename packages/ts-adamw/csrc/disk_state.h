// A scratch file for optimizer state that does not fit in RAM (the NVMe tier,
// issue 46): asynchronous, aligned, chunked reads and writes served by a few
// I/O threads. No nanobind here; bindings.cpp wraps it.
//
// The file is owned by the process: it has no name in the directory for
// longer than a few instructions (O_TMPFILE, else create + unlink at once), so
// a crash, SIGKILL included, never leaves it behind; closing the descriptor
// frees its blocks.
//
// Invariants:
//   1. Every request's offset, size and buffer address are multiples of
//      kDiskAlign (direct I/O requires it; buffered files keep the same rule
//      so code that works on tmpfs also works on NVMe). Unaligned requests are
//      refused at submit with ValueError, never bounced: a bounce would hide a
//      copy of every byte on the tier's hot path.
//   2. A request is split into chunks of at most kDiskChunkBytes; the request
//      is done when its last chunk is, and carries the first failure of any of
//      its chunks. Chunks of a request that already failed are skipped.
//   3. The caller's buffer is used by the I/O threads from submit until wait
//      (or close) returns: the caller keeps it alive and does not touch it in
//      between (bindings.cpp holds a reference for Python callers).
//   4. close() and the destructor wait for every queued and running chunk
//      before the threads join and the descriptor closes: no I/O thread ever
//      touches a buffer after close() returned.
//   5. A StateFile belongs to the process that created it. A child of fork()
//      has its memory but not its threads: there every call but close() is a
//      ValueError, and close() only closes the child's descriptor, leaking the
//      thread objects instead of joining threads that do not exist there. The
//      child must not destroy the object either (leak it: owned_here() says
//      when): destroying a condition variable that the parent's threads were
//      waiting on at the fork blocks forever.
//
// Backend: pread/pwrite from a thread pool. io_uring (liburing is not a
// dependency today) would be a second backend behind submit/wait: one ring,
// the same chunks as SQEs, completions reaped by one thread; the ticket and
// failure rules above would not change.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ts_adamw {

// Alignment of offsets, sizes and addresses: the logical block of NVMe drives
// formatted with 4 KiB sectors, and a multiple of the 512-byte one; the page
// size, so page-locked staging buffers are aligned by construction.
constexpr uint64_t kDiskAlign = 4096;

// The most one I/O thread moves per system call: at ~2 GB/s a 1 MiB call
// costs ~0.5 ms against a few microseconds of syscall overhead, and a 100 MiB
// request still spreads over every I/O thread (the device sees that many
// requests in flight).
constexpr uint64_t kDiskChunkBytes = uint64_t(1) << 20;

// The most I/O threads one file may have: far beyond the queue depth a pread
// pool benefits from; refuses typos such as 4000.
constexpr int kMaxIoThreads = 64;

// An operating-system failure with its errno: ts_adamw.DiskIOError (an
// OSError subclass with .errno set) in Python.
struct DiskError : std::runtime_error {
    int error;
    DiskError(int err, const std::string& message) : std::runtime_error(message), error(err) {}
};

enum class IoOp : int { read = 0, write = 1 };

// Faults the next transfer of one kind suffers (tests only): `partial` moves
// half of the chunk (rounded down to kDiskAlign) and then the rest, so the
// retry loop recovers; `short_eof` moves half and then sees end of file, as
// on a truncated file; `eio` fails with EIO. A chunk of a single block cannot
// be halved and moves whole under `partial` and `short_eof`.
enum class IoFault : int { none = 0, partial = 1, short_eof = 2, eio = 3 };

// Tests: while on, StateFile's constructor acts as if the filesystem refused
// O_DIRECT (the fallback path is testable where every filesystem accepts it).
void simulate_direct_refused(bool on);

class StateFile {
  public:
    // A scratch file of `nbytes` (rounded up to kDiskAlign) in `directory`,
    // space reserved with posix_fallocate (reads as zeros until written).
    // `direct`: -1 O_DIRECT where the filesystem allows it (buffered
    // otherwise), 0 never, 1 required (DiskError where refused). `anonymous`:
    // try O_TMPFILE first (false: always create + unlink; tests). Failures are
    // DiskError naming the directory (and the bytes for a full disk).
    StateFile(const std::string& directory, uint64_t nbytes, int io_threads, int direct, bool anonymous);
    ~StateFile();
    StateFile(const StateFile&) = delete;
    StateFile& operator=(const StateFile&) = delete;

    // Queues a transfer of `nbytes` between [offset, offset + nbytes) of the
    // file and `buffer`; returns its ticket (> 0). ValueError for a closed
    // file, an unaligned request or one past the end. nbytes == 0 is a ticket
    // that is done at once.
    uint64_t submit(IoOp op, uint64_t offset, void* buffer, uint64_t nbytes);
    // Blocks until the ticket's transfer finished and forgets the ticket;
    // throws its DiskError (naming the file, the request and the failed
    // chunk). ValueError for a ticket never issued or already waited.
    void wait(uint64_t ticket);
    // True once the ticket's transfer finished (ValueError as for wait).
    bool done(uint64_t ticket);
    // Waits for every queued chunk, stops the threads, closes the file (its
    // blocks are freed). Tickets issued before stay valid for wait(). Safe to
    // call twice.
    void close();

    // Tests: the chunk of `op` after the next `after` ones suffers `fault`.
    void fail_next(IoOp op, IoFault fault, uint64_t after);

    const std::string& directory() const { return directory_; }
    const std::string& path() const { return path_; }  // for messages; the file has no name
    bool direct() const { return direct_; }
    bool anonymous() const { return anonymous_; }
    uint64_t size() const { return size_; }
    int io_threads() const { return io_threads_; }
    bool closed();
    bool owned_here() const;  // false in a child of fork() (invariant 5)
    size_t pending();  // tickets issued and not waited yet

  private:
    struct Request {
        IoOp op;
        uint64_t offset, nbytes;
        uint64_t chunks_left;
        int error = 0;         // errno of the first failed chunk, 0 while none failed
        std::string failure;   // what failed, set with `error`
    };
    struct Chunk {
        uint64_t ticket;
        IoOp op;
        uint64_t offset;
        char* buffer;
        uint64_t nbytes;
    };

    void worker();
    // Moves one chunk, retrying short transfers and EINTR; returns 0 or the
    // errno of the failure, described in `failure`.
    int transfer(const Chunk& chunk, IoFault fault, std::string& failure) const;
    Request& find(uint64_t ticket, const char* fn);

    void check_owner(const char* fn) const;  // invariant 5

    std::string directory_, path_;
    int fd_ = -1;
    int pid_ = 0;  // the creating process
    bool direct_ = false, anonymous_ = false;
    uint64_t size_ = 0;
    int io_threads_ = 0;
    std::mutex close_mutex_;  // serializes close(): one caller joins the threads

    std::mutex mutex_;  // guards everything below
    std::condition_variable work_;  // a chunk was queued, or stopping_
    std::condition_variable done_;  // a request finished
    std::deque<Chunk> queue_;
    std::unordered_map<uint64_t, Request> requests_;
    uint64_t next_ticket_ = 1;
    bool stopping_ = false;
    bool closed_ = false;
    IoFault fault_[2] = {IoFault::none, IoFault::none};  // by IoOp
    uint64_t fault_after_[2] = {0, 0};                    // chunks of that op spared first
    std::vector<std::thread> threads_;  // started last, once every member above exists
};

}  // namespace ts_adamw
