// libfiber: stackful fibers for C++20 on Linux. Includes the whole public API.
#pragma once

#include "fiber/block_on.hpp"
#include "fiber/config.hpp"
#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
#include "fiber/spawn.hpp"
#include "fiber/this_fiber.hpp"
#include "fiber/waitgroup.hpp"
