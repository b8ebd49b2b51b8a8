// Smoke test for an installed libfiber: only public headers, only the public API.
#include <fiber/fiber.hpp>

#include <cstdio>

int main() {
  const int result = fiber::block_on([] { return 42; });
  if (result != 42) {
    std::fprintf(stderr, "consumer: block_on returned %d, expected 42\n", result);
    return 1;
  }
  std::puts("consumer: ok");
  return 0;
}
