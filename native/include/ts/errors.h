// Error helpers shared by every TrainStream core.
//
// nanobind translates std::invalid_argument -> ValueError, std::bad_alloc ->
// MemoryError and std::runtime_error -> RuntimeError, so native code throws
// those with a message that names what was wrong and what to do.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace ts {

template <typename... Parts>
std::string concat(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

// Bad argument from the caller: becomes ValueError.
template <typename... Parts>
[[noreturn]] void throw_value_error(const Parts&... parts) {
    throw std::invalid_argument(concat(parts...));
}

// Something failed at run time (driver, OS): becomes RuntimeError.
template <typename... Parts>
[[noreturn]] void throw_runtime_error(const Parts&... parts) {
    throw std::runtime_error(concat(parts...));
}

// Memory could not be had (page-locking refused, RAM exhausted): becomes
// MemoryError with the message, once the core registered the translator
// (ts/bindings.h).
struct memory_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

template <typename... Parts>
[[noreturn]] void throw_memory_error(const Parts&... parts) {
    throw memory_error(concat(parts...));
}

}  // namespace ts

// TS_CHECK_ARG(cond, parts...): ValueError with the message unless cond holds.
#define TS_CHECK_ARG(cond, ...)                 \
    do {                                        \
        if (!(cond)) ::ts::throw_value_error(__VA_ARGS__); \
    } while (0)
