// samples/http_server in its own process, driven by curl, wrk and raw sockets.
#include <doctest/doctest.h>
#include <fiber/fiber.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "http_parser.hpp"
#include "io_util.hpp"
#include "process.hpp"

namespace {

using namespace fiber_test;
using namespace std::string_literals;
namespace fs = std::filesystem;

// A blocking client socket on the test's own thread (SO_RCVTIMEO bounds every read).
class Client {
 public:
  explicit Client(uint16_t port) : fd_(connect_loopback(port)) {
    const timeval tv{static_cast<time_t>(scaled(std::chrono::milliseconds(20'000)).count() / 1000), 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }

  void send(const std::string& data) {
    for (size_t off = 0; off < data.size();) {
      const ssize_t n = ::send(fd_, data.data() + off, data.size() - off, MSG_NOSIGNAL);
      REQUIRE_MESSAGE(n > 0, "send: " << std::strerror(errno));
      off += static_cast<size_t>(n);
    }
  }
  // Everything until the server closes (or the read times out: then `timed_out`).
  std::string read_to_eof(bool* timed_out = nullptr) {
    std::string all;
    char buf[65536];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n > 0) {
        all.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (timed_out != nullptr) *timed_out = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
      return all;
    }
  }
  // One response: status line, headers, and a Content-Length body. Empty status on EOF.
  struct Response {
    int status = 0;
    std::string head;
    std::string body;
  };
  Response read_response() {
    Response r;
    for (;;) {
      const size_t end = pending_.find("\r\n\r\n");
      if (end != std::string::npos) {
        r.head = pending_.substr(0, end + 4);
        pending_.erase(0, end + 4);
        break;
      }
      if (!fill()) return r;
    }
    r.status = std::atoi(r.head.c_str() + 9);
    const size_t cl = r.head.find("Content-Length: ");
    const size_t len = cl == std::string::npos ? 0 : std::strtoul(r.head.c_str() + cl + 16, nullptr, 10);
    while (pending_.size() < len) {
      if (!fill()) return Response{};
    }
    r.body = pending_.substr(0, len);
    pending_.erase(0, len);
    return r;
  }
  int fd() const { return fd_; }

 private:
  bool fill() {
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) return false;
    pending_.append(buf, static_cast<size_t>(n));
    return true;
  }
  int fd_ = -1;
  std::string pending_;
};

// A document root with a few files, removed afterwards.
struct DocRoot {
  fs::path dir;
  std::string big;  // contents of big.bin
  DocRoot() {
    dir = fs::temp_directory_path() / ("libfiber-http-" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir / "sub");
    std::ofstream(dir / "hello.txt") << "hi there\n";
    std::ofstream(dir / "sub" / "index.html") << "<p>sub</p>\n";
    std::mt19937 rng(7);
    big.resize(3 * 1024 * 1024 + 17);  // larger than the inline limit: streamed in pieces
    for (auto& c : big) c = static_cast<char>(rng());
    std::ofstream(dir / "big.bin", std::ios::binary) << big;
    std::ofstream(dir.parent_path() / ("libfiber-http-secret-" + std::to_string(::getpid()))) << "secret\n";
    fs::create_symlink(dir.parent_path() / ("libfiber-http-secret-" + std::to_string(::getpid())), dir / "escape");
  }
  ~DocRoot() {
    std::error_code ec;
    fs::remove(dir.parent_path() / ("libfiber-http-secret-" + std::to_string(::getpid())), ec);
    fs::remove_all(dir, ec);
  }
};

// A chunked body of one-byte chunks, each with a 1000-byte extension: a megabyte and a half of
// framing for about 1.5 KB of body.
std::string chunked_framing_flood() {
  std::string r = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n";
  const std::string chunk = "1;" + std::string(1000, 'e') + "\r\nX\r\n";
  while (r.size() < 1'500'000) r += chunk;
  return r;
}

std::string url(const Server& s, const std::string& path) { return "http://" + s.address() + path; }

std::string get_request(const std::string& path, const std::string& extra = {}) {
  return "GET " + path + " HTTP/1.1\r\nHost: test\r\n" + extra + "\r\n";
}

// Sends `request` on a new connection: the answer must be `status` with "Connection: close",
// and the server must then close the connection (not leave it open until the read times out).
void check_refused(uint16_t port, const std::string& request, int status) {
  Client c(port);
  c.send(request);
  const auto r = c.read_response();
  CHECK(r.status == status);
  CHECK(contains(r.head, "Connection: close\r\n"));
  bool timed_out = true;
  c.read_to_eof(&timed_out);
  CHECK_FALSE(timed_out);
}

}  // namespace

TEST_SUITE("http") {

TEST_CASE("http: curl gets hello, HEAD has no body, other methods 405") {
  require_program("curl");
  Server s = Server::start(SERVER_BIN, {"0"});
  auto r = run({"curl", "-s", "-i", url(s, "/")});
  REQUIRE(r.status == 0);
  CHECK(contains(r.out, "HTTP/1.1 200 OK\r\n"));
  CHECK(contains(r.out, "Content-Length: 5\r\n"));
  CHECK(contains(r.out, "Date: "));
  CHECK(r.out.substr(r.out.size() - 7) == "\r\nhello");

  r = run({"curl", "-s", "-I", url(s, "/hello")});
  REQUIRE(r.status == 0);
  CHECK(contains(r.out, "HTTP/1.1 200 OK\r\n"));
  {
    // curl -I stops reading at the header's end, so it cannot see a body sent after it. On one
    // connection, the GET's response must start right where the HEAD's header ends, although
    // that header gives the GET body's length.
    Client c(s.port());
    c.send("HEAD /hello HTTP/1.1\r\nHost: test\r\n\r\n" + get_request("/hello"));
    std::string got;
    size_t first_end = std::string::npos, second_end = std::string::npos;
    while (second_end == std::string::npos || got.size() < second_end + 5) {
      char buf[4096];
      const ssize_t n = ::recv(c.fd(), buf, sizeof buf, 0);
      REQUIRE_MESSAGE(n > 0, "after " << got.size() << " bytes: " << got);
      got.append(buf, static_cast<size_t>(n));
      first_end = got.find("\r\n\r\n");
      if (first_end != std::string::npos) second_end = got.find("\r\n\r\n", first_end + 4);
    }
    const std::string head_response = got.substr(0, first_end + 4);
    CHECK(head_response.starts_with("HTTP/1.1 200 OK\r\n"));
    CHECK(contains(head_response, "Content-Length: 5\r\n"));
    const std::string rest = got.substr(first_end + 4);
    CHECK_MESSAGE(rest.starts_with("HTTP/1.1 200 OK\r\n"), "after the HEAD response's header: " << rest);
    CHECK(rest.ends_with("\r\n\r\nhello"));
  }

  r = run({"curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", "-d", "x=1", url(s, "/")});
  CHECK(r.out == "405");
  r = run({"curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url(s, "/nothing-here")});
  CHECK(r.out == "404");
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: static files, directories, and paths that try to leave the root") {
  require_program("curl");
  DocRoot root;
  Server s = Server::start(SERVER_BIN, {"0", "--root", root.dir.string()});
  auto code = [&](const std::string& path) {
    return run({"curl", "-s", "--path-as-is", "-o", "/dev/null", "-w", "%{http_code}", url(s, path)}).out;
  };
  auto r = run({"curl", "-s", "-i", url(s, "/static/hello.txt")});
  CHECK(contains(r.out, "Content-Type: text/plain; charset=utf-8\r\n"));
  CHECK(r.out.substr(r.out.size() - 9) == "hi there\n");
  CHECK(run({"curl", "-s", url(s, "/static/sub/")}).out == "<p>sub</p>\n");
  CHECK(run({"curl", "-s", url(s, "/static/./sub//index.html")}).out == "<p>sub</p>\n");

  // A file larger than one piece, byte for byte, and twice on one connection (keep-alive).
  const fs::path copy = root.dir.parent_path() / ("libfiber-http-copy-" + std::to_string(::getpid()));
  r = run({"curl", "-s", "-o", copy.string(), "-w", "%{num_connects}", url(s, "/static/big.bin"), "-o", copy.string(),
           url(s, "/static/big.bin")});
  REQUIRE(r.status == 0);
  CHECK(r.out == "10");  // the second transfer reused the first connection
  std::ifstream in(copy, std::ios::binary);
  const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(got.size() == root.big.size());
  CHECK(got == root.big);
  fs::remove(copy);

  CHECK(code("/static/missing.txt") == "404");
  CHECK(code("/static/../CMakeLists.txt") == "403");
  CHECK(code("/static/%2e%2e/%2e%2e/etc/passwd") == "403");
  CHECK(code("/static/bad%2") == "403");
  CHECK(code("/static/nul%00byte") == "403");
  const std::string escape = code("/static/escape");  // a symlink out of the root
  CHECK_MESSAGE((escape == "403" || escape == "404"), "got " << escape);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: pipelined requests are answered in order; Connection: close ends the connection") {
  Server s = Server::start(SERVER_BIN, {"0"});
  Client c(s.port());
  std::string batch;
  constexpr int kRequests = 200;
  for (int i = 0; i < kRequests; ++i) batch += get_request(i % 2 == 0 ? "/" : "/nope?i=" + std::to_string(i));
  batch += get_request("/hello", "Connection: close\r\n");
  c.send(batch);
  for (int i = 0; i < kRequests; ++i) {
    const auto r = c.read_response();
    REQUIRE_MESSAGE(r.status == (i % 2 == 0 ? 200 : 404), "response " << i << ": " << r.head);
    if (i % 2 == 0) CHECK(r.body == "hello");
  }
  const auto last = c.read_response();
  CHECK(last.status == 200);
  CHECK(contains(last.head, "Connection: close\r\n"));
  bool timed_out = true;
  CHECK(c.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);  // the server closed the connection

  // HTTP/1.0 closes by default, keeps the connection with "Connection: keep-alive".
  Client old(s.port());
  old.send("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET / HTTP/1.0\r\n\r\n");
  const auto first = old.read_response();
  CHECK(first.status == 200);
  CHECK(contains(first.head, "HTTP/1.0 200 OK\r\n"));
  CHECK(contains(first.head, "Connection: keep-alive\r\n"));
  CHECK(old.read_response().status == 200);
  timed_out = true;
  CHECK(old.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: malformed requests get their status and a closed connection") {
  Server s = Server::start(SERVER_BIN, {"0"});
  struct Case {
    const char* name;
    std::string request;
    int status;
  };
  std::string many_headers = "GET / HTTP/1.1\r\nHost: a\r\n";
  for (int i = 0; i < 70; ++i) many_headers += "X-" + std::to_string(i) + ": v\r\n";
  const std::vector<Case> cases = {
      {"garbage", "\x16\x03\x01 hello there\r\n\r\n", 400},
      {"no version", "GET /\r\n\r\n", 400},
      {"bad method", "G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"missing Host", "GET / HTTP/1.1\r\n\r\n", 400},
      {"folded header", "GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400},
      {"control character", "GET / HTTP/1.1\r\nHost: a\r\nX: a\0b\r\n\r\n"s, 400},
      {"bad Content-Length", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 12x\r\n\r\n", 400},
      {"conflicting lengths", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400},
      {"bad chunk", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400},
      {"header too large", "GET / HTTP/1.1\r\nHost: a\r\nX: " + std::string(20'000, 'x') + "\r\n\r\n", 431},
      {"too many headers", many_headers + "\r\n", 431},
      {"body too large", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999\r\n\r\n", 413},
      {"unknown transfer coding", "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
      {"HTTP/2.0", "GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505},
      {"chunk framing far larger than the body", chunked_framing_flood(), 413},
  };
  for (const auto& tc : cases) {
    CAPTURE(tc.name);
    check_refused(s.port(), tc.request, tc.status);
  }
  // A good request after a bad one on the same connection is not answered; on a new one it is.
  Client c(s.port());
  c.send("BAD\r\n\r\n" + get_request("/"));
  CHECK(c.read_response().status == 400);
  bool timed_out = true;
  CHECK(c.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);
  Client fine(s.port());
  fine.send(get_request("/"));
  CHECK(fine.read_response().body == "hello");
  // HTTP/1.0 with a transfer coding is answered, then the connection closes.
  Client old(s.port());
  old.send("POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
  const auto r10 = old.read_response();
  CHECK(r10.status == 405);
  CHECK(contains(r10.head, "Connection: close\r\n"));
  timed_out = true;
  CHECK(old.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);
  // A chunked request body is decoded (the route then refuses the method).
  fine.send("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n" + get_request("/"));
  CHECK(fine.read_response().status == 405);
  CHECK(fine.read_response().status == 200);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: a slow client does not hold up the others") {
  require_program("curl");
  // Timeouts far beyond the test's length: the slow client stays stalled throughout.
  Server s = Server::start(SERVER_BIN, {"0", "--request-timeout", "600000", "--idle-timeout", "600000"});
  Client slow(s.port());
  slow.send("GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ");  // and then nothing
  Client slow_body(s.port());
  slow_body.send("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly part");
  for (int i = 0; i < 20; ++i) {
    const auto r = run({"curl", "-s", url(s, "/")});
    REQUIRE(r.out == "hello");
  }
  Client other(s.port());
  other.send(get_request("/"));
  CHECK(other.read_response().body == "hello");
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: a request not finished in time gets 408; an idle connection is closed") {
  Server s = Server::start(SERVER_BIN, {"0", "--request-timeout", "300", "--idle-timeout", "300"});
  Client slow(s.port());
  slow.send("GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ");
  const auto r = slow.read_response();
  CHECK(r.status == 408);
  CHECK(contains(r.head, "Connection: close\r\n"));
  bool timed_out = true;
  CHECK(slow.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);
  // A kept-alive connection that stays idle is closed without a response.
  Client idle(s.port());
  idle.send(get_request("/"));
  CHECK(idle.read_response().body == "hello");
  timed_out = true;
  CHECK(idle.read_to_eof(&timed_out).empty());
  CHECK_FALSE(timed_out);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: empty lines after a request leave the connection idle, not in a request") {
  // A request timeout far below the idle one: were the empty lines taken for the start of a
  // request, a 408 would come after 300 ms.
  Server s = Server::start(SERVER_BIN, {"0", "--request-timeout", "300", "--idle-timeout", "600000"});
  // Whether nothing arrives (no response, no close) for a few request timeouts.
  auto quiet = [](Client& c) {
    pollfd p{c.fd(), POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(scaled(std::chrono::milliseconds(1500)).count())) == 0;
  };
  struct Case {
    const char* name;
    std::string with_request;  // sent right after the first request, in the same write
    std::string after;         // sent once its response has come
    std::string before_next;   // sent just before the next request, in the same write
  };
  const Case cases[] = {
      {"CRLF with the request", "\r\n", "", ""},
      {"CRLF, LF and CRLF after the response", "", "\r\n\n\r\n", ""},
      {"a CR whose LF comes with the next request", "", "\r", "\n"},
  };
  for (const Case& tc : cases) {
    INFO(tc.name);
    Client c(s.port());
    c.send(get_request("/") + tc.with_request);
    CHECK(c.read_response().body == "hello");
    if (!tc.after.empty()) c.send(tc.after);
    CHECK_MESSAGE(quiet(c), "the idle connection got: " << c.read_response().head);
    c.send(tc.before_next + get_request("/hello"));
    CHECK(c.read_response().body == "hello");
  }
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: Expect: 100-continue gets 100 Continue or the final status at once; other expectations 417") {
  Server s = Server::start(SERVER_BIN, {"0"});
  const std::string body_wanted = "Content-Length: 5\r\n\r\n";
  {
    // A request a route takes: "100 Continue" once the header is in, the response after the
    // body; and so for each request on the connection.
    Client c(s.port());
    for (const char* expect : {"Expect: 100-continue\r\n", "eXpEcT: 100-CONTINUE\r\n"}) {
      INFO(expect);
      c.send("GET / HTTP/1.1\r\nHost: a\r\n" + std::string(expect) + body_wanted);
      const auto interim = c.read_response();
      CHECK_MESSAGE(interim.head == "HTTP/1.1 100 Continue\r\n\r\n", interim.head);
      c.send("abcde");
      const auto r = c.read_response();
      CHECK(r.status == 200);
      CHECK(r.body == "hello");
    }
    // With the body already there, and without Expect: no 100.
    c.send("GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n" + body_wanted + "abcde" + get_request("/"));
    CHECK(c.read_response().status == 200);
    CHECK(c.read_response().status == 200);
  }
  struct Refused {
    const char* name;
    std::string request;
    int status;
  };
  const Refused refused[] = {
      // The request line alone decides: answered without waiting for the body, then closed.
      {"method not allowed", "POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n" + body_wanted, 405},
      {"no such path", "PUT /nowhere HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n" + body_wanted, 404},
      {"body too large", "GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 99999999\r\n\r\n", 413},
      {"another expectation", "GET / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\n\r\n", 417},
      {"100-continue among others", "GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue, x\r\n\r\n", 417},
  };
  for (const Refused& tc : refused) {
    INFO(tc.name);
    check_refused(s.port(), tc.request, tc.status);
  }
  {
    // HTTP/1.0 had no Expect: it is ignored (RFC 9110 10.1.1).
    Client old(s.port());
    old.send("GET / HTTP/1.0\r\nExpect: 200-ok\r\n\r\n");
    CHECK(old.read_response().status == 200);
  }
  // curl waits for the 100 (here up to 20 s; by default 1 s, then sends the body anyway).
  require_program("curl");
  const fs::path upload = fs::temp_directory_path() / ("libfiber-http-upload-" + std::to_string(::getpid()));
  std::ofstream(upload, std::ios::binary) << std::string(100'000, 'u');
  auto r = run({"curl", "-sS", "-v", "-X", "GET", "--data-binary", "@" + upload.string(), "-H", "Expect: 100-continue",
                "--expect100-timeout", "20", url(s, "/")});
  CHECK(r.status == 0);
  CHECK(r.out == "hello");
  CHECK_MESSAGE(contains(r.err, "HTTP/1.1 100 Continue"), r.err);
  r = run({"curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--data-binary", "@" + upload.string(), "-H",
           "Expect: 100-continue", "--expect100-timeout", "20", url(s, "/")});
  CHECK(r.out == "405");
  fs::remove(upload);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: wrk drives keep-alive load with no errors") {
  require_program("wrk");
  Server s = Server::start(SERVER_BIN, {"0"}, {"FIBER_PROCS=2"});
  // wrk counts a response slower than --timeout as a socket error: allow for sanitizers.
  const auto r = run({"wrk", "-t1", "-c32", "-d1s", "--timeout", std::to_string(2 * kSlowdown) + "s", url(s, "/")});
  REQUIRE_MESSAGE(r.status == 0, r.err);
  CHECK(contains(r.out, "Requests/sec:"));
  CHECK_FALSE(contains(r.out, "Non-2xx"));
  CHECK_FALSE(contains(r.out, "Socket errors"));
  const auto at = r.out.find(" requests in ");
  REQUIRE(at != std::string::npos);
  CHECK(std::atol(r.out.c_str() + r.out.rfind('\n', at) + 1) > 0);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: 10,000 concurrent connections, every response checked") {
  // TSan's runtime keeps a thread context per fiber and runs out of them (and of trace memory)
  // near 8,000 live at once, in the test process and in the server; it checks 2,000.
  constexpr int kConns = kTsan ? 2'000 : 10'000;
  REQUIRE_MESSAGE(raise_nofile(kConns + 200) >= kConns + 200, "RLIMIT_NOFILE hard limit too low for this test");
  Server s = Server::start(SERVER_BIN, {"0"}, {"FIBER_PROCS=2"});
  const std::string address = s.address();
  std::atomic<int> connected{0}, answered{0}, failures{0};
  std::string first_failure;
  std::mutex failure_mu;
  auto record = [&](const std::string& what) {
    if (failures.fetch_add(1) == 0) {
      const std::lock_guard<std::mutex> lock(failure_mu);
      first_failure = what;
    }
  };
  fiber::Latch all_open(kConns);  // outlives every fiber that uses it (block_on waits for them)
  fiber::block_on([&] {
    for (int i = 0; i < kConns; ++i) {
      go [&, i] {
        auto conn = fiber::net::Stream::dial(address, patience());
        all_open.count_down();
        if (!conn) return record("dial: " + conn.message());
        connected.fetch_add(1);
        all_open.wait();  // every connection is open at once before any request goes out
        const std::string req = get_request("/hello?conn=" + std::to_string(i));
        if (conn->write_all(req.data(), req.size(), patience()) < 0) return record("write failed");
        // The hello response is small: read until the body arrives, then check all of it.
        std::string got;
        char buf[1024];
        while (got.size() < 5 || got.compare(got.size() - 5, 5, "hello") != 0) {
          const ssize_t n = conn->read(buf, sizeof buf, patience());
          if (n <= 0) return record("read: " + std::to_string(n) + " after " + got);
          got.append(buf, static_cast<size_t>(n));
        }
        if (got.rfind("HTTP/1.1 200 OK\r\n", 0) != 0 || !contains(got, "Content-Length: 5\r\n")) {
          return record("bad response: " + got);
        }
        answered.fetch_add(1);
      };
    }
  });
  CHECK_MESSAGE(failures.load() == 0, "first failure: " << first_failure);
  CHECK(connected.load() == kConns);
  CHECK(answered.load() == kConns);
  CHECK_CLEAN_STOP(s);
}

TEST_CASE("http: SIGTERM with connections open ends the server with status 0") {
  Server s = Server::start(SERVER_BIN, {"0"});
  Client a(s.port()), b(s.port());
  a.send(get_request("/"));
  CHECK(a.read_response().body == "hello");
  b.send("GET / HTTP/1.1\r\n");  // mid-request
  CHECK_CLEAN_STOP(s);
  CHECK(a.read_to_eof().empty());
}

TEST_CASE("http: bad command lines are refused with a message") {
  auto r = run({SERVER_BIN, "0", "--request-timeout", "soon"});
  CHECK(r.status == 1);
  CHECK(contains(r.err, "bad option --request-timeout soon"));
  r = run({SERVER_BIN, "0", "--root", "/nonexistent/dir"});
  CHECK(r.status == 1);
  CHECK(contains(r.err, "cannot open the root directory"));
  r = run({SERVER_BIN, "not-a-port"});
  CHECK(r.status == 1);
  CHECK(contains(r.err, "http_server: "));
}

TEST_CASE("http parser: a request split anywhere parses as it does whole") {
  const std::string stream =
      "POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
      "4;x=y\r\nwiki\r\n5\r\npedia\r\n0\r\nTrailer: t\r\n\r\n"
      "\r\nGET /next HTTP/1.1\nHost: b\nContent-Length: 3\n\nabc";
  for (size_t split = 0; split <= stream.size(); ++split) {
    http::Parser parser;
    http::Request req;
    std::string buf = stream.substr(0, split);
    std::vector<std::string> bodies, targets;
    size_t start = 0;
    bool fed_rest = false;
    for (;;) {
      const auto p = parser.parse(std::string_view(buf).substr(start), req);
      if (p == http::Parse::kComplete) {
        targets.emplace_back(req.target);
        bodies.emplace_back(req.body);
        start += parser.consumed();
        continue;
      }
      REQUIRE(p == http::Parse::kIncomplete);
      if (fed_rest) break;
      buf += stream.substr(split);  // may move the buffer: views are rebuilt on the next parse
      fed_rest = true;
    }
    REQUIRE(targets == std::vector<std::string>{"/upload", "/next"});
    CHECK(bodies == std::vector<std::string>{"wikipedia", "abc"});
    CHECK(start == stream.size());
  }
}

TEST_CASE("http parser: a large chunked body's storage is freed between requests, never during one") {
  http::Parser parser;
  http::Request req;
  const std::string data(200'000, 'd');
  char size_line[32];
  std::snprintf(size_line, sizeof size_line, "%zx\r\n", data.size());
  const std::string stream =
      "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(size_line) + data + "\r\n0\r\n\r\n";
  // Halfway through the body shrink() keeps what has been decoded.
  const std::string half = stream.substr(0, stream.size() / 2);
  REQUIRE(parser.parse(half, req) == http::Parse::kIncomplete);
  parser.shrink();
  REQUIRE(parser.parse(stream, req) == http::Parse::kComplete);
  CHECK(req.body == data);
  CHECK(parser.retained() >= data.size());
  // Between requests it lets go.
  parser.shrink();
  CHECK(parser.retained() <= 64 * 1024);
  // A small body's storage stays for the next request.
  const std::string small = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
  REQUIRE(parser.parse(small, req) == http::Parse::kComplete);
  CHECK(req.body == "hello");
  const size_t kept = parser.retained();
  parser.shrink();
  CHECK(parser.retained() == kept);
}

}  // TEST_SUITE
