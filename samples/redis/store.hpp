// The key space of redis_server: string keys to string values with optional expiry, split over
// 64 shards by key hash so that connections on different processors rarely meet on a lock.
//
// Locking: each shard is guarded by a std::mutex, not a fiber::Mutex. Every critical section
// here is a hash-map operation with no I/O and nothing else that could park the fiber, so a
// holder keeps running until it unlocks - a waiter never waits longer than that. Parking a
// fiber (a context switch, a wake-up through the run queues) would cost more than the wait
// itself, and the uncontended std::mutex is a single atomic exchange. Because nothing parks in
// between, lock and unlock also run on the same thread, as std::mutex requires.
// Commands on several keys (MGET, MSET, FLUSHALL) lock the shards they touch in ascending
// order, so they are atomic, as in Redis, and cannot deadlock with each other.
//
// Time: expiry instants are milliseconds on the steady clock (now_ms()); a key whose instant has
// passed no longer exists. Expired keys are removed lazily by whatever touches them, and by
// sweep(), which a background fiber calls periodically (Redis's "active expire" cycle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>

namespace redis {

// Milliseconds on the steady clock.
int64_t now_ms() noexcept;

class Store {
 public:
  static constexpr std::size_t kShards = 64;  // a power of two; one bit each in a 64-bit mask
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

  enum class Condition { kAlways, kIfMissing, kIfExists };  // SET's NX / XX
  struct SetOptions {
    Condition condition = Condition::kAlways;
    bool keep_ttl = false;     // KEEPTTL: an existing key keeps its expiry
    int64_t expires_at = kNever;
  };
  struct SetOutcome {
    bool written = false;
    bool existed = false;  // the key existed before (its value is in *old when asked for)
  };
  // SET. With `old` non-null the previous value (if any) is copied there (SET ... GET).
  SetOutcome set(std::string_view key, std::string_view value, int64_t now, const SetOptions& options,
                 std::string* old = nullptr);

  // GET: calls f(const std::string& value) under the shard lock if the key exists; keep f short
  // (copy the value out, append it to a reply). Returns whether it existed.
  template <typename F>
  bool read(std::string_view key, int64_t now, F&& f) {
    Shard& s = shard_of(key);
    const std::lock_guard<std::mutex> lock(s.mu);
    const auto it = find_live(s, key, now);
    if (it == s.map.end()) return false;
    f(it->second.data);
    return true;
  }

  bool erase(std::string_view key, int64_t now);     // DEL: whether it existed
  bool contains(std::string_view key, int64_t now);  // EXISTS

  enum class IncrResult { kOk, kNotInteger, kOverflow };
  // INCRBY: a missing key counts as 0; the expiry stays. *result is the new value on kOk.
  IncrResult incr(std::string_view key, int64_t delta, int64_t now, int64_t* result);

  // EXPIRE's NX / XX / GT / LT: only without a TTL, only with one, only to a later instant,
  // only to an earlier one (no TTL counts as infinitely late). Several may be combined.
  struct ExpireIf {
    bool no_ttl = false, has_ttl = false, later = false, earlier = false;
  };
  // Sets the key's expiry to `at`; an instant not after `now` deletes the key. Whether the key
  // existed and the conditions held (EXPIRE's 1 / 0).
  bool expire(std::string_view key, int64_t at, ExpireIf conditions, int64_t now);
  // Milliseconds the key has left; -1 when it has no expiry, -2 when it does not exist.
  int64_t ttl_ms(std::string_view key, int64_t now);

  // MGET: f(const std::string* value_or_null) for each key in order, atomically.
  template <typename F>
  void read_many(std::span<const std::string_view> keys, int64_t now, F&& f) {
    const ShardLocks locks(*this, mask_of(keys, 1));
    for (const auto key : keys) {
      Shard& s = shard_of(key);
      const auto it = find_live(s, key, now);
      f(it == s.map.end() ? nullptr : &it->second.data);
    }
  }
  // MSET: key, value, key, value, ... (even count), atomically; clears their expiry.
  void set_many(std::span<const std::string_view> pairs, int64_t now);

  std::size_t size();  // DBSIZE: keys, counting expired ones not removed yet (as Redis does)
  void clear();        // FLUSHALL

  // One active-expiry pass: in each shard holding keys with a TTL, samples them (walking the
  // hash buckets from where the last pass stopped) and removes the expired ones, repeating while
  // more than a quarter of a sample had expired, within a bounded amount of work per shard.
  // Returns how many keys it removed.
  std::size_t sweep(int64_t now);

 private:
  struct Entry {
    std::string data;
    int64_t expires_at = kNever;
  };
  // Hash and equality that accept std::string_view, so lookups need no std::string.
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using Map = std::unordered_map<std::string, Entry, Hash, std::equal_to<>>;
  struct alignas(64) Shard {  // one cache line each for the hot lock words
    std::mutex mu;
    Map map;                     // GUARDED_BY(mu)
    std::size_t with_ttl = 0;    // GUARDED_BY(mu): entries whose expires_at != kNever
    std::size_t cursor = 0;      // GUARDED_BY(mu): the bucket sweep() looks at next
  };

  // Locks the shards in a mask in ascending order; unlocks in its destructor.
  class ShardLocks {
   public:
    ShardLocks(Store& store, uint64_t mask);
    ~ShardLocks();
    ShardLocks(const ShardLocks&) = delete;
    ShardLocks& operator=(const ShardLocks&) = delete;

   private:
    Store& store_;
    uint64_t mask_;
  };

  static std::size_t index_of(std::string_view key) noexcept {
    // The top bits: the map inside the shard picks its bucket from the hash modulo a prime, so
    // the two choices stay independent.
    return static_cast<std::size_t>(Hash{}(key) >> 58) & (kShards - 1);
  }
  Shard& shard_of(std::string_view key) noexcept { return shards_[index_of(key)]; }
  static uint64_t mask_of(std::span<const std::string_view> keys, std::size_t stride) noexcept;
  // The entry of a key that has not expired; an expired one is erased on the way (lazy expiry).
  Map::iterator find_live(Shard& s, std::string_view key, int64_t now);
  static void set_expiry(Shard& s, Entry& e, int64_t at) noexcept;
  static void erase_entry(Shard& s, Map::iterator it);
  std::size_t sweep_shard(Shard& s, int64_t now);

  Shard shards_[kShards];
};

}  // namespace redis
