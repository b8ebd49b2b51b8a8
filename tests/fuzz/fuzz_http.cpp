// Fuzz target of the HTTP request parser (samples/http/http_parser.hpp).
//
// Differential: the input is parsed as a stream of pipelined requests twice, once whole and once
// fed in pieces whose sizes come from the input's own bytes (so the buffer grows and moves
// between calls, as a server's does), and both runs must produce the same requests, the same
// error and the same leftover. Each parsed request must also keep the parser's promises: it
// consumes at least one byte and no more than it was given, its body is within the limit, and
// every view points into the buffer (or the parser's decoded body).
//
//   tools/fuzz.sh http                   libFuzzer, for a bounded time
//   build/<preset>/tests/fuzz/fuzz_replay_http tests/fuzz/corpus/http   (ctest: fuzz_replay_http)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "http_parser.hpp"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_http: %s\n", what);
  std::abort();
}

// Small limits, so that inputs of fuzzer size reach them.
constexpr http::Parser::Limits kLimits{512, 2048};

// One line per event: a request's fields, or the error status, or the unparsed leftover.
std::vector<std::string> parse_stream(std::string_view data, std::string_view piece_sizes) {
  http::Parser parser(kLimits);
  http::Request req;
  std::vector<std::string> events;
  std::string buf;  // what has "arrived"; grows (and may move) as pieces are fed
  size_t fed = 0, start = 0, next_piece = 0;
  auto feed = [&] {
    size_t n = data.size() - fed;
    if (!piece_sizes.empty()) {
      n = std::min<size_t>(n, 1 + static_cast<unsigned char>(piece_sizes[next_piece++ % piece_sizes.size()]) % 64);
    }
    buf.append(data.substr(fed, n));
    fed += n;
  };
  feed();
  for (;;) {
    const std::string_view in = std::string_view(buf).substr(start);
    const http::Parse p = parser.parse(in, req);
    if (p == http::Parse::kComplete) {
      if (parser.consumed() == 0 || parser.consumed() > in.size()) fail("consumed out of range");
      if (req.body.size() > kLimits.max_body) fail("body over the limit");
      if (req.header_count > http::Request::kMaxHeaders) fail("too many headers");
      const auto inside = [&](std::string_view v) { return v.empty() || (v.data() >= in.data() && v.data() + v.size() <= in.data() + parser.consumed()); };
      if (!inside(req.method) || !inside(req.target)) fail("request line view outside the request");
      std::string e = "request " + std::string(req.method) + " " + std::string(req.target) + " 1." +
                      std::to_string(req.minor_version) + (req.keep_alive ? " keep-alive" : " close");
      for (size_t i = 0; i < req.header_count; ++i) {
        if (!inside(req.headers[i].name) || !inside(req.headers[i].value)) fail("header view outside the request");
        e += "|" + std::string(req.headers[i].name) + ":" + std::string(req.headers[i].value);
      }
      e += "|body=" + std::string(req.body);
      events.push_back(std::move(e));
      start += parser.consumed();
      continue;
    }
    if (p == http::Parse::kError) {
      if (parser.error_status() < 400 || parser.error_status() > 599) fail("error status out of range");
      events.push_back("error " + std::to_string(parser.error_status()) + " " + parser.error_reason());
      return events;
    }
    if (fed == data.size()) {
      events.push_back("incomplete " + std::to_string(buf.size() - start));
      return events;
    }
    feed();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  // The last up to 8 bytes double as the piece sizes of the split run (they are parsed as data
  // too, in both runs).
  const std::string_view pieces = input.substr(input.size() - std::min<size_t>(8, input.size()));
  const auto whole = parse_stream(input, {});
  const auto split = parse_stream(input, pieces.empty() ? std::string_view("\x01") : pieces);
  if (whole != split) {
    for (size_t i = 0; i < std::max(whole.size(), split.size()); ++i) {
      std::fprintf(stderr, "whole: %s\nsplit: %s\n", i < whole.size() ? whole[i].c_str() : "-",
                   i < split.size() ? split[i].c_str() : "-");
    }
    fail("whole and split parses differ");
  }
  return 0;
}
