// The doctest entry point for fiber_tests. Every test source in unit/ and stress/ links into one
// binary; `fiber_tests --test-case='*queue*'` runs a subset.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
