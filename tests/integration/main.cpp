// The doctest entry point of each integration_<name> program (see CMakeLists.txt).
#include <doctest/doctest.h>

int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
