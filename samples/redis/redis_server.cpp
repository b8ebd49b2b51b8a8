// redis_server: an in-memory key-value server speaking the Redis protocol (RESP2), one fiber per
// connection.
//
//   build/release/samples/redis/redis_server [PORT]     (default 6380; $PORT also works; 0: any)
//   FIBER_PROCS=2 build/release/samples/redis/redis_server 6380 &
//   redis-cli -p 6380 set greeting hello EX 60 && redis-cli -p 6380 get greeting
//   redis-benchmark -p 6380 -t ping,set,get -c 50 -n 100000 -q
//
// Commands: PING [msg], ECHO, GET, SET key value [NX|XX] [EX s|PX ms|KEEPTTL] [GET], DEL, EXISTS,
// INCR, DECR, INCRBY, DECRBY, MGET, MSET, EXPIRE/PEXPIRE key n [NX|XX|GT|LT], TTL, PTTL,
// FLUSHALL/FLUSHDB [ASYNC|SYNC], DBSIZE, SELECT 0, CONFIG GET param..., COMMAND (an empty list),
// QUIT. Requests may be multibulk or inline and may be pipelined. Replies and error messages are
// worded as Redis 7 words them, so redis-cli and redis-benchmark work unchanged. There is no
// persistence and a single database.
//
// Design:
//   - Each connection's fiber reads into its own buffer, runs every complete command in it and
//     appends the replies to one output buffer, which it sends with one write per batch: a
//     pipelining client costs one read and one write per batch, not per command. Arguments are
//     views into the read buffer; a GET or SET allocates nothing in the steady state.
//   - The key space (store.hpp) is sharded, each shard under a lock held only for the map
//     operation, so the fibers of any number of processors share it safely.
//   - Keys expire lazily when touched, and a background fiber samples keys with a TTL every
//     100 ms and removes the expired ones (Redis's active expiry), so memory is returned even for
//     keys nobody reads again.
//   - A protocol error (see resp.hpp) gets "-ERR Protocol error: ..." and the connection is closed,
//     as Redis does. Input buffers are bounded (resp.hpp), so no request makes the server grow
//     without limit; a reply is as large as what it returns (an MGET of one big value repeated
//     is as large as in Redis).
//
// Start-up, the accept loop and the stop are samples/common/server.hpp's, as in the other
// samples: it raises the RLIMIT_NOFILE soft limit, prints "redis_server: listening on
// 127.0.0.1:PORT with N processors" on stderr, backs off when descriptors run out, and on
// SIGTERM or SIGINT cancels the accept loop and the connections, closes the listener, then main
// cancels the expiry sweep and the process ends with status 0.
#include <fiber/fiber.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/server.hpp"
#include "resp.hpp"
#include "store.hpp"

namespace {

using Args = std::span<const std::string_view>;
using redis::Store;

// ---- commands ----

// What a command needs: the key space, the time the batch started (one clock read per batch
// rather than per command; Redis too uses one time per command for all its keys; read again
// after a flush within the batch, which can block), the reply buffer, and whether the
// connection should close after the replies are sent.
struct Context {
  Store& store;
  int64_t now;
  std::string& out;
  bool close = false;
};

bool iequals(std::string_view a, std::string_view lower) {
  if (a.size() != lower.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const char c = a[i];
    if ((c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c) != lower[i]) return false;
  }
  return true;
}

void error(Context& c, std::string_view message) { resp::append_error(c.out, message); }
void ok(Context& c) { resp::append_simple(c.out, "OK"); }
void arity_error(Context& c, std::string_view name) {
  error(c, "ERR wrong number of arguments for '" + std::string(name) + "' command");
}
void not_integer(Context& c) { error(c, "ERR value is not an integer or out of range"); }
void syntax_error(Context& c) { error(c, "ERR syntax error"); }

// Converts EX/PX/EXPIRE/PEXPIRE's amount to an instant, with Redis's overflow checks (which
// also apply to negative amounts, allowed by EXPIRE to delete a key). False: out of range.
bool expiry_instant(int64_t amount, bool in_ms, int64_t now, int64_t* at) {
  int64_t ms = amount;
  if (!in_ms && __builtin_mul_overflow(amount, int64_t{1000}, &ms)) return false;
  return !__builtin_add_overflow(ms, now, at);
}

void cmd_ping(Context& c, Args a) {
  if (a.size() > 2) return arity_error(c, "ping");
  if (a.size() == 2) return resp::append_bulk(c.out, a[1]);
  resp::append_simple(c.out, "PONG");
}

void cmd_echo(Context& c, Args a) { resp::append_bulk(c.out, a[1]); }

void cmd_get(Context& c, Args a) {
  if (!c.store.read(a[1], c.now, [&](const std::string& v) { resp::append_bulk(c.out, v); })) resp::append_null(c.out);
}

void cmd_set(Context& c, Args a) {
  Store::SetOptions options;
  bool get = false;
  bool has_expiry = false, in_ms = false;
  std::string_view expiry;  // the EX/PX argument
  for (std::size_t i = 3; i < a.size(); ++i) {
    const std::string_view opt = a[i];
    const bool ex = iequals(opt, "ex"), px = iequals(opt, "px");
    if (iequals(opt, "nx") && options.condition != Store::Condition::kIfExists) {
      options.condition = Store::Condition::kIfMissing;
    } else if (iequals(opt, "xx") && options.condition != Store::Condition::kIfMissing) {
      options.condition = Store::Condition::kIfExists;
    } else if (iequals(opt, "get")) {
      get = true;
    } else if (iequals(opt, "keepttl") && !has_expiry) {
      options.keep_ttl = true;
    } else if ((ex || px) && !options.keep_ttl && i + 1 < a.size() && (!has_expiry || in_ms == px)) {
      // EX and PX exclude each other and KEEPTTL; repeating one is allowed (the last one counts).
      has_expiry = true;
      in_ms = px;
      expiry = a[++i];
    } else {
      return syntax_error(c);
    }
  }
  if (has_expiry) {
    int64_t amount = 0;
    if (!resp::parse_int64(expiry, amount)) return not_integer(c);
    if (amount <= 0 || !expiry_instant(amount, in_ms, c.now, &options.expires_at)) {
      return error(c, "ERR invalid expire time in 'set' command");
    }
  }
  std::string old;
  const auto outcome = c.store.set(a[1], a[2], c.now, options, get ? &old : nullptr);
  if (get) {
    if (outcome.existed) return resp::append_bulk(c.out, old);
    return resp::append_null(c.out);
  }
  if (outcome.written) return ok(c);
  resp::append_null(c.out);
}

void cmd_del(Context& c, Args a) {
  int64_t n = 0;
  for (std::size_t i = 1; i < a.size(); ++i) n += c.store.erase(a[i], c.now) ? 1 : 0;
  resp::append_integer(c.out, n);
}

void cmd_exists(Context& c, Args a) {
  int64_t n = 0;  // a key named twice counts twice, as in Redis
  for (std::size_t i = 1; i < a.size(); ++i) n += c.store.contains(a[i], c.now) ? 1 : 0;
  resp::append_integer(c.out, n);
}

void incr_by(Context& c, std::string_view key, int64_t delta) {
  int64_t result = 0;
  switch (c.store.incr(key, delta, c.now, &result)) {
    case Store::IncrResult::kOk: return resp::append_integer(c.out, result);
    case Store::IncrResult::kNotInteger: return not_integer(c);
    case Store::IncrResult::kOverflow: return error(c, "ERR increment or decrement would overflow");
  }
}

void cmd_incr(Context& c, Args a) { incr_by(c, a[1], 1); }
void cmd_decr(Context& c, Args a) { incr_by(c, a[1], -1); }
void cmd_incrby(Context& c, Args a) {
  int64_t delta = 0;
  if (!resp::parse_int64(a[2], delta)) return not_integer(c);
  incr_by(c, a[1], delta);
}
void cmd_decrby(Context& c, Args a) {
  int64_t delta = 0;
  if (!resp::parse_int64(a[2], delta)) return not_integer(c);
  if (delta == INT64_MIN) return error(c, "ERR decrement would overflow");  // -delta does not exist
  incr_by(c, a[1], -delta);
}

void cmd_mget(Context& c, Args a) {
  resp::append_array(c.out, a.size() - 1);
  c.store.read_many(a.subspan(1), c.now, [&](const std::string* v) {
    if (v != nullptr) {
      resp::append_bulk(c.out, *v);
    } else {
      resp::append_null(c.out);
    }
  });
}

void cmd_mset(Context& c, Args a) {
  if (a.size() % 2 == 0) return arity_error(c, "mset");
  c.store.set_many(a.subspan(1), c.now);
  ok(c);
}

void expire_generic(Context& c, Args a, bool in_ms) {
  const std::string_view name = in_ms ? "pexpire" : "expire";
  int64_t amount = 0;
  if (!resp::parse_int64(a[2], amount)) return not_integer(c);
  Store::ExpireIf conditions;
  for (std::size_t i = 3; i < a.size(); ++i) {
    if (iequals(a[i], "nx")) {
      conditions.no_ttl = true;
    } else if (iequals(a[i], "xx")) {
      conditions.has_ttl = true;
    } else if (iequals(a[i], "gt")) {
      conditions.later = true;
    } else if (iequals(a[i], "lt")) {
      conditions.earlier = true;
    } else {
      return error(c, "ERR Unsupported option " + std::string(a[i]));
    }
  }
  if (conditions.no_ttl && (conditions.has_ttl || conditions.later || conditions.earlier)) {
    return error(c, "ERR NX and XX, GT or LT options at the same time are not compatible");
  }
  if (conditions.later && conditions.earlier) {
    return error(c, "ERR GT and LT options at the same time are not compatible");
  }
  int64_t at = 0;
  if (!expiry_instant(amount, in_ms, c.now, &at)) {
    return error(c, "ERR invalid expire time in '" + std::string(name) + "' command");
  }
  resp::append_integer(c.out, c.store.expire(a[1], at, conditions, c.now) ? 1 : 0);
}

void cmd_expire(Context& c, Args a) { expire_generic(c, a, false); }
void cmd_pexpire(Context& c, Args a) { expire_generic(c, a, true); }

void cmd_ttl(Context& c, Args a) {
  const int64_t ms = c.store.ttl_ms(a[1], c.now);
  resp::append_integer(c.out, ms < 0 ? ms : (ms + 500) / 1000);  // rounded, as Redis does
}
void cmd_pttl(Context& c, Args a) { resp::append_integer(c.out, c.store.ttl_ms(a[1], c.now)); }

void cmd_flushall(Context& c, Args a) {
  // ASYNC and SYNC are accepted; clearing is synchronous either way.
  if (a.size() > 2 || (a.size() == 2 && !iequals(a[1], "async") && !iequals(a[1], "sync"))) return syntax_error(c);
  c.store.clear();
  ok(c);
}

void cmd_dbsize(Context& c, Args) { resp::append_integer(c.out, static_cast<int64_t>(c.store.size())); }

void cmd_select(Context& c, Args a) {
  int64_t db = 0;
  if (!resp::parse_int64(a[1], db)) return not_integer(c);
  if (db != 0) return error(c, "ERR DB index is out of range");  // one database only
  ok(c);
}

void cmd_config(Context& c, Args a) {
  if (!iequals(a[1], "get")) {
    return error(c, "ERR unknown subcommand '" + std::string(a[1]) + "'. Try CONFIG HELP.");
  }
  if (a.size() < 3) return arity_error(c, "config|get");
  // The settings clients ask about. redis-benchmark reads "save" and "appendonly" at start and
  // warns about persistence; this server has none, which "" and "no" say.
  struct Setting {
    std::string_view name, value;
  };
  static constexpr Setting kSettings[] = {{"save", ""}, {"appendonly", "no"}, {"databases", "1"}};
  const Setting* found[std::size(kSettings)];
  std::size_t n = 0;
  for (const auto& s : kSettings) {
    const bool asked = std::any_of(a.begin() + 2, a.end(), [&](std::string_view p) { return iequals(p, s.name); });
    if (asked) found[n++] = &s;
  }
  resp::append_array(c.out, 2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    resp::append_bulk(c.out, found[i]->name);
    resp::append_bulk(c.out, found[i]->value);
  }
}

// COMMAND, COMMAND DOCS, COMMAND COUNT...: redis-cli asks for the command table to offer hints;
// an empty one is a valid answer and it then simply offers none.
void cmd_command(Context& c, Args) { resp::append_array(c.out, 0); }

void cmd_quit(Context& c, Args) {
  ok(c);
  c.close = true;
}

struct Command {
  std::string_view name;  // lower case
  int arity;              // as in Redis: n exactly n arguments (the name included), -n at least n
  void (*run)(Context&, Args);
};

// The most frequent commands first: lookup is a linear scan that mostly compares lengths.
constexpr Command kCommands[] = {
    {"get", 2, cmd_get},         {"set", -3, cmd_set},          {"ping", -1, cmd_ping},
    {"incr", 2, cmd_incr},       {"mget", -2, cmd_mget},        {"mset", -3, cmd_mset},
    {"del", -2, cmd_del},        {"exists", -2, cmd_exists},    {"decr", 2, cmd_decr},
    {"incrby", 3, cmd_incrby},   {"decrby", 3, cmd_decrby},     {"echo", 2, cmd_echo},
    {"expire", -3, cmd_expire},  {"pexpire", -3, cmd_pexpire},  {"ttl", 2, cmd_ttl},
    {"pttl", 2, cmd_pttl},       {"flushall", -1, cmd_flushall}, {"flushdb", -1, cmd_flushall},
    {"dbsize", 1, cmd_dbsize},   {"select", 2, cmd_select},     {"config", -2, cmd_config},
    {"command", -1, cmd_command}, {"quit", -1, cmd_quit},
};

void unknown_command(Context& c, Args a) {
  // Redis's wording: the name and the start of the arguments, each cut to keep the line short.
  constexpr std::size_t kLimit = 128;
  std::string msg = "ERR unknown command '";
  msg += a[0].substr(0, kLimit);
  msg += "', with args beginning with: ";
  std::string args;
  for (std::size_t i = 1; i < a.size() && args.size() < kLimit; ++i) {
    const std::size_t room = kLimit - args.size();
    args += '\'';
    args += a[i].substr(0, room);
    args += "' ";
  }
  error(c, msg + args);
}

void execute(Context& c, Args a) {
  for (const auto& cmd : kCommands) {
    if (!iequals(a[0], cmd.name)) continue;
    const auto argc = static_cast<int>(std::min<std::size_t>(a.size(), 1 << 30));
    if ((cmd.arity > 0 && argc != cmd.arity) || (cmd.arity < 0 && argc < -cmd.arity)) {
      return arity_error(c, cmd.name);
    }
    return cmd.run(c, a);
  }
  unknown_command(c, a);
}

// ---- connections ----

// The unparsed bytes of one connection: [begin_, end_) of a heap buffer that starts small (most
// connections send short commands), grows for long commands or a client that fills every read,
// and shrinks back once a large command is done. It never exceeds kMaxPending.
class InputBuffer {
 public:
  static constexpr std::size_t kInitial = 4096;
  static constexpr std::size_t kBusy = 64 << 10;    // grown to by clients that fill every read
  static constexpr std::size_t kMaxPending = std::size_t{128} << 20;  // > kMaxBulkLen and then some

  std::string_view pending() const noexcept { return {data_.get() + begin_, end_ - begin_}; }
  void consume(std::size_t n) noexcept {
    begin_ += n;
    if (begin_ == end_) begin_ = end_ = 0;
  }
  char* tail() noexcept { return data_.get() + end_; }
  std::size_t room() const noexcept { return cap_ - end_; }
  void produced(std::size_t n) noexcept { end_ += n; }

  // Makes room for the pending command to reach `wanted` bytes (the parser's estimate; 0 when
  // unknown) and for a read of at least kMinRead bytes, by compacting or growing. False if that
  // would exceed kMaxPending.
  bool reserve(std::size_t wanted) {
    constexpr std::size_t kMinRead = 512;
    const std::size_t pending = end_ - begin_;
    if (wanted > kMaxPending || pending >= kMaxPending) return false;
    const std::size_t total = std::min(std::max(wanted, pending + kMinRead), kMaxPending);
    if (cap_ - begin_ >= total) return true;
    if (cap_ >= total) {
      compact();
      return true;
    }
    resize(std::min(std::max(total, 2 * cap_), kMaxPending));
    return true;
  }
  // After a batch: a read that filled the buffer asks for a bigger one next time; an empty buffer
  // that grew for one large command goes back to the initial size.
  void adapt(bool filled) {
    if (filled && cap_ < kBusy) {
      resize(std::min(2 * cap_, kBusy));
    } else if (begin_ == end_ && cap_ > kBusy) {
      resize(kInitial);
    }
  }

 private:
  void compact() noexcept {
    if (begin_ == 0) return;
    std::memmove(data_.get(), data_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  void resize(std::size_t cap) {
    auto bigger = std::make_unique_for_overwrite<char[]>(cap);
    std::memcpy(bigger.get(), data_.get() + begin_, end_ - begin_);
    data_ = std::move(bigger);
    cap_ = cap;
    end_ -= begin_;
    begin_ = 0;
  }

  std::unique_ptr<char[]> data_ = std::make_unique_for_overwrite<char[]>(kInitial);
  std::size_t cap_ = kInitial;
  std::size_t begin_ = 0, end_ = 0;
};

// Sends what `out` holds and empties it. False when the peer is gone.
bool flush(fiber::net::Stream& conn, std::string& out) {
  if (out.empty()) return true;
  const bool sent = conn.write_all(out.data(), out.size()) >= 0;
  out.clear();
  return sent;
}

void serve(fiber::net::Stream conn, Store& store) {
  // Replies are flushed at batch ends, and earlier only if they pile up past this (a pipelined
  // MGET of large values, say), which bounds the reply buffer.
  constexpr std::size_t kFlushAt = 64 << 10;
  InputBuffer in;
  std::string out;
  resp::Parser parser;
  std::size_t wanted = 0;  // bytes the pending command needs, from the parser
  for (;;) {
    if (!in.reserve(wanted)) {
      resp::append_error(out, "ERR Protocol error: query buffer limit exceeded");
      flush(conn, out);
      return sample::linger_close(conn, std::chrono::milliseconds(500));
    }
    const std::size_t room = in.room();
    const ssize_t n = conn.read(in.tail(), room);
    if (n <= 0) return;  // closed by the peer, reset, or the server is stopping (-ECANCELED)
    in.produced(static_cast<std::size_t>(n));
    Context ctx{store, redis::now_ms(), out};
    bool failed = false;
    for (;;) {
      const auto r = parser.parse(in.pending());
      if (r == resp::Parser::Result::kIncomplete) {
        wanted = parser.wanted();
        break;
      }
      if (r == resp::Parser::Result::kError) {
        resp::append_error(out, "ERR " + parser.error());
        failed = true;
        break;
      }
      const Args args = parser.args();
      if (!args.empty()) execute(ctx, args);  // "*0" and blank inline lines get no reply
      in.consume(parser.consumed());
      wanted = 0;
      if (ctx.close) break;
      if (out.size() >= kFlushAt) {
        if (!flush(conn, out)) return;
        // The write may have waited on a slow reader for longer than a TTL: the commands after
        // it must not reckon expiry from a time already past.
        ctx.now = redis::now_ms();
      }
    }
    if (!flush(conn, out)) return;
    if (failed || ctx.close) return sample::linger_close(conn, std::chrono::milliseconds(500));
    in.adapt(static_cast<std::size_t>(n) == room);
    if (out.capacity() > 4 * kFlushAt) std::string().swap(out);
    parser.trim();
  }
}

// Redis's active expiry, every 100 ms. Ends when cancelled: sleep_for throws fiber::Cancelled,
// which main's join() rethrows.
void expire_keys(Store& store) {
  for (;;) {
    fiber::this_fiber::sleep_for(std::chrono::milliseconds(100));
    store.sweep(redis::now_ms());
  }
}

}  // namespace

int main(int argc, char** argv) {
  sample::Server server("redis_server", sample::port_arg(argc, argv, "6380"));
  if (!server.listening()) return 1;
  Store store;
  auto expiry = fiber::spawn({.name = "expire"}, [&store] { expire_keys(store); });
  const int rc = server.run([&store](fiber::net::Stream conn) { serve(std::move(conn), store); });
  // The connections are gone (a signal, or a failed accept loop); the sweep must be over before
  // `store` goes.
  expiry.cancel();
  try {
    expiry.join();
  } catch (const fiber::Cancelled&) {
  }
  return rc;
}
