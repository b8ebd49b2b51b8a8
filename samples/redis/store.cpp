// The sharded key space of redis_server; see store.hpp.
#include "store.hpp"

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>

#include "resp.hpp"

namespace redis {

int64_t now_ms() noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Store::ShardLocks::ShardLocks(Store& store, uint64_t mask) : store_(store), mask_(mask) {
  for (uint64_t m = mask_; m != 0; m &= m - 1) store_.shards_[std::countr_zero(m)].mu.lock();
}

Store::ShardLocks::~ShardLocks() {
  for (uint64_t m = mask_; m != 0; m &= m - 1) store_.shards_[std::countr_zero(m)].mu.unlock();
}

uint64_t Store::mask_of(std::span<const std::string_view> keys, std::size_t stride) noexcept {
  uint64_t mask = 0;
  for (std::size_t i = 0; i < keys.size(); i += stride) mask |= uint64_t{1} << index_of(keys[i]);
  return mask;
}

Store::Map::iterator Store::find_live(Shard& s, std::string_view key, int64_t now) {
  auto it = s.map.find(key);
  if (it != s.map.end() && it->second.expires_at <= now) {
    erase_entry(s, it);
    return s.map.end();
  }
  return it;
}

void Store::set_expiry(Shard& s, Entry& e, int64_t at) noexcept {
  s.with_ttl += static_cast<std::size_t>(at != kNever) - static_cast<std::size_t>(e.expires_at != kNever);
  e.expires_at = at;
}

void Store::erase_entry(Shard& s, Map::iterator it) {
  if (it->second.expires_at != kNever) --s.with_ttl;
  s.map.erase(it);
}

Store::SetOutcome Store::set(std::string_view key, std::string_view value, int64_t now, const SetOptions& options,
                             std::string* old) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  auto it = find_live(s, key, now);
  SetOutcome outcome;
  outcome.existed = it != s.map.end();
  if (outcome.existed && old != nullptr) *old = it->second.data;
  if ((options.condition == Condition::kIfMissing && outcome.existed) ||
      (options.condition == Condition::kIfExists && !outcome.existed)) {
    return outcome;
  }
  if (!outcome.existed) it = s.map.try_emplace(std::string(key)).first;
  it->second.data.assign(value);  // reuses the old value's capacity
  if (!options.keep_ttl || !outcome.existed) set_expiry(s, it->second, options.expires_at);
  outcome.written = true;
  return outcome;
}

bool Store::erase(std::string_view key, int64_t now) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  const auto it = find_live(s, key, now);
  if (it == s.map.end()) return false;
  erase_entry(s, it);
  return true;
}

bool Store::contains(std::string_view key, int64_t now) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  return find_live(s, key, now) != s.map.end();
}

Store::IncrResult Store::incr(std::string_view key, int64_t delta, int64_t now, int64_t* result) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  auto it = find_live(s, key, now);
  int64_t current = 0;
  if (it != s.map.end() && !resp::parse_int64(it->second.data, current)) return IncrResult::kNotInteger;
  int64_t next = 0;
  if (__builtin_add_overflow(current, delta, &next)) return IncrResult::kOverflow;
  if (it == s.map.end()) it = s.map.try_emplace(std::string(key)).first;
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, next);
  it->second.data.assign(buf, end);
  *result = next;
  return IncrResult::kOk;
}

bool Store::expire(std::string_view key, int64_t at, ExpireIf conditions, int64_t now) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  const auto it = find_live(s, key, now);
  if (it == s.map.end()) return false;
  const int64_t current = it->second.expires_at;  // kNever: no TTL, "infinitely late"
  if ((conditions.no_ttl && current != kNever) || (conditions.has_ttl && current == kNever) ||
      (conditions.later && (current == kNever || at <= current)) || (conditions.earlier && at >= current)) {
    return false;
  }
  if (at <= now) {
    erase_entry(s, it);
  } else {
    set_expiry(s, it->second, at);
  }
  return true;
}

int64_t Store::ttl_ms(std::string_view key, int64_t now) {
  Shard& s = shard_of(key);
  const std::lock_guard<std::mutex> lock(s.mu);
  const auto it = find_live(s, key, now);
  if (it == s.map.end()) return -2;
  return it->second.expires_at == kNever ? -1 : it->second.expires_at - now;
}

void Store::set_many(std::span<const std::string_view> pairs, int64_t now) {
  const ShardLocks locks(*this, mask_of(pairs, 2));
  for (std::size_t i = 0; i + 1 < pairs.size(); i += 2) {
    Shard& s = shard_of(pairs[i]);
    auto it = find_live(s, pairs[i], now);
    if (it == s.map.end()) it = s.map.try_emplace(std::string(pairs[i])).first;
    it->second.data.assign(pairs[i + 1]);
    set_expiry(s, it->second, kNever);
  }
}

std::size_t Store::size() {
  std::size_t n = 0;
  for (auto& s : shards_) {
    const std::lock_guard<std::mutex> lock(s.mu);
    n += s.map.size();
  }
  return n;
}

void Store::clear() {
  const ShardLocks locks(*this, ~uint64_t{0});
  for (auto& s : shards_) {
    s.map.clear();
    s.with_ttl = 0;
    s.cursor = 0;
  }
}

std::size_t Store::sweep(int64_t now) {
  std::size_t removed = 0;
  for (auto& s : shards_) removed += sweep_shard(s, now);
  return removed;
}

std::size_t Store::sweep_shard(Shard& s, int64_t now) {
  // Per round: look at up to kSample keys with a TTL, visiting at most kBuckets buckets (keys
  // without a TTL make the walk longer, not the sample bigger). Another round follows while more
  // than a quarter of the sample had expired, as Redis does: many stale keys get cleared soon,
  // few cost one short look. The lock is taken per round, so connections interleave with it.
  constexpr std::size_t kSample = 20, kBuckets = 400, kRounds = 16;
  std::size_t removed = 0;
  for (std::size_t round = 0; round < kRounds; ++round) {
    const std::lock_guard<std::mutex> lock(s.mu);
    if (s.with_ttl == 0) break;
    const std::string* expired[kSample];
    std::size_t sampled = 0, n_expired = 0;
    // Each bucket at most once per round, so no key is sampled twice.
    const std::size_t buckets = s.map.bucket_count();
    for (std::size_t visited = 0; visited < std::min(kBuckets, buckets) && sampled < kSample; ++visited) {
      const std::size_t b = s.cursor++ % buckets;  // a rehash merely shifts where the walk goes
      for (auto it = s.map.begin(b); it != s.map.end(b) && sampled < kSample; ++it) {
        if (it->second.expires_at == kNever) continue;
        ++sampled;
        if (it->second.expires_at <= now) expired[n_expired++] = &it->first;
      }
    }
    // Erased after the walk: erasing invalidates the bucket iterators. Node keys are stable.
    for (std::size_t i = 0; i < n_expired; ++i) erase_entry(s, s.map.find(*expired[i]));
    removed += n_expired;
    if (n_expired * 4 <= sampled) break;
  }
  return removed;
}

}  // namespace redis
