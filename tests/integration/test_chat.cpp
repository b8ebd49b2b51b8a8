// samples/chat/chat_server in its own process, driven by clients over real loopback sockets.
//
// The clients are blocking sockets on the test's own thread: every read and write is bounded by
// SO_RCVTIMEO/SO_SNDTIMEO, so a server that stops answering fails the test instead of hanging
// it. Nothing waits for time to pass: each step waits for the line that proves the server got
// there, and the server handles a client's lines in the order they were sent.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "process.hpp"

namespace {

using namespace fiber_test;

// chat_server.cpp's limits (keep in step with kQueueLines, kWriteBatch and kMaxLine there).
constexpr size_t kServerQueueLines = 1024;
constexpr size_t kServerWriteBatch = 64 * 1024;
constexpr size_t kMaxLine = 4096;

Server start_server(const std::string& procs = "2") {
  return Server::start(SERVER_BIN, {"0"}, {"FIBER_PROCS=" + procs});
}

// A chat client: a blocking socket with a line reader.
class Client {
 public:
  // rcvbuf > 0: SO_RCVBUF, set before connecting so that the window is small from the start.
  explicit Client(uint16_t port, int rcvbuf = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE_MESSAGE(fd_ >= 0, "socket: " << std::strerror(errno));
    if (rcvbuf > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    const auto limit = scaled(std::chrono::milliseconds(30'000));
    const timeval tv{static_cast<time_t>(limit.count() / 1000), 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE_MESSAGE(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0,
                    "connect: " << std::strerror(errno));
  }
  Client(Client&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), buf_(std::move(o.buf_)), pos_(o.pos_), nick_(std::move(o.nick_)) {}
  Client& operator=(Client&&) = delete;
  ~Client() { close(); }

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }
  const std::string& nick() const { return nick_; }

  // Sends all of `data`; false (and why()) on an error or a timeout.
  bool send(std::string_view data) {
    for (size_t off = 0; off < data.size();) {
      const ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        why_ = std::string("send: ") + std::strerror(errno);
        return false;
      }
      off += static_cast<size_t>(n);
    }
    return true;
  }
  bool say(std::string_view line) { return send(std::string(line) + "\n"); }

  // The next line without its "\n"; nullopt at the end of the stream, on an error or a timeout
  // (why() says which).
  std::optional<std::string> line() {
    for (;;) {
      const size_t nl = buf_.find('\n', pos_);
      if (nl != std::string::npos) {
        std::string out = buf_.substr(pos_, nl - pos_);
        pos_ = nl + 1;
        if (pos_ > 65536) {
          buf_.erase(0, pos_);
          pos_ = 0;
        }
        return out;
      }
      char tmp[65536];
      const ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        why_ = "end of stream";
        return std::nullopt;
      }
      if (n < 0) {
        why_ = errno == EAGAIN ? std::string("timed out") : std::string("recv: ") + std::strerror(errno);
        return std::nullopt;
      }
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }
  // The next line that is not from the server itself ("* ..."), which it skips.
  std::optional<std::string> chat_line() {
    for (;;) {
      auto l = line();
      if (!l || !l->starts_with("* ")) return l;
    }
  }
  // Reads the greeting and remembers the nick in it.
  void welcome() {
    const auto l = line();
    REQUIRE_MESSAGE(l, "no welcome: " << why_);
    REQUIRE_MESSAGE(l->starts_with("* welcome "), "first line: " << *l);
    nick_ = l->substr(10);
  }
  // Whether the server closed the connection (end of stream or reset) once the lines still
  // pending (counted in *lines) are read; false when it times out first.
  bool closed_by_server(size_t* lines = nullptr) {
    for (;;) {
      if (!line()) return why_ == "end of stream" || why_ == std::string("recv: ") + std::strerror(ECONNRESET);
      if (lines) ++*lines;
    }
  }
  const std::string& why() const { return why_; }

 private:
  int fd_ = -1;
  std::string buf_;
  size_t pos_ = 0;
  std::string nick_;
  std::string why_;
};

// The most a socket's send buffer grows to by itself (net.ipv4.tcp_wmem's maximum), or one set
// with SO_SNDBUF may (net.core.wmem_max).
size_t max_send_buffer() {
  size_t most = 4 << 20;
  std::ifstream tcp("/proc/sys/net/ipv4/tcp_wmem");
  size_t lo = 0, def = 0, hi = 0;
  if (tcp >> lo >> def >> hi) most = std::max(most, hi);
  std::ifstream core("/proc/sys/net/core/wmem_max");
  size_t wmem_max = 0;
  if (core >> wmem_max) most = std::max(most, wmem_max);
  return most;
}

}  // namespace

TEST_SUITE("chat") {

TEST_CASE("welcome, then every line reaches every other client, in the sender's order") {
  auto server = start_server();
  std::vector<Client> c;
  for (int i = 0; i < 3; ++i) {
    c.emplace_back(server.port());
    c.back().welcome();
  }
  CHECK(c[0].nick() != c[1].nick());
  CHECK(c[1].nick() != c[2].nick());
  // Those already in hear of each arrival, in order.
  CHECK(c[0].line() == "* " + c[1].nick() + " joined");
  CHECK(c[0].line() == "* " + c[2].nick() + " joined");
  CHECK(c[1].line() == "* " + c[2].nick() + " joined");

  constexpr int kLines = 200;
  auto text = [&](size_t i, int k) { return c[i].nick() + " says " + std::to_string(k); };
  for (int k = 0; k < kLines; ++k) {
    for (size_t i = 0; i < c.size(); ++i) REQUIRE_MESSAGE(c[i].say(text(i, k)), c[i].why());
  }
  for (size_t i = 0; i < c.size(); ++i) {
    std::vector<int> next(c.size(), 0);  // the next line expected from each sender
    int wrong = 0;
    std::string first_wrong;
    for (int got = 0; got < kLines * static_cast<int>(c.size() - 1); ++got) {
      const auto l = c[i].line();
      if (!l) FAIL(c[i].nick() << " after " << got << " lines: " << c[i].why());
      bool ok = false;
      for (size_t s = 0; s < c.size() && !ok; ++s) {
        if (s != i && next[s] < kLines && *l == c[s].nick() + ": " + text(s, next[s])) {
          ++next[s];
          ok = true;
        }
      }
      if (!ok && wrong++ == 0) first_wrong = *l;
    }
    CHECK_MESSAGE(wrong == 0, c[i].nick() << " got " << wrong << " unexpected lines, the first: " << first_wrong);
    // /who is answered after everything sent before it: had a client's own lines come back,
    // they would show up before the answer.
    REQUIRE(c[i].say("/who"));
    CHECK(c[i].line() == "* members: " + c[0].nick() + ", " + c[1].nick() + ", " + c[2].nick());
  }
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("/nick, /who, /quit, unknown commands, and leaving by closing the socket") {
  auto server = start_server();
  Client a(server.port()), b(server.port()), c(server.port());
  a.welcome();
  b.welcome();
  c.welcome();
  CHECK(a.line() == "* " + b.nick() + " joined");
  CHECK(a.line() == "* " + c.nick() + " joined");
  CHECK(b.line() == "* " + c.nick() + " joined");
  const std::string b_nick = b.nick(), c_nick = c.nick();

  // A rename is announced to everyone, the renamer included.
  REQUIRE(a.say("/nick alice"));
  const std::string renamed = "* " + a.nick() + " is now alice";
  CHECK(a.line() == renamed);
  CHECK(b.line() == renamed);
  CHECK(c.line() == renamed);
  REQUIRE(a.say("hi, I am alice"));
  CHECK(b.line() == "alice: hi, I am alice");
  CHECK(c.line() == "alice: hi, I am alice");

  // Refusals go to the sender only; the name stays.
  REQUIRE(b.say("/nick alice"));
  CHECK(b.line() == "* error: nick alice is taken");
  REQUIRE(a.say("/nick alice"));
  CHECK(a.line() == "* error: you are already alice");
  const std::vector<std::string> bad_renames = {"/nick", "/nick ", "/nick two words", "/nick b@d",
                                                "/nick " + std::string(33, 'n')};
  for (const std::string& bad : bad_renames) {
    REQUIRE(b.say(bad));
    CHECK_MESSAGE(b.line() == "* error: invalid nick (use 1-32 characters of A-Z a-z 0-9 _ -)", bad);
  }
  REQUIRE(b.say("/nick " + std::string(32, 'B')));  // 32 characters is fine
  const std::string long_name(32, 'B');
  CHECK(b.line() == "* " + b_nick + " is now " + long_name);
  CHECK(a.line() == "* " + b_nick + " is now " + long_name);
  CHECK(c.line() == "* " + b_nick + " is now " + long_name);
  REQUIRE(b.say("/nick Bob_the-2nd"));
  CHECK(b.line() == "* " + long_name + " is now Bob_the-2nd");
  CHECK(a.line() == "* " + long_name + " is now Bob_the-2nd");
  CHECK(c.line() == "* " + long_name + " is now Bob_the-2nd");
  // The old name is free again.
  REQUIRE(c.say("/nick " + long_name));
  CHECK(c.line() == "* " + c_nick + " is now " + long_name);
  CHECK(a.line() == "* " + c_nick + " is now " + long_name);
  CHECK(b.line() == "* " + c_nick + " is now " + long_name);

  REQUIRE(b.say("/who"));
  CHECK(b.line() == "* members: alice, Bob_the-2nd, " + long_name);
  REQUIRE(b.say("/shout hello"));
  CHECK(b.line() == "* error: unknown command /shout (try /nick NAME, /who, /quit)");
  REQUIRE(b.say(""));  // ignored
  REQUIRE(b.say("line with CRLF\r"));
  CHECK(a.line() == "Bob_the-2nd: line with CRLF");
  CHECK(c.line() == "Bob_the-2nd: line with CRLF");

  // /quit: a goodbye, then the server closes; the others hear of it.
  REQUIRE(b.say("/quit"));
  CHECK(b.line() == "* bye");
  CHECK_MESSAGE(b.closed_by_server(), b.why());
  b.close();  // the server waits (a little) for that before it lets go of the connection
  CHECK(a.line() == "* Bob_the-2nd left");
  CHECK(c.line() == "* Bob_the-2nd left");

  // Just closing the socket is a leave too.
  c.close();
  CHECK(a.line() == "* " + long_name + " left");
  REQUIRE(a.say("/who"));
  CHECK(a.line() == "* members: alice");
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("a client that stops reading is disconnected as too slow; the others get every line") {
  auto server = start_server();
  // The slow client reads its welcome and then nothing: with a small receive buffer, what the
  // server sends it piles up in the server's send buffer, then in its queue.
  Client slow(server.port(), 4096);
  slow.welcome();
  std::vector<Client> fast;
  for (int i = 0; i < 2; ++i) {
    fast.emplace_back(server.port());
    fast.back().welcome();
  }
  Client flooder(server.port());
  flooder.welcome();

  // Flood up to twice what the slow client's path can hold: its receive buffer, the server's
  // send buffer at its largest, a write batch in flight and a full queue. Before that the queue
  // must overflow, however the threads happen to run; the flood stops once it has.
  constexpr size_t kLineBytes = 1000;
  int rcvbuf = 0;
  socklen_t len = sizeof rcvbuf;
  ::getsockopt(slow.fd(), SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len);
  const size_t absorbable = static_cast<size_t>(rcvbuf) + max_send_buffer() + kServerWriteBatch +
                            (kServerQueueLines + 1) * (kLineBytes + 16);
  const int lines = static_cast<int>(2 * absorbable / kLineBytes);

  // In rounds, each read by the fast clients before the next: their queues never hold more than
  // a round, so they keep up whatever the scheduling.
  constexpr int kRound = 32;
  const std::string too_slow = "* " + slow.nick() + " was disconnected (too slow)";
  std::vector<int> received(fast.size(), 0), kicked_seen(fast.size(), 0), wrong(fast.size(), 0);
  auto flood_line = [&](int k) {
    std::string s = "flood " + std::to_string(k) + " ";
    s.resize(kLineBytes, 'f');
    return s;
  };
  int sent = 0;
  while (sent < lines && std::count(kicked_seen.begin(), kicked_seen.end(), 0) > 0) {
    const int end = std::min(lines, sent + kRound);
    for (; sent < end; ++sent) {
      if (!flooder.say(flood_line(sent))) FAIL("flooder: " << flooder.why());
    }
    for (size_t i = 0; i < fast.size(); ++i) {
      while (received[i] < end) {
        const auto l = fast[i].line();
        if (!l) FAIL("fast client " << i << " after " << received[i] << " lines: " << fast[i].why());
        if (l->starts_with("* ")) {
          kicked_seen[i] += *l == too_slow;
          continue;
        }
        wrong[i] += *l != flooder.nick() + ": " + flood_line(received[i]);
        ++received[i];
      }
    }
  }
  MESSAGE("the slow client was disconnected after " << sent << " of at most " << lines << " lines");
  for (size_t i = 0; i < fast.size(); ++i) {
    CHECK(received[i] == sent);
    CHECK(wrong[i] == 0);
    CHECK_MESSAGE(kicked_seen[i] == 1, "fast client " << i);
  }
  // The slow client gets what was already on its way, then the end of the stream.
  size_t slow_lines = 0;
  CHECK_MESSAGE(slow.closed_by_server(&slow_lines), slow.why());
  CHECK(slow_lines < static_cast<size_t>(sent));
  // The flooder and the fast clients are still served.
  REQUIRE(flooder.say("/who"));
  CHECK(flooder.line() == too_slow);
  CHECK(flooder.line() == "* members: " + fast[0].nick() + ", " + fast[1].nick() + ", " + flooder.nick());
  CHECK(contains(server.log(), "disconnecting " + slow.nick() + ": too slow"));
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("an overlong line or a NUL byte: an error, then the connection closes; the others carry on") {
  auto server = start_server();
  Client witness(server.port());
  witness.welcome();

  // At the limit is fine, with "\n" or "\r\n".
  {
    Client ok(server.port());
    ok.welcome();
    CHECK(witness.line() == "* " + ok.nick() + " joined");
    const std::string longest(kMaxLine, 'x');
    REQUIRE(ok.say(longest));
    REQUIRE(ok.say(longest + "\r"));
    CHECK(witness.line() == ok.nick() + ": " + longest);
    CHECK(witness.line() == ok.nick() + ": " + longest);
    ok.close();
    CHECK(witness.line() == "* " + ok.nick() + " left");
  }

  struct Bad {
    const char* what;
    std::string input;  // sent after a good line
    const char* error;
  };
  const Bad cases[] = {
      {"one byte over", std::string(kMaxLine + 1, 'y') + "\n", "* error: line longer than 4096 bytes"},
      {"over, with no end of line yet", std::string(3 * kMaxLine, 'z'), "* error: line longer than 4096 bytes"},
      {"a NUL byte", std::string("nul\0byte", 8) + "\n", "* error: line contains a NUL byte"},
  };
  for (const Bad& bad : cases) {
    CAPTURE(bad.what);
    Client c(server.port());
    c.welcome();
    CHECK(witness.line() == "* " + c.nick() + " joined");
    REQUIRE(c.send("before\n" + bad.input));
    CHECK(witness.line() == c.nick() + ": before");  // what came before the bad line counts
    CHECK(c.line() == bad.error);
    CHECK_MESSAGE(c.closed_by_server(), c.why());
    CHECK(witness.line() == "* " + c.nick() + " left");
  }

  // The server still serves the others and newcomers.
  Client late(server.port());
  late.welcome();
  CHECK(witness.line() == "* " + late.nick() + " joined");
  REQUIRE(late.say("still here"));
  CHECK(witness.line() == late.nick() + ": still here");
  REQUIRE(witness.say("/who"));
  CHECK(witness.line() == "* members: " + witness.nick() + ", " + late.nick());
  CHECK_CLEAN_STOP(server);
}

TEST_CASE("a thousand clients each say a line and hear everyone else's") {
  // Under TSan the server and this test run about 20 times slower, and the work grows with the
  // square of the count (a thousand clients take minutes): 250 clients still exercise every path.
  const size_t want = kTsan ? 250 : 1000;
  // This process holds one descriptor per client (the server raises its own limit).
  const size_t limit = static_cast<size_t>(raise_nofile(want + 64));
  const size_t n = std::min(want, limit > 64 ? limit - 64 : 0);
  if (n < want) MESSAGE("RLIMIT_NOFILE allows only " << n << " clients");
  for (const char* procs : {"2", "4"}) {
    SUBCASE((std::string("FIBER_PROCS=") + procs).c_str()) {
      auto server = start_server(procs);
      std::vector<Client> c;
      c.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        c.emplace_back(server.port());
        c.back().welcome();
      }
      // Everyone hears of those who came after them, in order. Reading it all now leaves each
      // client's queue on the server empty before the burst below.
      size_t bad_joins = 0;
      for (size_t i = 0; i < n; ++i) {
        for (size_t j = i + 1; j < n; ++j) {
          const auto l = c[i].line();
          if (!l) FAIL("client " << i << ": " << c[i].why());
          bad_joins += *l != "* " + c[j].nick() + " joined";
        }
      }
      CHECK(bad_joins == 0);

      for (size_t i = 0; i < n; ++i) {
        if (!c[i].say("hello from " + c[i].nick())) FAIL("client " << i << ": " << c[i].why());
      }
      // The burst queues at most n - 1 lines per client, below the server's queue bound, so
      // nobody is too slow even though each client is read only in its turn.
      REQUIRE(n - 1 < kServerQueueLines);
      std::map<std::string, size_t> index;
      for (size_t i = 0; i < n; ++i) index[c[i].nick()] = i;
      size_t bad_lines = 0, incomplete = 0;
      std::string first_bad;
      for (size_t i = 0; i < n; ++i) {
        std::vector<bool> heard(n, false);
        heard[i] = true;  // it must not hear itself: an own line counts as a duplicate below
        for (size_t got = 0; got + 1 < n; ++got) {
          const auto l = c[i].line();
          if (!l) FAIL("client " << i << " after " << got << " lines: " << c[i].why());
          const size_t colon = l->find(": ");
          const auto from = colon == std::string::npos ? index.end() : index.find(l->substr(0, colon));
          const bool ok = from != index.end() && !heard[from->second] &&
                          l->substr(colon + 2) == "hello from " + from->first;
          if (ok) {
            heard[from->second] = true;
          } else if (bad_lines++ == 0) {
            first_bad = "client " + std::to_string(i) + " got: " + *l;
          }
        }
        incomplete += std::count(heard.begin(), heard.end(), false) != 0;
      }
      CHECK_MESSAGE(bad_lines == 0, first_bad);
      CHECK(incomplete == 0);
      // Nothing more than that came: /who is answered right after.
      size_t bad_who = 0;
      for (size_t i = 0; i < n; i += std::max<size_t>(1, n / 16)) {
        REQUIRE(c[i].say("/who"));
        const auto l = c[i].line();
        bad_who += !l || !l->starts_with("* members: " + c[0].nick() + ", ");
      }
      CHECK(bad_who == 0);
      CHECK_FALSE(contains(server.log(), "too slow"));
      // And it stops cleanly with all of them connected.
      CHECK_CLEAN_STOP(server);
    }
  }
}

TEST_CASE("SIGTERM ends the server with status 0 while clients are connected") {
  auto server = start_server();
  Client a(server.port()), b(server.port()), c(server.port());
  a.welcome();
  b.welcome();
  c.welcome();
  REQUIRE(a.say("one line"));
  CHECK(b.chat_line() == a.nick() + ": one line");
  REQUIRE(c.send("half a li"));  // a line still being typed
  CHECK_CLEAN_STOP(server);
  // Each gets the goodbye (after the lines before it), then the end of the stream.
  for (Client* x : {&a, &b, &c}) {
    std::optional<std::string> l;
    while ((l = x->line()) && *l != "* server shutting down") {
    }
    CHECK_MESSAGE(l, x->nick() << ": " << x->why());
    CHECK_MESSAGE(x->closed_by_server(), x->nick() << ": " << x->why());
  }
  // The port is free again: the listener was closed, not leaked.
  auto again = Server::start(SERVER_BIN, {std::to_string(server.port())}, {"FIBER_PROCS=1"});
  CHECK(again.port() == server.port());
  CHECK_CLEAN_STOP(again);
}

TEST_CASE("SIGTERM ends the server while a client keeps sending") {
  // The server ends its readers by shutting their sockets' read side. That still lets in what
  // the receive window allowed before, and a reader that found data at every read would keep
  // the stop waiting; on Linux the window stays shut from then on, so the reader soon finds
  // none and leaves.
  auto server = start_server();
  Client flooder(server.port());
  flooder.welcome();
  std::atomic<bool> stop_sending{false};
  std::atomic<size_t> sent{0};
  std::thread sender([&] {
    std::string lines;
    for (int i = 0; i < 1024; ++i) lines += "x\n";
    // Until the server is gone (a reset, an error) or the test says so.
    while (!stop_sending.load() && flooder.send(lines)) sent += lines.size();
  });
  // Stop while the flood is under way: it keeps going throughout the stop.
  const bool flooding = wait_for([&] { return sent.load() >= (size_t{256} << 10); });
  if (flooding) CHECK_CLEAN_STOP(server);
  stop_sending = true;
  sender.join();
  CHECK_MESSAGE(flooding, "the client could not send: " << flooder.why());
}

}  // TEST_SUITE("chat")
