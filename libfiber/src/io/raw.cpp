#include "io/raw.hpp"

namespace fiber::detail::raw {

__attribute__((noinline)) int last_errno() noexcept {
  asm volatile("" ::: "memory");
  return errno;
}

}  // namespace fiber::detail::raw
