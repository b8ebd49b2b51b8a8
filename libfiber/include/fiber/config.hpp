// Build configuration shared by every public header: the export macro and version.
#pragma once

#define FIBER_VERSION_MAJOR 0
#define FIBER_VERSION_MINOR 1
#define FIBER_VERSION_PATCH 0

// Symbols of the shared library are hidden by default (-fvisibility=hidden); the public API is
// exported explicitly with FIBER_API.
#define FIBER_API __attribute__((visibility("default")))
