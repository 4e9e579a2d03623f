#include "disk_state.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "ts/errors.h"

namespace ts_adamw {

namespace {

// Larger sizes overflow off_t sums; no filesystem holds a file this large.
constexpr uint64_t kMaxFileBytes = uint64_t(1) << 62;

std::string errno_text(int err) {
    char buf[256];
    // GNU strerror_r: thread-safe, returns the message (maybe not in buf).
    const char* text = strerror_r(err, buf, sizeof(buf));
    return ts::concat(text, " (errno ", err, ")");
}

std::string bytes_text(uint64_t bytes) {
    const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double value = double(bytes);
    int unit = 0;
    while (value >= 1024.0 && unit < 5) {
        value /= 1024.0;
        ++unit;
    }
    char buf[64];
    std::snprintf(buf, sizeof(buf), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
    return buf;
}

const char* op_name(IoOp op) { return op == IoOp::read ? "read" : "write"; }

// errno values with which open(O_TMPFILE) says "not supported here" rather
// than "this directory is unusable": EOPNOTSUPP (the filesystem), EISDIR
// (kernels before 3.11 open the directory itself), EINVAL.
bool tmpfile_unsupported(int err) { return err == EOPNOTSUPP || err == EISDIR || err == EINVAL; }

[[noreturn]] void throw_create_error(int err, const std::string& directory) {
    const char* hint = err == ENOENT    ? "; the directory does not exist (create it first)"
                       : err == ENOTDIR ? "; it is not a directory"
                       : err == EACCES  ? "; this process may not create files there"
                       : err == EROFS   ? "; the filesystem is read-only"
                                        : "";
    throw DiskError(err, ts::concat("StateFile: cannot create a scratch file in '", directory,
                                    "': ", errno_text(err), hint));
}

// Whether a direct read of the first block works: some filesystems accept the
// O_DIRECT flag but refuse the I/O itself (EINVAL).
bool direct_read_works(int fd) {
    void* block = nullptr;
    if (posix_memalign(&block, kDiskAlign, kDiskAlign) != 0) return false;
    ssize_t got;
    do {
        got = ::pread(fd, block, kDiskAlign, 0);
    } while (got < 0 && errno == EINTR);
    std::free(block);
    return got == ssize_t(kDiskAlign);
}

std::atomic<bool> refuse_direct{false};  // simulate_direct_refused(): tests only

}  // namespace

void simulate_direct_refused(bool on) { refuse_direct.store(on); }

StateFile::StateFile(const std::string& directory, uint64_t nbytes, int io_threads, int direct, bool anonymous)
    : directory_(directory), pid_(int(::getpid())) {
    TS_CHECK_ARG(!directory.empty(), "StateFile: directory must name a directory (got an empty string)");
    TS_CHECK_ARG(io_threads >= 1 && io_threads <= kMaxIoThreads, "StateFile: io_threads=", io_threads,
                 " must be from 1 to ", kMaxIoThreads);
    TS_CHECK_ARG(direct >= -1 && direct <= 1, "StateFile: direct must be None, True or False");
    TS_CHECK_ARG(nbytes >= 1 && nbytes <= kMaxFileBytes, "StateFile: nbytes=", nbytes, " must be from 1 to 2**62");
    size_ = (nbytes + kDiskAlign - 1) / kDiskAlign * kDiskAlign;

    // 1. A file without a name: O_TMPFILE, else a unique name unlinked at once
    // (a crash between the two system calls is the only way one could stay).
    if (anonymous) {
        fd_ = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        if (fd_ >= 0) {
            anonymous_ = true;
            path_ = directory + "/<unnamed O_TMPFILE>";
        } else if (!tmpfile_unsupported(errno)) {
            throw_create_error(errno, directory);
        }
    }
    if (fd_ < 0) {
        std::string name = directory + "/.ts-adamw-state-XXXXXX";
        fd_ = ::mkostemp(name.data(), O_CLOEXEC);
        if (fd_ < 0) throw_create_error(errno, directory);
        if (::unlink(name.c_str()) != 0) {
            const int err = errno;
            ::close(fd_);
            throw DiskError(err, ts::concat("StateFile: created '", name, "' but cannot unlink it: ",
                                            errno_text(err), "; remove it by hand"));
        }
        path_ = name + " (unlinked)";
    }

    // 2. Reserve the space now, so a full disk fails here and not in the
    // middle of a step. Before O_DIRECT: glibc emulates posix_fallocate with
    // one-byte writes where the filesystem lacks fallocate.
    int err;
    do {
        err = ::posix_fallocate(fd_, 0, off_t(size_));
    } while (err == EINTR);
    if (err != 0) {
        std::string free_text;
        struct statvfs vfs;
        if (::fstatvfs(fd_, &vfs) == 0)
            free_text = ts::concat("; the filesystem has ", bytes_text(uint64_t(vfs.f_bavail) * vfs.f_frsize), " free");
        ::close(fd_);
        const char* hint = err == EFBIG ? " (larger than the filesystem or RLIMIT_FSIZE allows)" : "";
        throw DiskError(err, ts::concat("StateFile: cannot reserve ", size_, " bytes (", bytes_text(size_), ") in '",
                                        directory, "': ", errno_text(err), hint, free_text));
    }

    // 3. Direct I/O where the filesystem has it (ramfs, tmpfs before Linux
    // 6.6 and some FUSE or network filesystems refuse it with EINVAL): the
    // state bypasses the page cache, which would otherwise take the RAM the
    // tier exists to save and evict the training process's own pages.
    if (direct != 0) {
        const int flags = ::fcntl(fd_, F_GETFL);
        bool set;
        int set_err = 0;
        if (refuse_direct.load()) {
            set = false;
            set_err = EINVAL;  // as tmpfs before Linux 6.6, ramfs or a FUSE filesystem answer
        } else {
            set = flags >= 0 && ::fcntl(fd_, F_SETFL, flags | O_DIRECT) == 0;
            set_err = set ? 0 : errno;
        }
        direct_ = set && direct_read_works(fd_);
        if (set && !direct_) ::fcntl(fd_, F_SETFL, flags);
        if (!direct_ && direct == 1) {
            ::close(fd_);
            throw DiskError(set_err ? set_err : EINVAL,
                            ts::concat("StateFile: the filesystem of '", directory,
                                       "' refuses direct I/O (O_DIRECT)",
                                       set_err ? ": " + errno_text(set_err) : std::string(),
                                       "; pass direct=None to fall back to buffered I/O"));
        }
    }

    // 4. The threads last: every member they use exists.
    try {
        for (int i = 0; i < io_threads; ++i) threads_.emplace_back([this] { worker(); });
    } catch (...) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        work_.notify_all();
        for (std::thread& t : threads_) t.join();
        ::close(fd_);
        throw;
    }
    io_threads_ = io_threads;
}

StateFile::~StateFile() { close(); }

bool StateFile::owned_here() const { return int(::getpid()) == pid_; }

void StateFile::check_owner(const char* fn) const {
    TS_CHECK_ARG(int(::getpid()) == pid_, "StateFile.", fn, ": this file was opened by process ", pid_,
                 "; a child of fork() cannot use it (its I/O threads live in the parent): open another one");
}

void StateFile::close() {
    if (int(::getpid()) != pid_) {
        // A child of fork() (invariant 5): no thread to join, and the locks may have been copied held. The
        // std::thread objects are leaked (destroying a joinable one terminates), the child's descriptor closed.
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
        if (!threads_.empty()) new std::vector<std::thread>(std::move(threads_));
        threads_.clear();
        closed_ = stopping_ = true;
        return;
    }
    std::lock_guard<std::mutex> closing(close_mutex_);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_) return;
        stopping_ = true;  // workers drain the queue, then return (invariant 4)
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    std::lock_guard<std::mutex> lock(mutex_);
    ::close(fd_);
    fd_ = -1;
    closed_ = true;
}

bool StateFile::closed() {
    if (int(::getpid()) != pid_) return true;  // unusable in a child of fork()
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_ || stopping_;
}

size_t StateFile::pending() {
    check_owner("pending");
    std::lock_guard<std::mutex> lock(mutex_);
    return requests_.size();
}

void StateFile::fail_next(IoOp op, IoFault fault, uint64_t after) {
    check_owner("_fail_next");
    std::lock_guard<std::mutex> lock(mutex_);
    fault_[int(op)] = fault;
    fault_after_[int(op)] = after;
}

uint64_t StateFile::submit(IoOp op, uint64_t offset, void* buffer, uint64_t nbytes) {
    const char* fn = op_name(op);
    check_owner(fn);
    const auto address = reinterpret_cast<uintptr_t>(buffer);
    const char* rule = ": offsets, sizes and buffer addresses must be multiples of 4096 bytes (direct I/O); "
                       "round the request to whole blocks and allocate buffers with ts_adamw.aligned_empty()";
    TS_CHECK_ARG(offset % kDiskAlign == 0, "StateFile.", fn, ": offset=", offset, " is not aligned", rule);
    TS_CHECK_ARG(nbytes % kDiskAlign == 0, "StateFile.", fn, ": nbytes=", nbytes, " is not aligned", rule);
    TS_CHECK_ARG(address % kDiskAlign == 0, "StateFile.", fn, ": the buffer's address 0x", std::hex, address,
                 std::dec, " is not aligned", rule);
    TS_CHECK_ARG(offset <= size_ && nbytes <= size_ - offset, "StateFile.", fn, ": bytes [", offset, ", ",
                 offset + nbytes, ") are not inside the file's ", size_, " bytes");
    TS_CHECK_ARG(nbytes == 0 || buffer != nullptr, "StateFile.", fn, ": the buffer is null");
    std::lock_guard<std::mutex> lock(mutex_);
    TS_CHECK_ARG(!stopping_, "StateFile.", fn, ": the file is closed");
    const uint64_t ticket = next_ticket_++;
    const uint64_t chunks = (nbytes + kDiskChunkBytes - 1) / kDiskChunkBytes;
    requests_.emplace(ticket, Request{op, offset, nbytes, chunks, 0, std::string()});
    char* base = static_cast<char*>(buffer);
    for (uint64_t done = 0; done < nbytes; done += kDiskChunkBytes)
        queue_.push_back(Chunk{ticket, op, offset + done, base + done, std::min(kDiskChunkBytes, nbytes - done)});
    if (chunks > 1) work_.notify_all();
    else if (chunks == 1) work_.notify_one();
    return ticket;
}

StateFile::Request& StateFile::find(uint64_t ticket, const char* fn) {
    auto it = requests_.find(ticket);
    TS_CHECK_ARG(it != requests_.end(), "StateFile.", fn, ": ticket ", ticket,
                 " is unknown or was already waited (each ticket is waited once)");
    return it->second;
}

void StateFile::wait(uint64_t ticket) {
    check_owner("wait");
    std::unique_lock<std::mutex> lock(mutex_);
    find(ticket, "wait");
    // Re-found after each wake-up: another thread may have waited this ticket
    // and erased it meanwhile (references into the map survive rehashing, not
    // erasure).
    done_.wait(lock, [&] {
        auto it = requests_.find(ticket);
        return it == requests_.end() || it->second.chunks_left == 0;
    });
    Request request = std::move(find(ticket, "wait"));
    requests_.erase(ticket);
    if (request.error != 0) throw DiskError(request.error, request.failure);
}

bool StateFile::done(uint64_t ticket) {
    check_owner("done");
    std::lock_guard<std::mutex> lock(mutex_);
    return find(ticket, "done").chunks_left == 0;
}

void StateFile::worker() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left to move
        const Chunk chunk = queue_.front();
        queue_.pop_front();
        // Not erased before chunks_left reaches 0, which needs this chunk.
        Request& request = requests_.at(chunk.ticket);
        if (request.error == 0) {  // invariant 2: a failed request's other chunks are skipped
            IoFault fault = IoFault::none;
            if (fault_[int(chunk.op)] != IoFault::none && fault_after_[int(chunk.op)]-- == 0) {
                fault = fault_[int(chunk.op)];
                fault_[int(chunk.op)] = IoFault::none;
            }
            std::string detail;
            lock.unlock();
            const int err = transfer(chunk, fault, detail);
            lock.lock();
            if (err != 0 && request.error == 0) {
                request.error = err;
                request.failure = ts::concat("StateFile: ", op_name(request.op), " of ", request.nbytes,
                                             " bytes at offset ", request.offset, " of ", path_,
                                             " failed in its chunk of ", chunk.nbytes, " bytes at offset ",
                                             chunk.offset, ": ", detail);
            }
        }
        if (--request.chunks_left == 0) done_.notify_all();
    }
}

int StateFile::transfer(const Chunk& chunk, IoFault fault, std::string& detail) const {
    uint64_t moved = 0;
    bool eof_next = false;  // IoFault::short_eof, after its first half
    while (moved < chunk.nbytes) {
        uint64_t want = chunk.nbytes - moved;
        ssize_t got;
        int err = 0;
        if (fault == IoFault::eio) {
            fault = IoFault::none;
            got = -1;
            err = EIO;
        } else if (eof_next) {
            got = 0;
        } else {
            if (fault == IoFault::partial || fault == IoFault::short_eof) {
                const uint64_t half = want / 2 / kDiskAlign * kDiskAlign;
                if (half > 0) {
                    want = half;
                    eof_next = fault == IoFault::short_eof;
                }
                fault = IoFault::none;
            }
            char* at = chunk.buffer + moved;
            const off_t where = off_t(chunk.offset + moved);
            got = chunk.op == IoOp::read ? ::pread(fd_, at, want, where) : ::pwrite(fd_, at, want, where);
            err = got < 0 ? errno : 0;
        }
        if (got < 0) {
            if (err == EINTR) continue;
            detail = ts::concat(errno_text(err), " after ", moved, " of its bytes");
            return err;
        }
        if (got == 0) {  // no progress: retrying would loop forever
            detail = ts::concat(chunk.op == IoOp::read ? "unexpected end of file" : "the write made no progress",
                                " after ", moved, " of its bytes (", errno_text(EIO), ")");
            return EIO;
        }
        moved += uint64_t(got);  // a short transfer: the loop moves the rest
    }
    return 0;
}

}  // namespace ts_adamw
