// Integration tests of samples/redis/redis_server: the real server process, driven by
// redis-cli, redis-benchmark (Debian's redis-tools), raw sockets and many fiber clients.
//
//   build/release/tests/integration/integration_redis            (ctest: integration_redis)
//
// Replies are checked against what Redis 7 answers (the expected texts were taken from
// redis-server 7.0.15). Every wait is bounded (fiber_test::scaled limits); nothing sleeps to
// synchronise and nothing asserts timings. Tests that need redis-cli or redis-benchmark fail
// when the program is missing (tools/setup-deps.sh installs both).
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "process.hpp"

namespace {

using namespace std::chrono_literals;
using fiber_test::Server;
using fiber_test::scaled;

Server start_server(int processors = 2) {
  return Server::start(SERVER_BIN, {"0"}, {"FIBER_PROCS=" + std::to_string(processors)});
}

// "SET k v" -> {"SET", "k", "v"}
std::vector<std::string> words(std::string_view line) {
  std::vector<std::string> out;
  std::istringstream in{std::string(line)};
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The request encoding clients use: a multibulk array of bulk strings.
std::string encode(const std::vector<std::string>& args) {
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (const auto& a : args) out += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
  return out;
}
std::string command(std::initializer_list<std::string> args) { return encode(args); }
std::string command(std::string_view line) { return encode(words(line)); }
std::string bulk(std::string_view s) { return "$" + std::to_string(s.size()) + "\r\n" + std::string(s) + "\r\n"; }

// redis-cli in its non-interactive mode: output without the trailing newlines (an error reply
// ends with an empty line).
class Cli {
 public:
  explicit Cli(const Server& s) : port_(std::to_string(s.port())) {}
  std::string raw(const std::vector<std::string>& args) const {
    std::vector<std::string> argv{"redis-cli", "-p", port_};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = fiber_test::run(argv);
    REQUIRE_MESSAGE(r.status == 0, "redis-cli failed (" << r.status << "): " << r.err);
    return r.out;
  }
  std::string operator()(std::string_view line) const {
    std::string out = raw(words(line));
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  }

 private:
  std::string port_;
};



// A blocking client socket for the test's own thread, every wait bounded by poll.
class Raw {
 public:
  explicit Raw(uint16_t port) : fd_(fiber_test::connect_loopback(port)) {
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~Raw() { ::close(fd_); }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;

  void send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      REQUIRE_MESSAGE(n > 0, "send: " << std::strerror(errno));
      data.remove_prefix(static_cast<size_t>(n));
    }
  }
  // Up to n bytes, fewer if the peer closes or the limit passes first.
  std::string read_n(size_t n, std::chrono::milliseconds limit = scaled(10'000ms)) {
    std::string out;
    const auto end = fiber_test::Clock::now() + limit;
    while (out.size() < n && wait_readable(end)) {
      char buf[65536];
      const ssize_t got = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }
  // Everything until the peer closes; false if it has not closed within the limit.
  bool read_to_eof(std::string& out, std::chrono::milliseconds limit = scaled(10'000ms)) {
    const auto end = fiber_test::Clock::now() + limit;
    while (wait_readable(end)) {
      char buf[65536];
      const ssize_t got = ::recv(fd_, buf, sizeof buf, 0);
      if (got == 0) return true;
      if (got < 0) return errno == ECONNRESET;
      out.append(buf, static_cast<size_t>(got));
    }
    return false;
  }
  // Sends a request and returns the reply, whose length the caller knows.
  std::string call(std::string_view request, size_t reply_size) {
    send(request);
    return read_n(reply_size);
  }

 private:
  bool wait_readable(fiber_test::Clock::time_point end) const {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - fiber_test::Clock::now());
      if (left.count() <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      const int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return false;
    }
  }
  int fd_ = -1;
};

// A fiber client's exact read of n bytes; the reply, or what came before an error.
std::string read_reply(fiber::net::Stream& c, size_t n) {
  std::string buf(n, '\0');
  const ssize_t got = c.read_exact(buf.data(), n, scaled(30'000ms));
  buf.resize(got < 0 ? 0 : static_cast<size_t>(got));
  return buf;
}

// Reads CRLF-terminated lines from a fiber client's stream, buffered.
class LineReader {
 public:
  explicit LineReader(fiber::net::Stream& c) : c_(c) {}
  // The next line without its CRLF; "" on error or end of stream.
  std::string line() {
    for (;;) {
      const auto nl = buf_.find("\r\n");
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 2);
        return l;
      }
      char chunk[4096];
      const ssize_t n = c_.read(chunk, sizeof chunk, scaled(30'000ms));
      if (n <= 0) return {};
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }

 private:
  fiber::net::Stream& c_;
  std::string buf_;
};

// Collects failures from fibers, to be checked on the test's thread (doctest's INFO/CAPTURE
// are not for fibers).
class Failures {
 public:
  void add(std::string what) {
    const std::lock_guard<std::mutex> lock(mu_);
    ++count_;
    if (first_.size() < 5) first_.push_back(std::move(what));
  }
  size_t count() const { return count_; }
  std::string summary() const {
    std::string s = std::to_string(count_) + " failures";
    for (const auto& f : first_) s += "\n  " + f;
    return s;
  }

 private:
  std::mutex mu_;
  size_t count_ = 0;
  std::vector<std::string> first_;
};

}  // namespace

TEST_SUITE("redis") {

TEST_CASE("strings: PING, ECHO, GET, SET and its options through redis-cli") {
  fiber_test::require_program("redis-cli");
  auto server = start_server();
  const Cli cli(server);
  CHECK(cli("ping") == "PONG");
  CHECK(cli("ping hello") == "hello");
  CHECK(cli("echo hi") == "hi");
  CHECK(cli("get missing") == "");
  CHECK(cli("set k v") == "OK");
  CHECK(cli("get k") == "v");
  CHECK(cli("set k v2 nx") == "");  // exists: not written
  CHECK(cli("get k") == "v");
  CHECK(cli("set fresh 1 nx") == "OK");
  CHECK(cli("set k v3 xx") == "OK");
  CHECK(cli("get k") == "v3");
  CHECK(cli("set nokey v xx") == "");  // missing: not written
  CHECK(cli("exists nokey") == "0");
  CHECK(cli("set k v4 get") == "v3");
  CHECK(cli("set k v nx xx") == "ERR syntax error");
  CHECK(cli("set k v ex 10 px 100") == "ERR syntax error");
  CHECK(cli("set k v ex") == "ERR syntax error");
  CHECK(cli("set k v bogus") == "ERR syntax error");
  CHECK(cli("set k v ex abc") == "ERR value is not an integer or out of range");
  CHECK(cli("set k v ex 0") == "ERR invalid expire time in 'set' command");
  CHECK(cli("set k v px -5") == "ERR invalid expire time in 'set' command");
  CHECK(cli("set k v ex 9223372036854775807") == "ERR invalid expire time in 'set' command");
  CHECK(cli("get k") == "v4");  // none of the failed SETs wrote
  // Binary-safe values with spaces and an empty value, through the argument vector.
  CHECK(cli.raw({"set", "spaced key", "a b\tc"}) == "OK\n");
  CHECK(cli.raw({"get", "spaced key"}) == "a b\tc\n");
  CHECK(cli.raw({"set", "empty", ""}) == "OK\n");
  CHECK(cli.raw({"exists", "empty"}) == "1\n");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("expiry: EX, PX, EXPIRE, TTL, KEEPTTL, lazy and active removal") {
  fiber_test::require_program("redis-cli");
  auto server = start_server();
  const Cli cli(server);
  CHECK(cli("ttl missing") == "-2");
  CHECK(cli("expire missing 10") == "0");
  CHECK(cli("set k v") == "OK");
  CHECK(cli("ttl k") == "-1");
  CHECK(cli("expire k 100") == "1");
  const int ttl = std::stoi(cli("ttl k"));
  CHECK((ttl >= 90 && ttl <= 100));
  CHECK(cli("set k v2 keepttl") == "OK");
  CHECK(cli("ttl k") != "-1");
  CHECK(cli("set k v3") == "OK");  // a plain SET clears the TTL
  CHECK(cli("ttl k") == "-1");
  CHECK(cli("set k v ex 1000") == "OK");
  const int ex = std::stoi(cli("ttl k"));
  CHECK((ex > 900 && ex <= 1000));
  CHECK(cli("set k v px 500000") == "OK");
  const int pttl = std::stoi(cli("pttl k"));
  CHECK((pttl > 400000 && pttl <= 500000));
  // EXPIRE's conditions.
  CHECK(cli("set c v") == "OK");
  CHECK(cli("expire c 100 xx") == "0");  // no TTL yet
  CHECK(cli("expire c 100 nx") == "1");
  CHECK(cli("expire c 200 nx") == "0");  // has one now
  CHECK(cli("expire c 50 gt") == "0");
  CHECK(cli("expire c 300 gt") == "1");
  CHECK(cli("expire c 400 lt") == "0");
  CHECK(cli("expire c 200 lt") == "1");
  CHECK(cli("expire c 10 nx xx") == "ERR NX and XX, GT or LT options at the same time are not compatible");
  CHECK(cli("expire c 10 gt lt") == "ERR GT and LT options at the same time are not compatible");
  CHECK(cli("expire c 10 sometimes") == "ERR Unsupported option sometimes");
  CHECK(cli("expire c abc") == "ERR value is not an integer or out of range");
  CHECK(cli("expire c 9223372036854775807") == "ERR invalid expire time in 'expire' command");
  // An instant already past deletes the key.
  CHECK(cli("expire c -1") == "1");
  CHECK(cli("exists c") == "0");
  CHECK(cli("ttl c") == "-2");
  // A short TTL runs out (lazy removal on access): bounded polling, no fixed sleep.
  CHECK(cli("set short v px 50") == "OK");
  CHECK(fiber_test::wait_for([&] { return cli("get short").empty(); }, 10'000ms, 20ms));
  CHECK(cli("ttl short") == "-2");
  // Keys nobody touches again are removed by the background sweep: DBSIZE counts keys not yet
  // removed (as Redis's does), so it falls to 0 only through active expiry.
  CHECK(cli("flushall") == "OK");
  Raw raw(server.port());
  std::string sets, oks;
  for (int i = 0; i < 200; ++i) {
    sets += command({"SET", "vol:" + std::to_string(i), "x", "PX", "30"});
    oks += "+OK\r\n";
  }
  CHECK(raw.call(sets, oks.size()) == oks);
  CHECK(fiber_test::wait_for([&] { return cli("dbsize") == "0"; }, 20'000ms, 20ms));
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("counters and multi-key commands: INCR, DECR, INCRBY, DECRBY, DEL, EXISTS, MGET, MSET") {
  fiber_test::require_program("redis-cli");
  auto server = start_server();
  const Cli cli(server);
  CHECK(cli("incr n") == "1");
  CHECK(cli("incr n") == "2");
  CHECK(cli("decr n") == "1");
  CHECK(cli("decr m") == "-1");
  CHECK(cli("incrby n 41") == "42");
  CHECK(cli("decrby n 50") == "-8");
  CHECK(cli("incrby n x") == "ERR value is not an integer or out of range");
  CHECK(cli("set s hello") == "OK");
  CHECK(cli("incr s") == "ERR value is not an integer or out of range");
  CHECK(cli("set s 007") == "OK");
  CHECK(cli("incr s") == "ERR value is not an integer or out of range");  // as Redis: one spelling
  CHECK(cli("set big 9223372036854775807") == "OK");
  CHECK(cli("incr big") == "ERR increment or decrement would overflow");
  CHECK(cli("get big") == "9223372036854775807");
  CHECK(cli("set n 10 ex 100") == "OK");
  CHECK(cli("incr n") == "11");
  CHECK(cli("ttl n") != "-1");  // INCR keeps the TTL
  CHECK(cli("mset a 1 b 2 c 3") == "OK");
  CHECK(cli.raw({"mget", "a", "missing", "b", "c", "also-missing"}) == "1\n\n2\n3\n\n");
  CHECK(cli("exists a b missing a") == "3");  // a key named twice counts twice
  CHECK(cli("del a b missing") == "2");
  CHECK(cli("exists a b") == "0");
  CHECK(cli("get c") == "3");
  CHECK(cli("dbsize") == "5");  // n m s big c
  CHECK(cli("flushall") == "OK");
  CHECK(cli("dbsize") == "0");
  CHECK(cli("get c") == "");
  CHECK(cli("flushall async") == "OK");
  CHECK(cli("flushall later") == "ERR syntax error");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("errors and connection commands: arity, unknown commands, SELECT, CONFIG, COMMAND, QUIT") {
  fiber_test::require_program("redis-cli");
  auto server = start_server();
  const Cli cli(server);
  CHECK(cli("get") == "ERR wrong number of arguments for 'get' command");
  CHECK(cli("GET a b") == "ERR wrong number of arguments for 'get' command");
  CHECK(cli("set k") == "ERR wrong number of arguments for 'set' command");
  CHECK(cli("incr") == "ERR wrong number of arguments for 'incr' command");
  CHECK(cli("mset a 1 b") == "ERR wrong number of arguments for 'mset' command");
  CHECK(cli("mget") == "ERR wrong number of arguments for 'mget' command");
  CHECK(cli("ping a b") == "ERR wrong number of arguments for 'ping' command");
  CHECK(cli("ttl") == "ERR wrong number of arguments for 'ttl' command");
  // Redis's wording, trailing space included.
  CHECK(cli.raw({"foo"}) == "ERR unknown command 'foo', with args beginning with: \n\n");
  CHECK(cli.raw({"foo", "a", "b"}) == "ERR unknown command 'foo', with args beginning with: 'a' 'b' \n\n");
  CHECK(cli("SeT k v") == "OK");  // command names are case-insensitive
  CHECK(cli("select 0") == "OK");
  CHECK(cli("select 1") == "ERR DB index is out of range");
  CHECK(cli("select x") == "ERR value is not an integer or out of range");
  CHECK(cli("dbsize") == "1");
  CHECK(cli.raw({"config", "get", "save"}) == "save\n\n");
  CHECK(cli.raw({"config", "get", "appendonly"}) == "appendonly\nno\n");
  CHECK(cli.raw({"config", "get", "no-such-setting"}) == "\n");  // an empty array
  CHECK(cli("config get") == "ERR wrong number of arguments for 'config|get' command");
  CHECK(cli("config set save x") == "ERR unknown subcommand 'set'. Try CONFIG HELP.");
  CHECK(cli.raw({"command"}) == "\n");
  CHECK(cli.raw({"command", "docs"}) == "\n");
  // QUIT: +OK, then the server closes the connection.
  Raw raw(server.port());
  raw.send("*1\r\n$4\r\nQUIT\r\n*1\r\n$4\r\nPING\r\n");
  std::string got;
  CHECK(raw.read_to_eof(got));
  CHECK(got == "+OK\r\n");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("pipelining: many commands in one write, every reply in order") {
  auto server = start_server(4);
  Raw raw(server.port());
  // 2000 commands of several kinds in one buffer, written at once; the expected replies built
  // alongside.
  std::string request, expected;
  for (int i = 0; i < 500; ++i) {
    const std::string key = "p:" + std::to_string(i), value = std::string(static_cast<size_t>(i % 50), 'v') + "!";
    request += command({"SET", key, value});
    expected += "+OK\r\n";
    request += command({"GET", key});
    expected += bulk(value);
    request += command({"INCR", "counter"});
    expected += ":" + std::to_string(i + 1) + "\r\n";
    request += i % 2 == 0 ? std::string("PING\r\n") : command({"EXISTS", key, "nope"});  // inline ones too
    expected += i % 2 == 0 ? "+PONG\r\n" : ":1\r\n";
  }
  request += command({"MGET", "p:1", "nope", "p:2"});
  expected += "*3\r\n" + bulk("v!") + "$-1\r\n" + bulk("vv!");
  raw.send(request);
  CHECK(raw.read_n(expected.size()) == expected);
  // The connection keeps serving after the batch, and a batch split mid-command works too.
  const std::string tail = command("GET p:3") + command("PING");
  raw.send(tail.substr(0, 7));
  raw.send(tail.substr(7));
  CHECK(raw.read_n(bulk("vvv!").size() + 7) == bulk("vvv!") + "+PONG\r\n");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("malformed input: a protocol error reply, a closed connection, and the server serves on") {
  auto server = start_server();
  Raw bystander(server.port());  // open across all the bad connections below
  struct Case {
    std::string input, reply;
  };
  const Case cases[] = {
      {"*abc\r\n", "-ERR Protocol error: invalid multibulk length\r\n"},
      {"*99999999999\r\n", "-ERR Protocol error: invalid multibulk length\r\n"},
      {"*1\r\n$-1\r\n", "-ERR Protocol error: invalid bulk length\r\n"},
      {"*1\r\n$-5\r\nabc\r\n", "-ERR Protocol error: invalid bulk length\r\n"},
      {"*1\r\n$99999999999999999999\r\n", "-ERR Protocol error: invalid bulk length\r\n"},
      {"*1\r\n$40000000\r\n", "-ERR Protocol error: invalid bulk length\r\n"},  // over the 32 MiB limit
      {"*1\r\n$x\r\n", "-ERR Protocol error: invalid bulk length\r\n"},
      {"*2\r\n$3\r\nGET\r\n:1\r\n", "-ERR Protocol error: expected '$', got ':'\r\n"},
      {"*1\r\nhello\r\n", "-ERR Protocol error: expected '$', got 'h'\r\n"},
      {"echo \"unbalanced\r\n", "-ERR Protocol error: unbalanced quotes in request\r\n"},
      // The replies of the commands before the bad one come first.
      {"PING\r\n*1\r\n$4\r\nPING\r\n*x\r\n", "+PONG\r\n+PONG\r\n-ERR Protocol error: invalid multibulk length\r\n"},
      // 70 KB without a line end.
      {std::string(70'000, 'a'), "-ERR Protocol error: too big inline request\r\n"},
      {"*" + std::string(70'000, '1'), "-ERR Protocol error: too big mbulk count string\r\n"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.input.substr(0, 40));
    Raw bad(server.port());
    bad.send(c.input);
    std::string got;
    CHECK_MESSAGE(bad.read_to_eof(got), "the connection stayed open");
    CHECK(got == c.reply);
  }
  // Binary garbage that is a valid inline command: an unknown command error, connection open.
  Raw garbage(server.port());
  const std::string unknown = "-ERR unknown command '\x01\x02', with args beginning with: '\xff' \r\n";
  CHECK(garbage.call("\x01\x02 \xff\r\n", unknown.size()) == unknown);
  CHECK(server.running());
  CHECK(bystander.call("*1\r\n$4\r\nPING\r\n", 7) == "+PONG\r\n");
  Raw after(server.port());
  CHECK(after.call(command("SET k v") + command("GET k"), 5 + 7) == "+OK\r\n$1\r\nv\r\n");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("a slow client does not hold up the others") {
  auto server = start_server(1);  // one processor: any blocking would stall everyone
  Raw slow(server.port());
  slow.send("*3\r\n$3\r\nSET\r\n$4\r\nslow\r\n$5\r\nval");  // half a command, then nothing
  Raw trickle(server.port());
  const std::string trickled = command("SET trickle ok");
  trickle.send(trickled.substr(0, 3));
  // Others are served in full while both wait mid-command.
  for (int i = 0; i < 20; ++i) {
    Raw other(server.port());
    const std::string key = "k" + std::to_string(i);
    CHECK(other.call(command({"SET", key, "v"}) + command({"GET", key}), 5 + 7) == "+OK\r\n$1\r\nv\r\n");
    trickle.send(trickled.substr(3 + static_cast<size_t>(i), 1));  // a byte at a time
  }
  trickle.send(trickled.substr(23));
  CHECK(trickle.read_n(5) == "+OK\r\n");
  // The slow one finishes later and is served as well.
  CHECK(slow.call("ue\r\n", 5) == "+OK\r\n");
  CHECK(slow.call(command("GET slow"), 11) == bulk("value"));
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("10,000 concurrent connections (1,000 under TSan), each a SET and a GET of its own key") {
  const rlim_t nofile = fiber_test::raise_nofile(20'000);
  REQUIRE_MESSAGE(nofile >= 10'200, "RLIMIT_NOFILE is " << nofile << ", too low for 10,000 connections");
  auto server = start_server(4);
  // 10,000 everywhere but under ThreadSanitizer. Its runtime (GCC 12's libtsan) gives every
  // live fiber a context of its own, about 1.2 MiB each, and dies with "Thread limit (8128
  // threads) exceeded" beyond 8128 of them in one process; the server has one fiber per
  // connection, and so does this client. 1,000 keeps both processes at a few GiB.
  constexpr int kConnections = fiber_test::kTsan ? 1'000 : 10'000;
  const std::string address = server.address();
  Failures failures;
  std::atomic<int> served{0};
  fiber::Latch all_open(kConnections);
  fiber::block_on([&] {
    for (int i = 0; i < kConnections; ++i) {
      go [&, i] {
        auto conn = fiber::net::Stream::dial(address, scaled(60'000ms));
        all_open.count_down();  // connected or failed: the latch must open either way
        if (!conn) {
          failures.add("dial " + std::to_string(i) + ": " + conn.message());
          return;
        }
        all_open.wait();  // every connection is open at the same time from here on
        const std::string key = "conn:" + std::to_string(i), value = "value-" + std::to_string(i * 7919);
        const std::string set = command({"SET", key, value});
        if (conn->write_all(set.data(), set.size(), scaled(30'000ms)) < 0) return failures.add("write SET " + key);
        if (const auto r = read_reply(*conn, 5); r != "+OK\r\n") return failures.add("SET " + key + " -> " + r);
        const std::string get = command({"GET", key});
        if (conn->write_all(get.data(), get.size(), scaled(30'000ms)) < 0) return failures.add("write GET " + key);
        const std::string want = bulk(value);
        if (const auto r = read_reply(*conn, want.size()); r != want) return failures.add("GET " + key + " -> " + r);
        served.fetch_add(1, std::memory_order_relaxed);
      };
    }
  });
  CHECK_MESSAGE(failures.count() == 0, failures.summary());
  CHECK(served.load() == kConnections);
  Raw check(server.port());
  const std::string dbsize = ":" + std::to_string(kConnections) + "\r\n";
  CHECK(check.call(command("DBSIZE"), dbsize.size()) == dbsize);
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("data safe across processors: 50 connections x 1000 INCR of one key") {
  auto server = start_server(4);
  constexpr int kClients = 50, kIncrs = 1000, kBatch = 10;  // pipelined 10 at a time
  const std::string address = server.address();
  Failures failures;
  std::vector<std::vector<int64_t>> seen(kClients);
  fiber::block_on([&] {
    for (int c = 0; c < kClients; ++c) {
      go [&, c] {
        auto conn = fiber::net::Stream::dial(address, scaled(30'000ms));
        if (!conn) return failures.add("dial: " + conn.message());
        LineReader replies(*conn);
        std::string batch;
        for (int i = 0; i < kBatch; ++i) batch += command("INCR counter");
        for (int done = 0; done < kIncrs; done += kBatch) {
          if (conn->write_all(batch.data(), batch.size(), scaled(30'000ms)) < 0) return failures.add("write");
          // Each reply is ":N\r\n".
          for (int i = 0; i < kBatch; ++i) {
            const std::string line = replies.line();
            if (line.size() < 2 || line[0] != ':') return failures.add("reply: " + line);
            seen[static_cast<size_t>(c)].push_back(std::stoll(line.substr(1)));
          }
        }
      };
    }
  });
  REQUIRE_MESSAGE(failures.count() == 0, failures.summary());
  // Every increment was applied once and seen by exactly one client: the replies are 1..50000.
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  REQUIRE(all.size() == static_cast<size_t>(kClients * kIncrs));
  bool exact = true;
  for (size_t i = 0; i < all.size(); ++i) exact = exact && all[i] == static_cast<int64_t>(i + 1);
  CHECK(exact);
  Raw check(server.port());
  CHECK(check.call(command("GET counter"), 11) == bulk("50000"));
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("redis-benchmark runs every test against the server") {
  fiber_test::require_program("redis-benchmark");
  auto server = start_server(2);
  const auto r = fiber_test::run({"redis-benchmark", "-p", std::to_string(server.port()), "-t", "ping,set,get", "-c",
                                  "50", "-n", "20000", "-q"},
                                 {}, scaled(180'000ms));
  INFO("redis-benchmark stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.status == 0);
  for (const char* test : {"PING_INLINE: ", "PING_MBULK: ", "SET: ", "GET: "}) {
    const auto at = r.out.rfind(test);
    REQUIRE_MESSAGE(at != std::string::npos, "no result for " << test);
    CHECK(r.out.find("requests per second", at) != std::string::npos);
  }
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("SIGTERM ends the server with status 0, with clients still connected") {
  auto server = start_server();
  Raw idle(server.port());
  Raw midway(server.port());
  midway.send("*2\r\n$3\r\nGET");
  CHECK(idle.call("PING\r\n", 7) == "+PONG\r\n");
  CHECK_CLEAN_STOP(server);
  std::string rest;
  CHECK(idle.read_to_eof(rest));
}

}  // TEST_SUITE("redis")
