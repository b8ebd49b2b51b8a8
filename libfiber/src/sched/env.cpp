#include "sched/env.hpp"

#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>
#include <system_error>

#include "fiber/error.hpp"

namespace fiber::detail {

std::optional<long> parse_env_in_range(const char* name, const char* value, long lo, long hi, const char* expected) {
  if (value == nullptr || *value == '\0') return std::nullopt;
  const std::string_view v(value);
  long n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n, 10);
  if (ec != std::errc() || end != v.data() + v.size() || n < lo || n > hi) {
    throw UsageError(std::string("fiber: invalid ") + name + " value '" + value + "' (expected " + expected + ")");
  }
  return n;
}

std::optional<long> env_in_range(const char* name, long lo, long hi, const char* expected) {
  return parse_env_in_range(name, std::getenv(name), lo, hi, expected);
}

}  // namespace fiber::detail
