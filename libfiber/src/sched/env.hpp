// Integer environment variables (FIBER_PROCS, FIBER_STACK_SIZE, FIBER_SPIN_US,
// FIBER_GUARDED_STACKS, FIBER_BLOCKING_THREADS), parsed one way for all of them.
#pragma once

#include <optional>

namespace fiber::detail {

// `value`, the variable `name`'s, as a decimal integer in [lo, hi]; nullopt when `value` is
// nullptr or empty. Anything else (spaces, a '+', trailing characters, a number out of range)
// throws UsageError naming the variable and the value and saying what was `expected`.
std::optional<long> parse_env_in_range(const char* name, const char* value, long lo, long hi, const char* expected);

// The same for $name.
std::optional<long> env_in_range(const char* name, long lo, long hi, const char* expected);

}  // namespace fiber::detail
