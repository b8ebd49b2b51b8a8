// Barrier: a reusable rendezvous of a fixed number of participants (std::barrier's shape,
// without a completion function: the one arrival that completes a phase is told so instead).
//
//   fiber::Barrier step(workers);
//   for (int w = 0; w < workers; ++w) go [&] {
//     for (int round = 0; round < rounds; ++round) {
//       compute(round);
//       if (step.arrive_and_wait()) publish(round);   // true for the arrival that completed the phase
//     }
//   };
//
// A phase completes when as many participants have arrived as it expects; then every waiter is
// woken and the next phase begins. arrive_and_drop() leaves for good; when its arrival is the one
// that completes a phase, it returns true and every arrive_and_wait() of that phase false. Waiting
// parks a fiber and blocks a thread; any mix works.
#pragma once

#include <cstdint>

#include "fiber/config.hpp"
#include "fiber/detail/wait.hpp"

namespace fiber {

class FIBER_API Barrier {
 public:
  // Throws UsageError if participants < 1.
  explicit Barrier(std::int64_t participants);
  ~Barrier();  // a waiter still queued is a fatal error
  Barrier(const Barrier&) = delete;
  Barrier& operator=(const Barrier&) = delete;

  // Arrives and waits for the phase to complete. Returns true for the caller whose arrival
  // completed it (the last one), false for the others. Throws UsageError if no participant is
  // left, Cancelled (a cancelled waiter's arrival is withdrawn if the phase has not completed).
  bool arrive_and_wait();
  // Arrives without waiting and leaves: this and every later phase expect one participant less.
  // Returns true if this arrival completed the phase. Throws UsageError if no participant is left.
  bool arrive_and_drop();
  // Phases completed so far (a snapshot).
  std::uint64_t phase() const noexcept;

 private:
  void complete_phase(detail::WaitQueue& woken) noexcept;  // mu_ held

  mutable detail::SpinLock mu_;
  std::int64_t expected_;      // GUARDED_BY(mu_): participants per phase
  std::int64_t arrived_ = 0;   // GUARDED_BY(mu_): arrivals in the current phase
  std::uint64_t phase_ = 0;    // GUARDED_BY(mu_)
  detail::WaitQueue waiters_;  // GUARDED_BY(mu_): arrived, waiting for the phase to complete
};

}  // namespace fiber
