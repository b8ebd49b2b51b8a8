// Fuzz target of the RESP2 request parser (samples/redis/resp.hpp), differential:
//
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Isamples/redis
//     tests/fuzz/fuzz_resp.cpp samples/redis/resp.cpp -o /tmp/fuzz_resp
//   /tmp/fuzz_resp -max_total_time=60 tests/fuzz/corpus/resp      (or tools/fuzz.sh resp)
//
// The input is a byte stream as a server would receive it. It is parsed three ways with the
// caller's protocol of resp.hpp (pending bytes from a command boundary, consumed ones dropped):
//   whole      all bytes at once;
//   split      the bytes up to a point derived from the data first, then all of them;
//   trickle    one more byte per call (inputs up to 1 KiB).
// Each call gets the pending bytes in a fresh heap copy of exactly their size, so a read past
// the end is an AddressSanitizer report and a view kept from an earlier call would dangle (the
// parser must keep offsets, not pointers, across calls). The three runs must give the same
// commands, the same error and stop at the same byte. Beyond that, every command re-encoded with
// append_command must parse back to itself, and every argument that parse_int64 accepts must
// print back to its own spelling (one spelling per integer). Any difference aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "resp.hpp"

namespace {

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "fuzz_resp: check failed at line %d: %s\n", __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

struct Outcome {
  std::vector<std::vector<std::string>> commands;
  bool failed = false;
  std::string error;
  std::size_t consumed = 0;  // bytes taken by complete commands
};

bool same(const Outcome& a, const Outcome& b) {
  return a.commands == b.commands && a.failed == b.failed && a.error == b.error && a.consumed == b.consumed;
}

// A fresh allocation of exactly s's size, so ASan sees reads past the end.
std::unique_ptr<char[]> exact_copy(std::string_view s) {
  auto p = std::make_unique<char[]>(s.size() + (s.empty() ? 1 : 0));
  if (!s.empty()) std::memcpy(p.get(), s.data(), s.size());
  return p;
}

void check_round_trip(const std::vector<std::string>& args) {
  std::vector<std::string_view> views(args.begin(), args.end());
  std::string encoded;
  resp::append_command(encoded, views);
  resp::Parser p;
  const auto copy = exact_copy(encoded);
  FUZZ_CHECK(p.parse({copy.get(), encoded.size()}) == resp::Parser::Result::kCommand);
  FUZZ_CHECK(p.consumed() == encoded.size());
  FUZZ_CHECK(p.args().size() == args.size());
  for (std::size_t i = 0; i < args.size(); ++i) FUZZ_CHECK(p.args()[i] == args[i]);
  for (const auto& a : args) {
    int64_t v = 0;
    if (!resp::parse_int64(a, v)) continue;
    std::string printed;
    resp::append_integer(printed, v);
    FUZZ_CHECK(printed == ":" + a + "\r\n");
  }
}

// Parses `data`, offering it up to each of `stops` in turn (increasing; the last is its size).
Outcome run(std::string_view data, const std::vector<std::size_t>& stops) {
  resp::Parser parser;
  Outcome o;
  for (const std::size_t stop : stops) {
    while (!o.failed) {
      const std::string_view pending = data.substr(o.consumed, stop - o.consumed);
      const auto copy = exact_copy(pending);
      const std::string_view in(copy.get(), pending.size());
      const auto r = parser.parse(in);
      if (r == resp::Parser::Result::kIncomplete) {
        FUZZ_CHECK(parser.wanted() > in.size());
        break;
      }
      if (r == resp::Parser::Result::kError) {
        o.failed = true;
        o.error = parser.error();
        FUZZ_CHECK(o.error.rfind("Protocol error: ", 0) == 0);
        FUZZ_CHECK(parser.parse(in) == resp::Parser::Result::kError);  // stays failed
        break;
      }
      FUZZ_CHECK(parser.consumed() > 0 && parser.consumed() <= in.size());
      std::vector<std::string> args;
      for (const auto a : parser.args()) {
        FUZZ_CHECK(a.size() <= resp::kMaxBulkLen);
        args.emplace_back(a);
      }
      FUZZ_CHECK(args.size() <= resp::kMaxArgs);
      o.commands.push_back(std::move(args));
      o.consumed += parser.consumed();
    }
  }
  return o;
}

void check_encoders(std::string_view data) {
  // An error reply is one line whatever the message holds.
  std::string out;
  resp::append_error(out, data);
  FUZZ_CHECK(out.size() == data.size() + 3 && out[0] == '-');
  FUZZ_CHECK(out.find_first_of("\r\n") == out.size() - 2);
  // A bulk reply carries its bytes unchanged, after its length.
  out.clear();
  resp::append_bulk(out, data);
  const std::string header = "$" + std::to_string(data.size()) + "\r\n";
  FUZZ_CHECK(out.size() == header.size() + data.size() + 2);
  FUZZ_CHECK(out.compare(0, header.size(), header) == 0);
  FUZZ_CHECK(out.compare(header.size(), data.size(), data) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::string_view data(reinterpret_cast<const char*>(bytes), size);

  const Outcome whole = run(data, {size});

  // The split point: a hash of the bytes, so that the fuzzer explores it along with the data.
  uint64_t h = 1469598103934665603ull;
  for (const char c : data) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  const std::size_t cut = size == 0 ? 0 : static_cast<std::size_t>(h % (size + 1));
  const Outcome split = run(data, {cut, size});
  FUZZ_CHECK(same(whole, split));

  if (size <= 1024) {
    std::vector<std::size_t> stops;
    for (std::size_t i = 1; i <= size; ++i) stops.push_back(i);
    if (stops.empty()) stops.push_back(0);
    FUZZ_CHECK(same(whole, run(data, stops)));
  }

  for (const auto& args : whole.commands) check_round_trip(args);
  check_encoders(data.substr(0, 1024));
  return 0;
}
