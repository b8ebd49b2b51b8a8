// Exceptions thrown by libfiber. Every misuse of the API throws one of these with a message that
// names the problem; broken internal invariants abort instead (see libfiber/README.md).
#pragma once

#include <stdexcept>
#include <string>

#include "fiber/config.hpp"

namespace fiber {

// The API was called in a way its contract forbids (joining twice, a fiber-only function from a
// plain thread, a stack size below the minimum, ...). The message says which rule was broken.
class FIBER_API UsageError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Resources ran out while creating a fiber or a scheduler (memory, stack mappings, threads).
class FIBER_API ResourceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown by an operation that was cancelled (its fiber was cancelled, or its scheduler stopped
// while it was parked). Letting it propagate unwinds the fiber cleanly.
class FIBER_API Cancelled : public std::runtime_error {
 public:
  Cancelled() : std::runtime_error("fiber: operation cancelled") {}
  using std::runtime_error::runtime_error;
};

}  // namespace fiber
