// doctest's implementation, compiled once per build and linked into every test program
// (fiber_tests, hooks_tests*, integration_*). Each program's main.cpp holds only its main():
// compiled into each of the five, the implementation took about 15 s apiece under
// ASan+UBSan.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
