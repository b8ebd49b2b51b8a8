// Tests for LocalQueue (sched/local_queue.hpp), the per-processor run queue, and at the end for
// the Injector (sched/injector.hpp), the global queue its overflow goes to.
//
//   1. QueueHead packing.
//   2. Single-threaded owner semantics: FIFO, len/has_tasks/remaining_slots, empty pop, many laps
//      of the ring, push_back_batch.
//   3. Overflow: a full ring moves its older half plus the new item to the overflow, as an array
//      of pointers, oldest first.
//   4. Stealer: steal_into takes ceil(k/2) in order, refuses a more-than-half-full destination.
//   5. Stress: one owner, three thieves, 5M items (1.5M in sanitizer builds), every item seen
//      exactly once.
//   6. Capacity 4: randomised three-thread rounds, and an exhaustive single-threaded enumeration
//      of short operation sequences checked against a std::deque model.
//
// Hot loops record failures in a Failures object rather than calling CHECK per element: doctest
// asserts are slow in loops of millions and the threads here would contend on them.
#include "sched/local_queue.hpp"
#include "sched/injector.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using fiber::detail::LocalQueue;
using fiber::detail::QueueHead;

#if defined(FIBER_TSAN) || defined(FIBER_ASAN) || defined(__SANITIZE_THREAD__) || \
    defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// No `next` member: LocalQueue must not need one (it passes batches as arrays of pointers).
struct Item {
  uint32_t id = 0;
};

std::vector<Item> make_items(size_t n) {
  std::vector<Item> v(n);
  for (size_t i = 0; i < n; ++i) v[i].id = static_cast<uint32_t>(i);
  return v;
}

// Thread-safe failure sink: counts failures and keeps the first few messages.
class Failures {
 public:
  void add(const std::string& msg) {
    const uint64_t n = count_.fetch_add(1, std::memory_order_relaxed);
    if (n < 8) {
      std::lock_guard<std::mutex> lock(mu_);
      text_ += msg;
      text_ += '\n';
    }
  }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  std::string summary() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::to_string(count()) + " failure(s); first ones:\n" + text_;
  }

 private:
  std::atomic<uint64_t> count_{0};
  std::mutex mu_;
  std::string text_;
};

// `msg` is evaluated only when the condition fails.
#define LQ_EXPECT(failures, cond, msg)                                         \
  do {                                                                         \
    if (!(cond)) (failures).add(std::string("expected " #cond " | ") + (msg)); \
  } while (0)

#define LQ_CHECK_NO_FAILURES(failures) CHECK_MESSAGE((failures).count() == 0, (failures).summary())

std::string id_of(const Item* t) { return t == nullptr ? std::string("null") : std::to_string(t->id); }

// Reads an overflow batch: n >= 1 non-null item pointers, in array order. Returns false if the
// batch is malformed; the ids read (in array order) are appended to `out`.
bool read_batch(Item* const* items, size_t n, std::vector<uint32_t>& out) {
  if (n == 0 || items == nullptr) return false;
  for (size_t i = 0; i < n; ++i) {
    if (items[i] == nullptr) return false;
    out.push_back(items[i]->id);
  }
  return true;
}

// Single-threaded overflow sink that records every batch.
struct RecordingOverflow {
  std::vector<std::vector<uint32_t>> batches;
  std::vector<uint32_t> all;  // every id, in arrival order
  uint64_t batch_errors = 0;

  void push_batch(Item* const* items, size_t n) noexcept {
    std::vector<uint32_t> ids;
    if (!read_batch(items, n, ids)) ++batch_errors;
    all.insert(all.end(), ids.begin(), ids.end());
    batches.push_back(std::move(ids));
  }
};

// LocalQueue accepts only an Overflow whose array push_batch is noexcept (it runs after the head
// has moved past the batch, so a throw would lose items).
struct ThrowingOverflow {
  void push_batch(Item* const*, size_t) {}
};
struct LinkedOverflow {
  void push_batch(Item*, Item*, size_t) noexcept {}
};
static_assert(fiber::detail::NothrowOverflow<RecordingOverflow, Item>);
static_assert(!fiber::detail::NothrowOverflow<ThrowingOverflow, Item>);
static_assert(!fiber::detail::NothrowOverflow<LinkedOverflow, Item>);

std::vector<uint32_t> iota_ids(uint32_t from, uint32_t to) {  // [from, to)
  std::vector<uint32_t> v;
  for (uint32_t i = from; i < to; ++i) v.push_back(i);
  return v;
}

template <typename Q>
std::vector<uint32_t> drain_ids(Q& q) {
  std::vector<uint32_t> v;
  while (Item* t = q.pop()) v.push_back(t->id);
  return v;
}

// Moves the queue's free-running indices forward by `n` (push + pop of scratch items).
template <typename Q>
void advance(Q& q, uint32_t n, Item& scratch) {
  RecordingOverflow ovf;
  bool ok = true;
  for (uint32_t i = 0; i < n; ++i) {
    q.push_back_or_overflow(&scratch, ovf);
    ok = ok && q.pop() == &scratch;
  }
  // FAIL only on failure: this runs ~10^6 times in the enumeration below.
  if (!ok || !ovf.batches.empty() || q.len() != 0) FAIL("advance(" << n << ") did not leave an empty queue");
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

inline void spin(uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) cpu_relax();
}

// A reusable barrier that spins with yield: cheaper per phase than a futex wake for the many
// short rounds below. Arrivals before a phase completes happen-before departures after it.
class SpinBarrier {
 public:
  explicit SpinBarrier(uint32_t n) : n_(n) {}
  void wait() {
    const uint32_t gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    while (gen_.load(std::memory_order_acquire) == gen) std::this_thread::yield();
  }

 private:
  const uint32_t n_;
  std::atomic<uint32_t> count_{0};
  std::atomic<uint32_t> gen_{0};
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// 1. QueueHead
// ------------------------------------------------------------------------------------------------

TEST_CASE("local_queue: QueueHead pack/unpack round trip and layout") {
  const uint32_t values[] = {0u,          1u,          2u,          0x7fffffffu, 0x80000000u, 0xfffffffeu,
                             0xffffffffu, 0x12345678u, 0xdeadbeefu, 0x0000ffffu, 0xffff0000u};
  Failures f;
  for (uint32_t steal : values) {
    for (uint32_t real : values) {
      const uint64_t packed = QueueHead{steal, real}.pack();
      const std::string ctx = "steal=" + std::to_string(steal) + " real=" + std::to_string(real);
      // steal is the high half, real the low half, and neither bleeds into the other.
      LQ_EXPECT(f, packed == ((uint64_t{steal} << 32) | uint64_t{real}), ctx);
      LQ_EXPECT(f, static_cast<uint32_t>(packed >> 32) == steal, ctx);
      LQ_EXPECT(f, static_cast<uint32_t>(packed & 0xffffffffu) == real, ctx);
      const QueueHead h = QueueHead::unpack(packed);
      LQ_EXPECT(f, h.steal == steal, ctx);
      LQ_EXPECT(f, h.real == real, ctx);
    }
  }
  LQ_CHECK_NO_FAILURES(f);

  CHECK(QueueHead{0, 0}.pack() == 0u);
  CHECK(QueueHead{0, 0xffffffffu}.pack() == 0x00000000ffffffffull);
  CHECK(QueueHead{0xffffffffu, 0}.pack() == 0xffffffff00000000ull);
  CHECK(QueueHead{1, 0}.pack() == 0x0000000100000000ull);
  CHECK(QueueHead{0, 1}.pack() == 0x0000000000000001ull);
  CHECK(QueueHead{0x01234567u, 0x89abcdefu}.pack() == 0x0123456789abcdefull);

  const QueueHead a = QueueHead::unpack(0xffffffffffffffffull);
  CHECK(a.steal == 0xffffffffu);
  CHECK(a.real == 0xffffffffu);
  const QueueHead b = QueueHead::unpack(0x0000000100000000ull);
  CHECK(b.steal == 1u);
  CHECK(b.real == 0u);
  const QueueHead c = QueueHead::unpack(0x00000000ffffffffull);
  CHECK(c.steal == 0u);
  CHECK(c.real == 0xffffffffu);
  const QueueHead d = QueueHead::unpack(0x89abcdef01234567ull);
  CHECK(d.steal == 0x89abcdefu);
  CHECK(d.real == 0x01234567u);
}

// ------------------------------------------------------------------------------------------------
// 2. Single-threaded owner semantics
// ------------------------------------------------------------------------------------------------

TEST_CASE("local_queue: empty queue") {
  LocalQueue<Item, 8> q;
  RecordingOverflow ovf;
  CHECK(LocalQueue<Item, 8>::capacity() == 8u);
  CHECK(q.len() == 0u);
  CHECK_FALSE(q.has_tasks());
  CHECK(q.remaining_slots() == 8u);
  CHECK(q.pop() == nullptr);
  CHECK(q.pop() == nullptr);  // popping an empty queue changes nothing
  CHECK(q.len() == 0u);
  CHECK(q.remaining_slots() == 8u);
  auto s = q.stealer();
  CHECK(s.is_empty());
  CHECK(s.len() == 0u);

  Item a{1};
  q.push_back_or_overflow(&a, ovf);
  CHECK(q.len() == 1u);
  CHECK(q.has_tasks());
  CHECK(q.remaining_slots() == 7u);
  CHECK_FALSE(s.is_empty());
  CHECK(s.len() == 1u);
  CHECK(q.pop() == &a);
  CHECK(q.pop() == nullptr);
  CHECK(q.len() == 0u);
  CHECK_FALSE(q.has_tasks());
  CHECK(q.remaining_slots() == 8u);
  CHECK(s.is_empty());
  CHECK(ovf.batches.empty());
}

template <uint32_t Cap>
void check_fill_and_drain() {
  CAPTURE(Cap);
  LocalQueue<Item, Cap> q;
  RecordingOverflow ovf;
  auto items = make_items(Cap);
  auto s = q.stealer();
  Failures f;
  for (uint32_t i = 0; i < Cap; ++i) {
    q.push_back_or_overflow(&items[i], ovf);
    LQ_EXPECT(f, q.len() == i + 1, "push " + std::to_string(i));
    LQ_EXPECT(f, q.has_tasks(), "push " + std::to_string(i));
    LQ_EXPECT(f, q.remaining_slots() == Cap - i - 1, "push " + std::to_string(i));
    LQ_EXPECT(f, s.len() == i + 1, "push " + std::to_string(i));
  }
  CHECK(ovf.batches.empty());  // exactly Capacity items fit
  for (uint32_t i = 0; i < Cap; ++i) {
    Item* t = q.pop();
    LQ_EXPECT(f, t == &items[i], "pop " + std::to_string(i) + " got " + id_of(t));
    LQ_EXPECT(f, q.len() == Cap - i - 1, "pop " + std::to_string(i));
    LQ_EXPECT(f, q.remaining_slots() == i + 1, "pop " + std::to_string(i));
  }
  LQ_CHECK_NO_FAILURES(f);
  CHECK(q.pop() == nullptr);
  CHECK_FALSE(q.has_tasks());
  CHECK(s.is_empty());
}

TEST_CASE("local_queue: FIFO fill and drain, counters") {
  check_fill_and_drain<2>();
  check_fill_and_drain<4>();
  check_fill_and_drain<8>();
  check_fill_and_drain<256>();
}

TEST_CASE("local_queue: many laps of the ring, steady occupancy") {
  // For every occupancy k < Capacity: keep k queued and push/pop many laps; each pop must return
  // the item pushed k pushes earlier, whatever slot the indices have reached.
  constexpr uint32_t kCap = 8;
  constexpr uint32_t kLaps = 500;
  Failures f;
  for (uint32_t k = 0; k < kCap; ++k) {
    LocalQueue<Item, kCap> q;
    RecordingOverflow ovf;
    const uint32_t total = k + kLaps * kCap;
    auto items = make_items(total);
    for (uint32_t i = 0; i < k; ++i) q.push_back_or_overflow(&items[i], ovf);
    for (uint32_t i = k; i < total; ++i) {
      q.push_back_or_overflow(&items[i], ovf);
      Item* t = q.pop();
      LQ_EXPECT(f, t == &items[i - k],
                "k=" + std::to_string(k) + " i=" + std::to_string(i) + " got " + id_of(t));
      LQ_EXPECT(f, q.len() == k, "k=" + std::to_string(k) + " i=" + std::to_string(i));
      LQ_EXPECT(f, q.remaining_slots() == kCap - k, "k=" + std::to_string(k));
    }
    LQ_EXPECT(f, ovf.batches.empty(), "k=" + std::to_string(k));
    const auto rest = drain_ids(q);
    LQ_EXPECT(f, rest == iota_ids(total - k, total), "k=" + std::to_string(k));
  }
  LQ_CHECK_NO_FAILURES(f);
}

TEST_CASE("local_queue: random push/pop against a deque model, many laps") {
  constexpr uint32_t kCap = 8;
  constexpr uint32_t kSteps = 200'000;
  LocalQueue<Item, kCap> q;
  RecordingOverflow ovf;
  auto items = make_items(kSteps);
  std::deque<uint32_t> model;
  std::mt19937 rng(7);
  uint32_t next = 0;
  Failures f;
  for (uint32_t step = 0; step < kSteps; ++step) {
    const bool push = model.size() < kCap && (model.empty() || rng() % 2 == 0);
    if (push) {
      q.push_back_or_overflow(&items[next], ovf);
      model.push_back(next++);
    } else {
      Item* t = q.pop();
      if (model.empty()) {
        LQ_EXPECT(f, t == nullptr, "step " + std::to_string(step));
      } else {
        LQ_EXPECT(
            f, t == &items[model.front()],
            "step " + std::to_string(step) + " want " + std::to_string(model.front()) + " got " + id_of(t));
        model.pop_front();
      }
    }
    LQ_EXPECT(f, q.len() == model.size(), "step " + std::to_string(step));
    LQ_EXPECT(f, q.has_tasks() == !model.empty(), "step " + std::to_string(step));
    LQ_EXPECT(f, q.remaining_slots() == kCap - model.size(), "step " + std::to_string(step));
  }
  CHECK(next > 20 * kCap);  // many laps of the ring
  CHECK(ovf.batches.empty());
  LQ_CHECK_NO_FAILURES(f);
  CHECK(drain_ids(q) == std::vector<uint32_t>(model.begin(), model.end()));
}

TEST_CASE("local_queue: push_back_batch") {
  constexpr uint32_t kCap = 8;
  Failures f;
  for (uint32_t offset = 0; offset < 2 * kCap; ++offset) {
    for (uint32_t before = 0; before <= kCap; ++before) {
      for (uint32_t n = 0; before + n <= kCap; ++n) {
        const std::string ctx = "offset=" + std::to_string(offset) + " before=" + std::to_string(before) +
                                " n=" + std::to_string(n);
        LocalQueue<Item, kCap> q;
        RecordingOverflow ovf;
        Item scratch;
        advance(q, offset, scratch);
        auto items = make_items(before + n);
        for (uint32_t i = 0; i < before; ++i) q.push_back_or_overflow(&items[i], ovf);
        // The batch as an array of pointers, in order.
        std::vector<Item*> batch;
        for (uint32_t i = before; i < before + n; ++i) batch.push_back(&items[i]);
        LQ_EXPECT(f, q.remaining_slots() >= n, ctx);
        q.push_back_batch(batch.data(), n);
        LQ_EXPECT(f, q.len() == before + n, ctx);
        LQ_EXPECT(f, q.remaining_slots() == kCap - before - n, ctx);
        LQ_EXPECT(f, q.stealer().len() == before + n, ctx);
        LQ_EXPECT(f, drain_ids(q) == iota_ids(0, before + n), ctx);
        LQ_EXPECT(f, ovf.batches.empty(), ctx);
      }
    }
  }
  LQ_CHECK_NO_FAILURES(f);
}

// ------------------------------------------------------------------------------------------------
// 3. Overflow
// ------------------------------------------------------------------------------------------------

template <uint32_t Cap>
void check_overflow(uint32_t offset) {
  CAPTURE(Cap);
  CAPTURE(offset);
  constexpr uint32_t kHalf = Cap / 2;
  LocalQueue<Item, Cap> q;
  RecordingOverflow ovf;
  Item scratch;
  advance(q, offset, scratch);
  auto items = make_items(2 * Cap + 1);

  for (uint32_t i = 0; i < Cap; ++i) q.push_back_or_overflow(&items[i], ovf);
  REQUIRE(ovf.batches.empty());
  REQUIRE(q.len() == Cap);
  REQUIRE(q.remaining_slots() == 0u);

  // One more: the oldest half plus the new item leave in one batch, oldest first.
  q.push_back_or_overflow(&items[Cap], ovf);
  REQUIRE(ovf.batches.size() == 1u);
  CHECK(ovf.batch_errors == 0u);
  std::vector<uint32_t> want = iota_ids(0, kHalf);
  want.push_back(Cap);
  CHECK(ovf.batches[0] == want);
  CHECK(ovf.batches[0].size() == kHalf + 1);
  // The queue keeps the newer half.
  CHECK(q.len() == kHalf);
  CHECK(q.remaining_slots() == kHalf);
  CHECK(q.stealer().len() == kHalf);

  // It fills up again before the next overflow; that one takes the (now) oldest half.
  for (uint32_t i = Cap + 1; i < Cap + 1 + kHalf; ++i) q.push_back_or_overflow(&items[i], ovf);
  CHECK(ovf.batches.size() == 1u);
  CHECK(q.len() == Cap);
  q.push_back_or_overflow(&items[Cap + 1 + kHalf], ovf);
  REQUIRE(ovf.batches.size() == 2u);
  CHECK(ovf.batch_errors == 0u);
  want = iota_ids(kHalf, Cap);
  want.push_back(Cap + 1 + kHalf);
  CHECK(ovf.batches[1] == want);
  CHECK(q.len() == kHalf);
  CHECK(drain_ids(q) == iota_ids(Cap + 1, Cap + 1 + kHalf));
  CHECK(q.pop() == nullptr);
  CHECK(q.remaining_slots() == Cap);
}

TEST_CASE("local_queue: overflow moves the oldest half plus the new item") {
  for (uint32_t offset : {0u, 1u, 2u, 3u, 5u, 7u}) check_overflow<4>(offset);
  for (uint32_t offset : {0u, 1u, 3u, 4u, 7u, 9u}) check_overflow<8>(offset);
  for (uint32_t offset : {0u, 1u, 127u, 128u, 255u, 300u}) check_overflow<256>(offset);
  for (uint32_t offset : {0u, 1u}) check_overflow<2>(offset);
}

TEST_CASE("local_queue: overflow after pops and partial drains keeps FIFO across the ring") {
  // Model check with a bigger mix: pushes (overflowing when full) and pops, capacity 8.
  constexpr uint32_t kCap = 8;
  constexpr uint32_t kSteps = 100'000;
  LocalQueue<Item, kCap> q;
  RecordingOverflow ovf;
  auto items = make_items(kSteps);
  std::deque<uint32_t> model;
  std::vector<uint32_t> model_ovf;
  size_t batches = 0;
  std::mt19937 rng(11);
  uint32_t next = 0;
  Failures f;
  for (uint32_t step = 0; step < kSteps; ++step) {
    if (rng() % 3 != 0) {  // push-biased so the ring overflows often
      if (model.size() == kCap) {
        for (uint32_t i = 0; i < kCap / 2; ++i) {
          model_ovf.push_back(model.front());
          model.pop_front();
        }
        model_ovf.push_back(next);
        ++batches;
      } else {
        model.push_back(next);
      }
      q.push_back_or_overflow(&items[next++], ovf);
    } else {
      Item* t = q.pop();
      const uint32_t want = model.empty() ? ~0u : model.front();
      LQ_EXPECT(f, model.empty() ? t == nullptr : t == &items[want], "step " + std::to_string(step));
      if (!model.empty()) model.pop_front();
    }
    LQ_EXPECT(f, q.len() == model.size(), "step " + std::to_string(step));
    LQ_EXPECT(f, ovf.batches.size() == batches, "step " + std::to_string(step));
  }
  CHECK(batches > 1000u);
  CHECK(ovf.batch_errors == 0u);
  CHECK(ovf.all == model_ovf);
  for (const auto& b : ovf.batches) LQ_EXPECT(f, b.size() == kCap / 2 + 1, "batch size");
  LQ_CHECK_NO_FAILURES(f);
  CHECK(drain_ids(q) == std::vector<uint32_t>(model.begin(), model.end()));
}

// ------------------------------------------------------------------------------------------------
// 4. Stealer
// ------------------------------------------------------------------------------------------------

TEST_CASE("local_queue: steal_into basics") {
  using Q = LocalQueue<Item, 16>;
  Q src;
  Q dst;
  RecordingOverflow ovf;
  auto items = make_items(64);
  Q::Stealer s = src.stealer();
  Q::Stealer copy = s;  // copyable handle, same queue
  Q::Stealer unbound;   // default-constructible
  (void)unbound;

  SUBCASE("empty source") {
    CHECK(s.is_empty());
    CHECK(s.steal_into(dst) == nullptr);
    CHECK(dst.len() == 0u);
    CHECK(dst.pop() == nullptr);
    CHECK(src.remaining_slots() == 16u);
  }
  SUBCASE("one item: returned, nothing left anywhere") {
    src.push_back_or_overflow(&items[0], ovf);
    CHECK(copy.len() == 1u);
    CHECK(copy.steal_into(dst) == &items[0]);
    CHECK(dst.len() == 0u);
    CHECK(src.len() == 0u);
    CHECK(s.is_empty());
    CHECK(src.remaining_slots() == 16u);  // the thief released its reservation
  }
  SUBCASE("seven items: four stolen, the fourth returned, three in dst in order") {
    for (uint32_t i = 0; i < 7; ++i) src.push_back_or_overflow(&items[i], ovf);
    CHECK(s.len() == 7u);
    CHECK(s.steal_into(dst) == &items[3]);
    CHECK(s.len() == 3u);
    CHECK(src.len() == 3u);
    CHECK(src.remaining_slots() == 13u);
    CHECK(dst.len() == 3u);
    CHECK(dst.stealer().len() == 3u);
    CHECK(drain_ids(dst) == iota_ids(0, 3));
    CHECK(drain_ids(src) == iota_ids(4, 7));
  }
  SUBCASE("destination more than half full is refused, exactly half is accepted") {
    for (uint32_t i = 0; i < 16; ++i) src.push_back_or_overflow(&items[i], ovf);
    for (uint32_t i = 16; i < 25; ++i) dst.push_back_or_overflow(&items[i], ovf);  // 9 > 16/2
    CHECK(s.steal_into(dst) == nullptr);
    CHECK(src.len() == 16u);
    CHECK(dst.len() == 9u);
    REQUIRE(dst.pop() == &items[16]);  // now exactly 8
    Item* got = s.steal_into(dst);
    CHECK(got == &items[7]);  // 8 stolen, dst 8 + 7 = 15 (fits in 16)
    CHECK(dst.len() == 15u);
    CHECK(src.len() == 8u);
    std::vector<uint32_t> want = iota_ids(17, 25);
    for (uint32_t i = 0; i < 7; ++i) want.push_back(i);
    CHECK(drain_ids(dst) == want);
    CHECK(drain_ids(src) == iota_ids(8, 16));
  }
  SUBCASE("stealer sees pushes made after it was created, and later steals continue in order") {
    Q::Stealer early = src.stealer();
    for (uint32_t i = 0; i < 12; ++i) src.push_back_or_overflow(&items[i], ovf);
    CHECK(early.steal_into(dst) == &items[5]);  // 6 of 12
    CHECK(drain_ids(dst) == iota_ids(0, 5));
    CHECK(early.steal_into(dst) == &items[8]);  // 3 of 6
    CHECK(drain_ids(dst) == iota_ids(6, 8));
    CHECK(src.pop() == &items[9]);
    CHECK(early.steal_into(dst) == &items[10]);  // 1 of 2
    CHECK(dst.len() == 0u);
    CHECK(early.steal_into(dst) == &items[11]);  // 1 of 1
    CHECK(early.steal_into(dst) == nullptr);
    CHECK(early.is_empty());
  }
  CHECK(ovf.batches.empty());
}

TEST_CASE("local_queue: steal_into exhaustive over source and destination occupancy") {
  constexpr uint32_t kCap = 16;
  using Q = LocalQueue<Item, kCap>;
  Failures f;
  for (uint32_t src_off : {0u, 5u, 13u}) {
    for (uint32_t dst_off : {0u, 9u, 15u}) {
      for (uint32_t k = 0; k <= kCap; ++k) {
        for (uint32_t d = 0; d <= kCap; ++d) {
          const std::string ctx = "src_off=" + std::to_string(src_off) +
                                  " dst_off=" + std::to_string(dst_off) + " k=" + std::to_string(k) +
                                  " d=" + std::to_string(d);
          Q src;
          Q dst;
          RecordingOverflow ovf;
          Item scratch;
          advance(src, src_off, scratch);
          advance(dst, dst_off, scratch);
          auto items = make_items(k + d);  // src holds ids [0, k), dst holds [k, k + d)
          for (uint32_t i = 0; i < k; ++i) src.push_back_or_overflow(&items[i], ovf);
          for (uint32_t i = 0; i < d; ++i) dst.push_back_or_overflow(&items[k + i], ovf);
          const auto s = src.stealer();
          LQ_EXPECT(f, s.len() == k, ctx);
          LQ_EXPECT(f, s.is_empty() == (k == 0), ctx);

          Item* got = s.steal_into(dst);
          std::vector<uint32_t> want_dst = iota_ids(k, k + d);
          std::vector<uint32_t> want_src = iota_ids(0, k);
          Item* want_got = nullptr;
          if (d <= kCap / 2 && k > 0) {
            const uint32_t n = k - k / 2;  // ceil(k / 2)
            want_got = &items[n - 1];
            for (uint32_t i = 0; i + 1 < n; ++i) want_dst.push_back(i);
            want_src = iota_ids(n, k);
          }
          LQ_EXPECT(f, got == want_got, ctx + " got " + id_of(got) + " want " + id_of(want_got));
          LQ_EXPECT(f, src.len() == want_src.size(), ctx);
          LQ_EXPECT(f, s.len() == want_src.size(), ctx);
          LQ_EXPECT(f, src.remaining_slots() == kCap - want_src.size(), ctx);
          LQ_EXPECT(f, dst.len() == want_dst.size(), ctx);
          LQ_EXPECT(f, dst.remaining_slots() == kCap - want_dst.size(), ctx);
          LQ_EXPECT(f, drain_ids(dst) == want_dst, ctx);
          LQ_EXPECT(f, drain_ids(src) == want_src, ctx);
          LQ_EXPECT(f, ovf.batches.empty(), ctx);
        }
      }
    }
  }
  LQ_CHECK_NO_FAILURES(f);
}

// ------------------------------------------------------------------------------------------------
// 5. Stress: owner vs three thieves, capacity 256
// ------------------------------------------------------------------------------------------------

namespace {

// Overflow sink for the stress test: a mutex-protected vector. Checks each batch's items and size.
template <uint32_t Cap>
struct MutexOverflow {
  std::mutex mu;
  std::vector<Item*> items;
  std::atomic<uint64_t> single_batches{0};
  std::atomic<uint64_t> half_batches{0};
  Failures* failures = nullptr;

  void push_batch(Item* const* batch, size_t n) noexcept {
    std::vector<uint32_t> ids;
    ids.reserve(n);
    LQ_EXPECT(*failures, read_batch(batch, n, ids), "overflow batch items, n=" + std::to_string(n));
    LQ_EXPECT(*failures, n == 1 || n == Cap / 2 + 1, "overflow batch size " + std::to_string(n));
    if (n == 1) single_batches.fetch_add(1, std::memory_order_relaxed);
    if (n == Cap / 2 + 1) half_batches.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    // Only the entries read_batch accepted (all of them unless it failed), in array order.
    items.insert(items.end(), batch, batch + ids.size());
  }

  std::vector<Item*> take() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<Item*> out;
    out.swap(items);
    return out;
  }
};

}  // namespace

TEST_CASE("local_queue: stress, owner push/pop vs 3 thieves, every item exactly once") {
  constexpr uint32_t kCap = 256;
  constexpr int kThieves = 3;
  using Q = LocalQueue<Item, kCap>;
  const uint32_t kItems = kSanitized ? 1'500'000 : 5'000'000;

  auto items = make_items(kItems);
  std::vector<std::atomic<uint8_t>> seen(kItems);
  for (auto& s : seen) s.store(0, std::memory_order_relaxed);
  std::atomic<uint64_t> consumed{0};
  Failures f;
  MutexOverflow<kCap> ovf;
  ovf.failures = &f;

  Q owner;
  std::array<Q, kThieves> mine;
  const Q::Stealer owner_stealer = owner.stealer();
  std::array<Q::Stealer, kThieves> thief_stealers;
  for (int i = 0; i < kThieves; ++i) thief_stealers[i] = mine[i].stealer();

  std::array<std::atomic<uint64_t>, kThieves + 1> per_thread{};
  std::atomic<uint64_t> steals{0};
  // Set when the run stops making progress (a lost item): everyone gives up instead of hanging.
  std::atomic<bool> give_up{false};

  auto consume = [&](Item* t, int who) {
    if (t < items.data() || t >= items.data() + kItems) {
      f.add("consumed a pointer that is not an item");
      return;
    }
    const uint8_t before = seen[t->id].fetch_add(1, std::memory_order_relaxed);
    LQ_EXPECT(f, before == 0, "item " + std::to_string(t->id) + " seen twice");
    per_thread[who].fetch_add(1, std::memory_order_relaxed);
    consumed.fetch_add(1, std::memory_order_relaxed);
  };

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> thieves;
  for (int ti = 0; ti < kThieves; ++ti) {
    thieves.emplace_back([&, ti] {
      std::mt19937 rng(1000 + ti);
      Q& q = mine[ti];
      while (consumed.load(std::memory_order_relaxed) < kItems && !give_up.load(std::memory_order_relaxed)) {
        bool did = false;
        const uint32_t run = 1 + rng() % 16;
        for (uint32_t i = 0; i < run; ++i) {
          Item* t = q.pop();
          if (t == nullptr) break;
          consume(t, ti + 1);
          did = true;
        }
        LQ_EXPECT(f, q.len() <= kCap, "thief len " + std::to_string(q.len()));
        LQ_EXPECT(f, q.remaining_slots() <= kCap, "thief remaining " + std::to_string(q.remaining_slots()));
        if (!q.has_tasks() || rng() % 4 == 0) {
          // Mostly steal from the owner; sometimes from another thief (whose queue may be
          // being stolen from, and popped, at the same time).
          const Q::Stealer& victim =
              rng() % 8 == 0 ? thief_stealers[(ti + 1 + rng() % (kThieves - 1)) % kThieves] : owner_stealer;
          if (Item* t = victim.steal_into(q)) {
            steals.fetch_add(1, std::memory_order_relaxed);
            consume(t, ti + 1);
            did = true;
          }
        }
        if (!did) std::this_thread::yield();
      }
    });
  }

  // Owner: bursts of pushes (some longer than the ring), interleaved with pops; from time to time
  // it takes back what overflowed and pushes it again as a batch when it fits.
  std::mt19937 rng(42);
  uint32_t max_len = 0;
  std::deque<Item*> pending;  // overflowed items taken back, not yet re-queued
  size_t max_pending = 0;
  auto requeue = [&](bool consume_rest) {
    std::vector<Item*> got = ovf.take();
    pending.insert(pending.end(), got.begin(), got.end());
    max_pending = std::max(max_pending, pending.size());
    const uint32_t room = owner.remaining_slots();
    LQ_EXPECT(f, room <= kCap, "owner remaining " + std::to_string(room));
    // Sometimes fill every slot remaining_slots() reports: if it over-reported (counting slots a
    // thief is still copying out), the batch would overwrite them and items would be lost/doubled.
    const uint32_t n = static_cast<uint32_t>(std::min<size_t>(pending.size(), rng() % 2 ? room : room / 2));
    if (n != 0) {
      const std::vector<Item*> batch(pending.begin(), pending.begin() + n);
      owner.push_back_batch(batch.data(), n);
      pending.erase(pending.begin(), pending.begin() + n);
    }
    if (consume_rest && !owner.has_tasks()) {
      for (Item* t : pending) consume(t, 0);
      pending.clear();
    }
  };
  // Watchdog, polled by the owner while it waits: a queue that loses items (or never frees slots)
  // fails the test after 20 s without progress instead of hanging it.
  auto last_progress = std::chrono::steady_clock::now();
  uint64_t last_consumed = 0;
  auto stalled = [&] {
    const uint64_t now_consumed = consumed.load(std::memory_order_relaxed);
    if (now_consumed != last_consumed) {
      last_consumed = now_consumed;
      last_progress = std::chrono::steady_clock::now();
    } else if (!give_up.load() && seconds_since(last_progress) > 20.0) {
      f.add("no progress for 20 s: consumed " + std::to_string(now_consumed) + " of " +
            std::to_string(kItems));
      give_up.store(true);
    }
    return give_up.load();
  };
  uint32_t next = 0;
  while (next < kItems) {
    if (pending.size() > 4 * kCap) {
      if (stalled()) break;
      // The thieves are behind (e.g. descheduled on a busy machine): don't race ahead of them
      // into an ever-growing overflow backlog; requeue, run a little, and let them catch up.
      requeue(false);
      for (int i = 0; i < 8; ++i) {
        Item* t = owner.pop();
        if (t == nullptr) break;
        consume(t, 0);
      }
      std::this_thread::yield();
      continue;
    }
    const uint32_t burst = rng() % 16 == 0 ? 200 + rng() % 200 : 1 + rng() % 48;
    for (uint32_t i = 0; i < burst && next < kItems; ++i) owner.push_back_or_overflow(&items[next++], ovf);
    const uint32_t len = owner.len();
    max_len = std::max(max_len, len);
    LQ_EXPECT(f, len <= kCap, "owner len " + std::to_string(len));
    const uint32_t pops = rng() % (burst / 2 + 2);
    for (uint32_t i = 0; i < pops; ++i) {
      Item* t = owner.pop();
      if (t == nullptr) break;
      consume(t, 0);
    }
    if (rng() % 8 == 0) requeue(false);
  }
  while (consumed.load(std::memory_order_relaxed) < kItems && !stalled()) {
    bool did = false;
    while (Item* t = owner.pop()) {
      consume(t, 0);
      did = true;
    }
    requeue(true);
    if (!did) std::this_thread::yield();
  }
  for (auto& t : thieves) t.join();
  const double secs = seconds_since(t0);

  uint64_t bad = 0;
  uint64_t total = 0;
  uint32_t first_bad = ~0u;
  for (uint32_t i = 0; i < kItems; ++i) {
    const uint8_t c = seen[i].load(std::memory_order_relaxed);
    total += c;
    if (c != 1) {
      if (bad == 0) first_bad = i;
      ++bad;
    }
  }
  MESSAGE("stress: " << kItems << " items in " << secs << " s; owner consumed " << per_thread[0].load()
                     << ", thieves " << per_thread[1].load() << "/" << per_thread[2].load() << "/"
                     << per_thread[3].load() << "; successful steals " << steals.load()
                     << "; overflow batches " << ovf.half_batches.load() << " (half) + "
                     << ovf.single_batches.load() << " (single); max owner len " << max_len << "; max overflow backlog " << max_pending);
  CHECK_MESSAGE(bad == 0, "items not seen exactly once: " << bad << ", first " << first_bad);
  CHECK(total == kItems);
  CHECK(consumed.load() == kItems);
  CHECK(pending.empty());
  CHECK(ovf.take().empty());
  CHECK(owner.pop() == nullptr);
  for (auto& q : mine) CHECK(q.pop() == nullptr);
  // Quiescent: no thief reservation left behind (steal caught up with real everywhere).
  CHECK(owner.remaining_slots() == kCap);
  for (auto& q : mine) CHECK(q.remaining_slots() == kCap);
  LQ_CHECK_NO_FAILURES(f);
}

// ------------------------------------------------------------------------------------------------
// 6a. Capacity 4, randomised schedules on real threads
// ------------------------------------------------------------------------------------------------

namespace {

// Owner-only overflow sink (only the owner ever pushes): records ids and checks batches.
struct RoundOverflow {
  std::vector<uint32_t> ids;
  Failures* failures = nullptr;
  uint32_t cap = 0;
  uint64_t single_batches = 0;
  uint64_t half_batches = 0;
  void push_batch(Item* const* items, size_t n) noexcept {
    const size_t before = ids.size();
    if (n == 1) ++single_batches;
    if (n == cap / 2 + 1) ++half_batches;
    LQ_EXPECT(*failures, read_batch(items, n, ids), "overflow items n=" + std::to_string(n));
    LQ_EXPECT(*failures, n == 1 || n == cap / 2 + 1, "overflow batch size " + std::to_string(n));
    LQ_EXPECT(*failures, ids.size() - before == n, "overflow batch walk");
  }
};

}  // namespace

TEST_CASE("local_queue: capacity 4, randomised owner + 2 thieves rounds") {
  constexpr uint32_t kCap = 4;
  constexpr uint32_t kMaxPush = 12;
  using Q = LocalQueue<Item, kCap>;
  const int kRounds = kSanitized ? 20'000 : 50'000;

  std::vector<Item> items = make_items(kMaxPush);
  std::array<std::atomic<uint8_t>, kMaxPush> seen{};
  Failures f;
  RoundOverflow ovf;
  ovf.failures = &f;
  ovf.cap = kCap;
  Q owner;
  std::array<Q, 2> mine;
  const Q::Stealer owner_stealer = owner.stealer();
  const std::array<Q::Stealer, 2> thief_stealers{mine[0].stealer(), mine[1].stealer()};
  SpinBarrier barrier(3);
  std::atomic<uint64_t> steals{0};
  // Upper bound of the random pauses between steps, chosen by the owner per round (written before
  // the round's start barrier, read after it). Short pauses make the three threads' steps
  // collide more often; longer ones give other orders.
  uint32_t round_delay = 1;

  auto consume = [&](Item* t, const char* who, int round) {
    if (t < items.data() || t >= items.data() + kMaxPush) {
      f.add(std::string(who) + ": not an item, round " + std::to_string(round));
      return;
    }
    seen[t->id].fetch_add(1, std::memory_order_relaxed);
  };

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> thieves;
  for (int ti = 0; ti < 2; ++ti) {
    thieves.emplace_back([&, ti] {
      std::mt19937 rng(77 + ti);
      Q& q = mine[ti];
      for (int round = 0; round < kRounds; ++round) {
        barrier.wait();  // round start
        const uint32_t delay = round_delay;
        spin(rng() % (4 * delay));
        const uint32_t ops = 1 + rng() % 6;
        for (uint32_t op = 0; op < ops; ++op) {
          const uint32_t r = rng() % 10;
          if (r < 7) {
            const Q::Stealer& victim = r < 6 ? owner_stealer : thief_stealers[1 - ti];
            if (Item* t = victim.steal_into(q)) {
              steals.fetch_add(1, std::memory_order_relaxed);
              consume(t, "thief steal", round);
            }
          } else if (Item* t = q.pop()) {
            consume(t, "thief pop", round);
          }
          LQ_EXPECT(f, q.len() <= kCap, "thief len, round " + std::to_string(round));
          LQ_EXPECT(f, q.remaining_slots() <= kCap, "thief remaining, round " + std::to_string(round));
          if (rng() % 8 == 0) {
            std::this_thread::yield();
          } else {
            spin(rng() % delay);
          }
        }
        barrier.wait();  // scripts done: nobody steals any more this round
        while (Item* t = q.pop()) consume(t, "thief drain", round);
        // Every steal of this round has ended: its reservation must be gone.
        LQ_EXPECT(f, q.remaining_slots() == kCap,
                  "thief queue not quiescent, round " + std::to_string(round));
        barrier.wait();  // drained; the owner checks
      }
    });
  }

  std::mt19937 rng(5);
  for (int round = 0; round < kRounds; ++round) {
    for (auto& s : seen) s.store(0, std::memory_order_relaxed);
    ovf.ids.clear();
    uint32_t pushed = 0;
    round_delay = 1u << (1 + rng() % 7);  // 2 .. 128
    barrier.wait();  // round start
    const uint32_t ops = 4 + rng() % 12;
    for (uint32_t op = 0; op < ops; ++op) {
      const uint32_t r = rng() % 100;
      if (pushed < kMaxPush && r < 60) {
        owner.push_back_or_overflow(&items[pushed++], ovf);
      } else if (pushed < kMaxPush && r < 70) {
        // A batch of up to remaining_slots() items; if that over-reported the free room while
        // a thief copies out, the batch would overwrite the slots being stolen.
        const uint32_t room = owner.remaining_slots();
        const uint32_t k = std::min({1 + static_cast<uint32_t>(rng() % kCap), room, kMaxPush - pushed});
        if (k != 0) {
          std::array<Item*, kCap> batch{};
          for (uint32_t i = 0; i < k; ++i) batch[i] = &items[pushed + i];
          owner.push_back_batch(batch.data(), k);
          pushed += k;
        }
      } else if (Item* t = owner.pop()) {
        consume(t, "owner pop", round);
      }
      const uint32_t len = owner.len();
      const uint32_t room = owner.remaining_slots();
      LQ_EXPECT(f, len <= kCap, "owner len " + std::to_string(len) + ", round " + std::to_string(round));
      LQ_EXPECT(f, room <= kCap,
                "owner remaining " + std::to_string(room) + ", round " + std::to_string(round));
      if (rng() % 8 == 0) {
        std::this_thread::yield();
      } else {
        spin(rng() % round_delay);
      }
    }
    barrier.wait();  // scripts done
    while (Item* t = owner.pop()) consume(t, "owner drain", round);
    LQ_EXPECT(f, owner.remaining_slots() == kCap,
              "owner queue not quiescent, round " + std::to_string(round));
    barrier.wait();  // everyone drained
    // Exactly once: consumed (pop, steal, drain) or overflowed, and never anything not pushed.
    std::array<uint32_t, kMaxPush> count{};
    for (uint32_t id : ovf.ids) {
      if (id < kMaxPush) ++count[id];
    }
    for (uint32_t id = 0; id < kMaxPush; ++id) {
      const uint32_t c = count[id] + seen[id].load(std::memory_order_relaxed);
      LQ_EXPECT(f, c == (id < pushed ? 1u : 0u),
                "round " + std::to_string(round) + " item " + std::to_string(id) + " seen " +
                    std::to_string(c) + " times (pushed " + std::to_string(pushed) + ")");
    }
  }
  for (auto& t : thieves) t.join();
  MESSAGE("capacity-4 rounds: " << kRounds << " in " << seconds_since(t0) << " s; successful steals "
                                << steals.load() << "; overflow batches " << ovf.half_batches << " (half) + "
                                << ovf.single_batches << " (single, thief at work)");
  LQ_CHECK_NO_FAILURES(f);
}

// ------------------------------------------------------------------------------------------------
// 6b. Capacity 4, exhaustive single-threaded enumeration against a model
// ------------------------------------------------------------------------------------------------

TEST_CASE("local_queue: capacity 4, exhaustive op sequences vs deque model") {
  // Ops: owner push, owner pop, thief steals from the owner into its own queue, thief pops its
  // own queue. Every sequence of length 0..kDepth, from several starting ring offsets. After each
  // step the observable state (returns, lengths, overflow) must match the model, and at the end
  // both queues drain in the model's order.
  constexpr uint32_t kCap = 4;
  constexpr int kDepth = 8;
  constexpr int kOps = 4;
  using Q = LocalQueue<Item, kCap>;
  enum Op { kPush, kPop, kSteal, kThiefPop };
  const std::vector<std::pair<uint32_t, uint32_t>> offsets =
      kSanitized ? std::vector<std::pair<uint32_t, uint32_t>>{{0, 0}, {1, 3}, {2, 1}, {3, 2}}
                 : std::vector<std::pair<uint32_t, uint32_t>>{{0, 0}, {1, 0}, {2, 0}, {3, 0},
                                                              {0, 3}, {1, 2}, {2, 1}, {3, 3}};
  Failures f;
  uint64_t sequences = 0;
  uint64_t steps = 0;
  auto items = make_items(kDepth);
  for (const auto& [own_off, thief_off] : offsets) {
    for (int depth = 0; depth <= kDepth; ++depth) {
      uint64_t combos = 1;
      for (int i = 0; i < depth; ++i) combos *= kOps;
      for (uint64_t code = 0; code < combos; ++code) {
        ++sequences;
        Q owner;
        Q thief;
        RecordingOverflow ovf;
        Item scratch;
        advance(owner, own_off, scratch);
        advance(thief, thief_off, scratch);
        std::deque<uint32_t> m_owner;
        std::deque<uint32_t> m_thief;
        std::vector<uint32_t> m_ovf;
        std::string trace = "off=" + std::to_string(own_off) + "/" + std::to_string(thief_off) + " ops:";
        uint32_t next = 0;
        uint64_t c = code;
        for (int step = 0; step < depth; ++step, c /= kOps) {
          ++steps;
          const Op op = static_cast<Op>(c % kOps);
          trace += " ";
          trace += "UPST"[op];  // pUsh, Pop, Steal, Thief pop
          switch (op) {
            case kPush: {
              if (m_owner.size() == kCap) {
                for (uint32_t i = 0; i < kCap / 2; ++i) {
                  m_ovf.push_back(m_owner.front());
                  m_owner.pop_front();
                }
                m_ovf.push_back(next);
              } else {
                m_owner.push_back(next);
              }
              owner.push_back_or_overflow(&items[next++], ovf);
              break;
            }
            case kPop: {
              Item* t = owner.pop();
              Item* want = m_owner.empty() ? nullptr : &items[m_owner.front()];
              if (!m_owner.empty()) m_owner.pop_front();
              LQ_EXPECT(f, t == want, trace + " got " + id_of(t) + " want " + id_of(want));
              break;
            }
            case kSteal: {
              Item* t = owner.stealer().steal_into(thief);
              Item* want = nullptr;
              if (m_thief.size() <= kCap / 2 && !m_owner.empty()) {
                const size_t n = m_owner.size() - m_owner.size() / 2;
                for (size_t i = 0; i + 1 < n; ++i) {
                  m_thief.push_back(m_owner.front());
                  m_owner.pop_front();
                }
                want = &items[m_owner.front()];
                m_owner.pop_front();
              }
              LQ_EXPECT(f, t == want, trace + " got " + id_of(t) + " want " + id_of(want));
              break;
            }
            case kThiefPop: {
              Item* t = thief.pop();
              Item* want = m_thief.empty() ? nullptr : &items[m_thief.front()];
              if (!m_thief.empty()) m_thief.pop_front();
              LQ_EXPECT(f, t == want, trace + " got " + id_of(t) + " want " + id_of(want));
              break;
            }
          }
          LQ_EXPECT(f, owner.len() == m_owner.size(), trace);
          LQ_EXPECT(f, owner.has_tasks() == !m_owner.empty(), trace);
          LQ_EXPECT(f, owner.remaining_slots() == kCap - m_owner.size(), trace);
          LQ_EXPECT(f, owner.stealer().len() == m_owner.size(), trace);
          LQ_EXPECT(f, owner.stealer().is_empty() == m_owner.empty(), trace);
          LQ_EXPECT(f, thief.len() == m_thief.size(), trace);
          LQ_EXPECT(f, thief.remaining_slots() == kCap - m_thief.size(), trace);
          LQ_EXPECT(f, ovf.all == m_ovf, trace);
        }
        LQ_EXPECT(f, ovf.batch_errors == 0, trace);
        for (const auto& b : ovf.batches) LQ_EXPECT(f, b.size() == kCap / 2 + 1, trace);
        LQ_EXPECT(f, drain_ids(owner) == std::vector<uint32_t>(m_owner.begin(), m_owner.end()),
                  trace + " (drain)");
        LQ_EXPECT(f, drain_ids(thief) == std::vector<uint32_t>(m_thief.begin(), m_thief.end()),
                  trace + " (thief drain)");
        if (f.count() > 50) break;
      }
    }
  }
  MESSAGE("exhaustive: " << sequences << " sequences, " << steps << " steps");
  LQ_CHECK_NO_FAILURES(f);
}

// ------------------------------------------------------------------------------ injector

namespace {
// Refuses the injector's segments for a scope, as if memory had run out.
struct RefuseSegments {
  explicit RefuseSegments(int n) { fiber::detail::Injector::refuse_segments.store(n); }
  ~RefuseSegments() { fiber::detail::Injector::refuse_segments.store(0); }
};
}  // namespace

// The overflow of every local queue, and every wake from outside, lands in the injector, whose
// pushes cannot fail. A segment it could not allocate once ended the process (std::bad_alloc in
// a noexcept push); now those fibers wait on a list through the fibers themselves.
TEST_CASE("injector: FIFO across its segments and the spill list used when no segment can be had") {
  using fiber::detail::Fiber;
  using fiber::detail::Injector;
  constexpr std::size_t kBatch = 2 * Injector::kSegmentEntries + 100;  // more than two segments
  std::vector<Fiber> fibers(6 * kBatch);
  std::vector<Fiber*> order;
  for (Fiber& f : fibers) order.push_back(&f);
  auto batch = [&](std::size_t k) { return order.data() + k * kBatch; };
  Injector inj;
  std::vector<Fiber*> got;
  auto pop_all = [&](std::size_t step) {
    std::vector<Fiber*> out(step);
    while (std::size_t n = inj.pop_batch(out.data(), step)) got.insert(got.end(), out.begin(), out.begin() + n);
  };

  inj.push_batch(batch(0), kBatch);  // segments
  {
    RefuseSegments refuse(1);  // the next segment is refused part-way through this batch
    inj.push_batch(batch(1), kBatch);
    CHECK(Injector::refuse_segments.load() == 0);  // asked for, refused: the rest spilled
  }
  inj.push_batch(batch(2), kBatch);  // segments could be had, but the spill list is not empty
  for (std::size_t i = 0; i < kBatch; ++i) inj.push(batch(3)[i]);
  CHECK(inj.len() == 4 * kBatch);
  pop_all(37);
  CHECK(inj.empty());
  CHECK(got == std::vector<Fiber*>(order.begin(), order.begin() + 4 * kBatch));
  for (Fiber* f : got) CHECK_MESSAGE(f->next == nullptr, "a popped fiber still links into the spill list");

  // Drained: segments again, and mixing pops with pushes keeps the order.
  got.clear();
  {
    RefuseSegments refuse(1'000'000);
    inj.push_batch(batch(4), kBatch);  // the spare segment holds the first kSegmentEntries, the rest spill
    CHECK(Injector::refuse_segments.load() == 1'000'000 - 1);  // one refusal, then the list
    CHECK(inj.pop() == batch(4)[0]);
  }
  inj.push_batch(batch(5), kBatch);
  got.push_back(batch(4)[0]);
  pop_all(1000);
  CHECK(got == std::vector<Fiber*>(order.begin() + 4 * kBatch, order.end()));
  CHECK(inj.pop() == nullptr);
}
