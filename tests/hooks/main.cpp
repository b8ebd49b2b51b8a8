// The doctest entry point of the hook tests (tests/hooks/). The same sources build two programs:
//   hooks_tests_linked   libfiber_hook.a linked in whole-archive     (ctest: hooks_linked)
//   hooks_tests          no hook linked: run with LD_PRELOAD=libfiber_hook.so (hooks_preload)
//                        and without it (hooks_none)
// Test suites: "hooked" needs the hook in effect, "unhooked" needs it absent, "any" holds in
// every mode. FIBER_HOOK_TEST_MODE=linked|preload|none (set by ctest) is checked against the
// mode actually in effect, so a preload that silently failed cannot pass as hooked.
#include <doctest/doctest.h>

int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
