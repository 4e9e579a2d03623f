// The C table through which every TrainStream core in a process shares one
// host thread pool, even when the cores were built from different versions of
// native/ (so no C++ type, exception or std::function crosses it).
//
// The first core imported publishes its table in a PyCapsule named
// TS_HOST_POOL_CAPSULE on the `sys` attribute TS_HOST_POOL_ATTR; later cores
// use that table. A core that finds a table with another abi_version, or a
// struct_size smaller than its own, warns and runs its own pool instead.
//
// Rules for changing this file: fields are only ever appended (struct_size
// grows; readers use what they know); any change of meaning or signature of an
// existing field bumps TS_HOST_POOL_ABI_VERSION.
#pragma once

#include <stdint.h>

#define TS_HOST_POOL_ABI_VERSION 1u
#define TS_HOST_POOL_ATTR "_trainstream_host_pool"
#define TS_HOST_POOL_CAPSULE "trainstream.host_pool"

#ifdef __cplusplus
extern "C" {
#endif

// Runs items [begin, end). Returns 0, or nonzero to stop the loop early (the
// caller keeps its own error: nothing but this int crosses the table).
typedef int (*ts_chunk_fn)(void* ctx, int64_t begin, int64_t end);

typedef struct ts_host_pool_api {
    uint32_t abi_version;  // TS_HOST_POOL_ABI_VERSION of the provider
    uint32_t struct_size;  // sizeof(ts_host_pool_api) at the provider
    const char* provider;  // the module that published it, e.g. "ts_adamw._core"
    // fn over [0, n) in chunks of at least `grain`, on at most max_threads
    // threads (0: all), the caller included; one call runs at a time, a call
    // from inside a chunk runs inline. Returns 0; 1 when a chunk returned
    // nonzero; -1 when the pool itself failed. Never throws.
    int (*parallel_for)(void* ctx, ts_chunk_fn fn, int64_t n, int64_t grain, int32_t max_threads);
    int32_t (*threads)(void);             // threads the next parallel_for may use
    int32_t (*set_threads)(int32_t n);    // sizes the pool (applied at the next parallel_for); 0, or -1 if n < 1
    int32_t (*workers)(void);             // worker threads started now (diagnostics)
} ts_host_pool_api;

#ifdef __cplusplus
}
#endif
