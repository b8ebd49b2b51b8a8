// libfiber: stackful fibers for C++20 on Linux. Includes the whole public API.
#pragma once

#include "fiber/block_on.hpp"
#include "fiber/config.hpp"
#include "fiber/error.hpp"
#include "fiber/scheduler.hpp"
#include "fiber/spawn.hpp"
#include "fiber/this_fiber.hpp"
#include "fiber/waitgroup.hpp"
#include "fiber/barrier.hpp"
#include "fiber/channel.hpp"
#include "fiber/condvar.hpp"
#include "fiber/latch.hpp"
#include "fiber/mutex.hpp"
#include "fiber/once.hpp"
#include "fiber/rwmutex.hpp"
#include "fiber/select.hpp"
#include "fiber/semaphore.hpp"
