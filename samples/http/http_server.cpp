// http_server: an HTTP/1.1 server with one fiber per connection.
//
//   build/release/samples/http_server [PORT] [--root DIR] [--request-timeout MS] [--idle-timeout MS]
//       PORT               default 8080 ($PORT also works; 0 = any free port)
//       --root DIR         the directory /static/ serves (default: samples/http/www)
//       --request-timeout  how long a client may take to send a whole request once it has
//                          started one (default 10000 ms); then 408 and the connection closes
//       --idle-timeout     how long a keep-alive connection may stay idle (default 60000 ms)
//
//   curl http://127.0.0.1:8080/                 -> 200 "hello"
//   curl http://127.0.0.1:8080/static/index.html
//   wrk -t1 -c64 -d5s http://127.0.0.1:8080/   (or tools/bench/http-server with the peers' runner)
//
// Routes: GET/HEAD "/" and "/hello" answer "hello"; GET/HEAD "/static/PATH" serves a regular file
// under the root (a directory serves its index.html); other paths 404, other methods 405.
//
// Keep-alive and pipelining: every complete request in what has been read is answered, in order,
// into one output buffer that goes out in one write. Empty lines between requests are skipped.
// A malformed request gets its status (400, 413, 417, 431, 501, 505; see http_parser.hpp) with
// "Connection: close". A request with "Expect: 100-continue" gets "100 Continue" once its header
// is in, or straight away its final 404 or 405 with "Connection: close" (no route reads a body).
// Timeouts are per connection fiber (io::Deadline on each read and write), so a slow or stalled
// client holds up nothing but itself.
#include <fiber/fiber.hpp>

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "http_parser.hpp"
#include "common/server.hpp"

namespace {

using std::chrono::milliseconds;

struct Config {
  std::string root = HTTP_DEFAULT_ROOT;
  int root_fd = -1;
  milliseconds request_timeout{10'000};
  milliseconds idle_timeout{60'000};
  milliseconds write_timeout{30'000};
};

// ------------------------------------------------------------------------------- responses

// The Date header's value, formatted once a second per thread.
std::string_view http_date() {
  thread_local time_t cached = -1;
  thread_local char text[40];
  const time_t now = std::time(nullptr);
  if (now != cached) {
    tm parts{};
    gmtime_r(&now, &parts);
    std::strftime(text, sizeof text, "%a, %d %b %Y %H:%M:%S GMT", &parts);
    cached = now;
  }
  return text;
}

// Appends a status line and the headers every response has; the caller adds its own, then "\r\n".
void start_response(std::string& out, int status, bool keep_alive, bool http10) {
  out += http10 ? "HTTP/1.0 " : "HTTP/1.1 ";
  out += std::to_string(status);
  out += ' ';
  out += http::reason_phrase(status);
  out += "\r\nServer: libfiber\r\nDate: ";
  out += http_date();
  out += "\r\n";
  if (!keep_alive) {
    out += "Connection: close\r\n";
  } else if (http10) {
    out += "Connection: keep-alive\r\n";
  }
}

void content_headers(std::string& out, std::string_view type, size_t length) {
  out += "Content-Type: ";
  out += type;
  out += "\r\nContent-Length: ";
  out += std::to_string(length);
  out += "\r\n\r\n";
}

// A short text/plain response: the status's reason phrase, or `body`.
void simple_response(std::string& out, int status, bool keep_alive, bool http10, bool head,
                     std::string_view body = {}, std::string_view extra_headers = {}) {
  std::string text = body.empty() ? std::string(http::reason_phrase(status)) + "\n" : std::string(body);
  start_response(out, status, keep_alive, http10);
  out += extra_headers;
  content_headers(out, "text/plain", text.size());
  if (!head) out += text;
}

// ------------------------------------------------------------------------------ static files

std::string_view content_type(std::string_view path) {
  const size_t dot = path.rfind('.');
  const std::string_view ext = dot == std::string_view::npos ? std::string_view{} : path.substr(dot + 1);
  static constexpr std::pair<std::string_view, std::string_view> kTypes[] = {
      {"html", "text/html; charset=utf-8"}, {"htm", "text/html; charset=utf-8"},
      {"txt", "text/plain; charset=utf-8"}, {"css", "text/css"},
      {"js", "text/javascript"},            {"json", "application/json"},
      {"png", "image/png"},                 {"jpg", "image/jpeg"},
      {"jpeg", "image/jpeg"},               {"gif", "image/gif"},
      {"svg", "image/svg+xml"},             {"ico", "image/x-icon"},
      {"wasm", "application/wasm"},
  };
  for (const auto& [e, type] : kTypes) {
    if (http::iequals(ext, e)) return type;
  }
  return "application/octet-stream";
}

// The request path below /static/, percent-decoded and checked: no "..", no NUL, no empty
// result. Returns false when it is not acceptable.
bool file_path(std::string_view encoded, std::string& out) {
  out.clear();
  auto hex = [](char h) {
    if (h >= '0' && h <= '9') return h - '0';
    h = static_cast<char>(h | 0x20);  // lower case
    return h >= 'a' && h <= 'f' ? h - 'a' + 10 : -1;
  };
  for (size_t i = 0; i < encoded.size(); ++i) {
    char c = encoded[i];
    if (c == '%') {
      if (i + 2 >= encoded.size() || hex(encoded[i + 1]) < 0 || hex(encoded[i + 2]) < 0) return false;
      c = static_cast<char>(hex(encoded[i + 1]) * 16 + hex(encoded[i + 2]));
      i += 2;
    }
    if (c == '\0') return false;
    out += c;
  }
  // Segment by segment: "." and empty segments drop out, ".." is refused outright.
  std::string clean;
  size_t start = 0;
  while (start <= out.size()) {
    const size_t slash = std::min(out.find('/', start), out.size());
    const std::string_view seg(out.data() + start, slash - start);
    if (seg == "..") return false;
    if (!seg.empty() && seg != ".") {
      if (!clean.empty()) clean += '/';
      clean += seg;
    }
    start = slash + 1;
  }
  out = clean.empty() ? "." : clean;
  return true;
}

// Opens `path` beneath the root: openat2 with RESOLVE_BENEATH, so a symbolic link cannot lead
// out of it either. -errno on failure.
int open_beneath(int root_fd, const std::string& path) {
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;  // a FIFO under the root must not block the open
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  const long fd = ::syscall(SYS_openat2, root_fd, path.c_str(), &how, sizeof how);
  return fd >= 0 ? static_cast<int>(fd) : -errno;
}

class FileGuard {
 public:
  explicit FileGuard(int fd) : fd_(fd) {}
  FileGuard(const FileGuard&) = delete;
  FileGuard& operator=(const FileGuard&) = delete;
  ~FileGuard() {
    if (fd_ >= 0) fiber::io::close(fd_);
  }
  int get() const { return fd_; }
  void reset(int fd) {
    if (fd_ >= 0) fiber::io::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// Files up to this size are read into the output buffer and leave with the response's header
// (and with other pipelined responses) in one write; larger ones are streamed in pieces.
constexpr size_t kInlineFile = 64 * 1024;
// Responses to pipelined requests are written once this much has accumulated.
constexpr size_t kFlushAt = 256 * 1024;

// Writes `out` and empties it. False when the connection failed.
bool flush(fiber::net::Stream& conn, std::string& out, milliseconds timeout) {
  const bool ok = conn.write_all(out.data(), out.size(), timeout) >= 0;
  out.clear();
  return ok;
}

// Serves /static/<rest>. Appends a small response to `out`, or flushes `out` and streams the
// file itself. Returns false when the connection failed (the caller closes it).
bool serve_file(fiber::net::Stream& conn, const Config& cfg, const http::Request& req, std::string_view rest,
                std::string& out) {
  const bool head = req.method == "HEAD";
  const bool http10 = req.minor_version == 0;
  std::string path;
  if (!file_path(rest, path)) {
    simple_response(out, 403, req.keep_alive, http10, head);
    return true;
  }
  FileGuard file(open_beneath(cfg.root_fd, path));
  struct stat st {};
  if (file.get() >= 0 && ::fstat(file.get(), &st) == 0 && S_ISDIR(st.st_mode)) {
    path += "/index.html";
    file.reset(open_beneath(cfg.root_fd, path));
  }
  if (file.get() < 0 || ::fstat(file.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    simple_response(out, file.get() == -EACCES || file.get() == -EXDEV ? 403 : 404, req.keep_alive, http10, head);
    return true;
  }
  const auto size = static_cast<size_t>(st.st_size);
  start_response(out, 200, req.keep_alive, http10);
  content_headers(out, content_type(path), size);
  if (head) return true;
  if (size <= kInlineFile) {
    const size_t at = out.size();
    out.resize(at + size);
    const ssize_t n = fiber::io::pread(file.get(), out.data() + at, size, 0);
    return n == static_cast<ssize_t>(size);  // a file that shrank under us: give up on the connection
  }
  // Large: the header (and what was pipelined before it) first, then the file in pieces.
  if (!flush(conn, out, cfg.write_timeout)) return false;
  std::vector<char> piece(256 * 1024);
  for (size_t off = 0; off < size;) {
    const ssize_t n = fiber::io::pread(file.get(), piece.data(), std::min(piece.size(), size - off), static_cast<off_t>(off));
    if (n <= 0) return false;
    if (conn.write_all(piece.data(), static_cast<size_t>(n), cfg.write_timeout) < 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// ------------------------------------------------------------------------------ connections

constexpr std::string_view kStatic = "/static/";

// The status that the method and path alone give a request: 404 for a path no route serves,
// 405 for a method its route does not take; 0 when a route answers it. The body never matters,
// so a request waiting to send one (Expect: 100-continue) can be refused before it does.
int refusal(const http::Request& req) {
  const std::string_view path = req.path();
  if (path != "/" && path != "/hello" && path.substr(0, kStatic.size()) != kStatic) return 404;
  return req.method == "GET" || req.method == "HEAD" ? 0 : 405;
}

void refuse(std::string& out, const http::Request& req, int status, bool keep_alive) {
  simple_response(out, status, keep_alive, req.minor_version == 0, req.method == "HEAD", {},
                  status == 405 ? "Allow: GET, HEAD\r\n" : "");
}

// Answers one parsed request into `out`. Returns false when the connection failed.
bool handle(fiber::net::Stream& conn, const Config& cfg, const http::Request& req, std::string& out) {
  if (const int status = refusal(req); status != 0) {
    refuse(out, req, status, req.keep_alive);
    return true;
  }
  const std::string_view path = req.path();
  if (path.substr(0, kStatic.size()) == kStatic) return serve_file(conn, cfg, req, path.substr(kStatic.size()), out);
  start_response(out, 200, req.keep_alive, req.minor_version == 0);
  content_headers(out, "text/plain", 5);
  if (req.method == "GET") out += "hello";
  return true;
}

// The empty lines (CRLF, or a bare LF) at the start of `in`. RFC 9112 2.2 lets a client send
// them before a request (some send CRLF after a body); they are no part of one.
size_t empty_lines(std::string_view in) {
  size_t n = 0;
  for (;;) {
    if (n < in.size() && in[n] == '\n') {
      n += 1;
    } else if (n + 1 < in.size() && in[n] == '\r' && in[n + 1] == '\n') {
      n += 2;
    } else {
      return n;
    }
  }
}

// How long an error response waits for the client to read it (see sample::linger_close).
constexpr milliseconds kLinger{2000};
// The input buffer's usual size. A request that does not fit doubles it (the parser's limits
// bound the growth); a buffer grown past kShrinkAbove goes back to this size once it is empty,
// so that one large request does not keep its memory for the connection's keep-alive life.
constexpr size_t kInputSize = 16 * 1024;
constexpr size_t kShrinkAbove = 64 * 1024;

void serve(fiber::net::Stream conn, const Config& cfg) {
  http::Parser parser;
  http::Request req;
  std::vector<char> in(kInputSize);
  size_t begin = 0, end = 0;  // unconsumed input is in[begin, end)
  // Whether in[begin, end) holds the start of a request: anything but nothing, or a CR whose LF
  // is still to come (the empty lines before it are dropped as they arrive, below).
  const auto under_way = [&] { return end - begin > 1 || (end - begin == 1 && in[begin] != '\r'); };
  std::string out;
  fiber::io::Deadline request_deadline;  // set when the first byte of a request arrives
  bool continued = false;  // the request being received has had its answer to Expect: 100-continue
  for (;;) {
    // Answer every complete request already read (pipelining), in order, into one buffer.
    bool answered = false, close_after = false, linger = false;
    for (;;) {
      // Empty lines between requests are dropped here rather than left to the parser, so that
      // they never count as a request under way: the connection stays idle, on the idle timeout.
      // The parser's state never covers them: begin moves only between requests, and the parser
      // is only ever given input that starts with something else.
      begin += empty_lines(std::string_view(in.data() + begin, end - begin));
      if (!under_way()) break;
      const http::Parse p = parser.parse(std::string_view(in.data() + begin, end - begin), req);
      if (p == http::Parse::kIncomplete) {
        // Expect: 100-continue (RFC 9110 10.1.1): the client waits for a word before it sends
        // the body. Once per request, as soon as the header is in: "100 Continue", or the final
        // status if the request line alone decides it. The body is then never read, so the
        // connection closes after it.
        if (parser.expects_continue() && !continued) {
          continued = true;
          if (const int status = refusal(req); status != 0) {
            refuse(out, req, status, false);
            close_after = linger = true;  // a client that sends the body anyway is not reset
          } else {
            out += "HTTP/1.1 100 Continue\r\n\r\n";
          }
        }
        break;
      }
      if (p == http::Parse::kError) {
        simple_response(out, parser.error_status(), false, false, false,
                        std::string(http::reason_phrase(parser.error_status())) + ": " + parser.error_reason() + "\n");
        close_after = linger = true;
        break;
      }
      begin += parser.consumed();
      answered = true;
      continued = false;
      if (!handle(conn, cfg, req, out)) return;
      if (!req.keep_alive) {
        close_after = true;
        break;
      }
      // Bound what one read's worth of pipelined requests can queue up.
      if (out.size() >= kFlushAt && !flush(conn, out, cfg.write_timeout)) return;
    }
    // A request that follows answered ones in the same read gets its own time from now.
    if (answered && under_way()) request_deadline = fiber::io::Deadline(cfg.request_timeout);
    if (!out.empty() && !flush(conn, out, cfg.write_timeout)) return;
    if (close_after) {
      if (linger) sample::linger_close(conn, kLinger);
      return;
    }
    parser.shrink();  // the answered requests' bodies are no longer needed

    // Read more: compact, grow if a request does not fit, and wait with the right timeout.
    if (begin == end) {
      begin = end = 0;
      if (in.size() > kShrinkAbove) std::vector<char>(kInputSize).swap(in);
    } else if (begin > 0) {
      std::memmove(in.data(), in.data() + begin, end - begin);
      end -= begin;
      begin = 0;
    }
    if (end == in.size()) in.resize(in.size() * 2);  // the parser's limits bound the growth
    const bool partial = under_way();
    const ssize_t n = conn.read(in.data() + end, in.size() - end, partial ? request_deadline : fiber::io::Deadline(cfg.idle_timeout));
    if (n == -ETIMEDOUT && partial) {
      simple_response(out, 408, false, false, false);
      flush(conn, out, milliseconds(1000));
      sample::linger_close(conn, kLinger);
      return;
    }
    if (n <= 0) return;  // closed, reset, idle too long, or cancelled by a stop
    if (!partial) request_deadline = fiber::io::Deadline(cfg.request_timeout);
    end += static_cast<size_t>(n);
  }
}

bool parse_args(int argc, char** argv, Config& cfg) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg[0] != '-') continue;  // the port (sample::port_arg)
    if (i + 1 >= argc) {
      std::fprintf(stderr, "http_server: %s needs a value\n", arg.c_str());
      return false;
    }
    const char* value = argv[++i];
    char* stop = nullptr;
    const long ms = std::strtol(value, &stop, 10);
    if (arg == "--root") {
      cfg.root = value;
    } else if ((arg == "--request-timeout" || arg == "--idle-timeout") && *stop == '\0' && ms > 0) {
      (arg == "--request-timeout" ? cfg.request_timeout : cfg.idle_timeout) = milliseconds(ms);
    } else {
      std::fprintf(stderr, "http_server: bad option %s %s (see the usage at the top of http_server.cpp)\n", arg.c_str(), value);
      return false;
    }
  }
  cfg.root_fd = ::open(cfg.root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (cfg.root_fd < 0) {
    std::fprintf(stderr, "http_server: cannot open the root directory %s: %s\n", cfg.root.c_str(), std::strerror(errno));
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  if (!parse_args(argc, argv, cfg)) return 1;
  sample::Server server("http_server", sample::port_arg(argc, argv, "8080"));
  if (!server.listening()) return 1;
  return server.run([&cfg](fiber::net::Stream conn) { serve(std::move(conn), cfg); });
}
