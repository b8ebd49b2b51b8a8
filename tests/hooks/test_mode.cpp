// The hook mode in effect is the one ctest asked for, and the C library binds the same read(2).
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "clib/blocking_lib.h"
#include "hook_util.hpp"

using namespace hook_test;

TEST_SUITE("any") {
TEST_CASE("mode: the hook mode in effect is the one this run expects") {
  const Mode m = detected_mode();
  const char* expected = std::getenv("FIBER_HOOK_TEST_MODE");
  MESSAGE("hook mode in effect: " << mode_name(m));
  if (expected == nullptr) {
    MESSAGE("FIBER_HOOK_TEST_MODE is not set: not checking the mode (ctest sets it)");
    return;
  }
  CHECK_MESSAGE(std::string(expected) == mode_name(m),
                "expected the hook mode '" << std::string(expected) << "' but '" << mode_name(m)
                                           << "' is in effect (LD_PRELOAD=" << std::string(std::getenv("LD_PRELOAD") ? std::getenv("LD_PRELOAD") : "")
                                           << ")");
}

TEST_CASE("mode: the C library calls the same read(2) as the program") {
  ssize_t (*fn)(int, void*, size_t) = ::read;
  void* mine;
  std::memcpy(&mine, &fn, sizeof mine);
  CHECK(blib_read_function() == mine);
}
}
