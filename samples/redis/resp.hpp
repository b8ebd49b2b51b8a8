// RESP2, the Redis protocol: an incremental request parser and the reply encoders.
//
// Plain C++ with no dependency on the fiber runtime, so the parser is fuzzed on its own
// (tests/fuzz/fuzz_resp.cpp).
//
//   resp::Parser parser;
//   std::string out;
//   // `pending` holds the bytes received and not yet consumed, starting at a command boundary.
//   for (;;) {
//     const auto r = parser.parse(pending);
//     if (r == resp::Parser::Result::kIncomplete) break;          // read more, call again
//     if (r == resp::Parser::Result::kError) {                    // reply and close the connection
//       resp::append_error(out, parser.error());
//       break;
//     }
//     run(parser.args());                                          // views into `pending`
//     pending.remove_prefix(parser.consumed());
//   }
//
// Requests come in two forms, told apart by their first byte, as Redis does:
//   multibulk  "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" - what client libraries send;
//   inline     "GET k\r\n" - a line split on whitespace, with "double" (C escapes, \xHH) and
//              'single' quoted arguments - what telnet users and redis-benchmark's PING_INLINE send.
// A multibulk count <= 0 and an empty inline line are commands with no arguments: the caller
// ignores them (Redis sends no reply either).
//
// Resumption: parse() keeps its progress through a command that is not complete yet, so a
// command arriving a byte at a time costs O(its size) in total, not O(size^2). Between calls the
// caller may move the pending bytes elsewhere (compact or grow its buffer) and append to them,
// but they must still begin with the same command; arguments are recorded as offsets and become
// views only when the command is complete.
//
// Limits (each violation is a protocol error; the server answers it and closes the connection,
// so no input makes it buffer without bound):
//   kMaxBulkLen  bytes in one argument ("$" length)          -> "invalid bulk length"
//   kMaxArgs     arguments in one command ("*" count)          -> "invalid multibulk length"
//   kMaxLine     bytes in an inline request or a count line    -> "too big inline request" /
//                                                                 "too big mbulk count string" /
//                                                                 "too big bulk count string"
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace resp {

inline constexpr std::size_t kMaxBulkLen = std::size_t{32} << 20;  // 32 MiB (Redis: 512 MiB)
inline constexpr std::size_t kMaxArgs = std::size_t{1} << 20;      // as Redis without auth
inline constexpr std::size_t kMaxLine = std::size_t{64} << 10;     // as Redis's inline limit

// Parses a decimal integer as strictly as Redis does for counts, lengths and INCR operands:
// an optional '-', then digits without a leading zero (but "0" itself), nothing else, and
// within int64_t. "-0", "+1", " 1", "01" and "" are all rejected.
bool parse_int64(std::string_view s, int64_t& out) noexcept;

class Parser {
 public:
  enum class Result { kCommand, kIncomplete, kError };

  // Parses the command at the start of `in`; see the header comment for what `in` must hold
  // from one call to the next. After kError the parser stays failed.
  Result parse(std::string_view in);

  // kCommand: the arguments (views into the `in` of that call, or into the parser for inline
  // requests with quotes), valid until the next parse() call; may be empty.
  std::span<const std::string_view> args() const noexcept { return args_; }
  // kCommand: how many bytes of `in` the command took.
  std::size_t consumed() const noexcept { return consumed_; }
  // kIncomplete: how many bytes `in` must hold before the next call can make progress (more than
  // it held); lets the caller size its buffer for a large argument in one step.
  std::size_t wanted() const noexcept { return wanted_; }
  // kError: the message, e.g. "Protocol error: invalid bulk length" (no "-ERR " prefix).
  const std::string& error() const noexcept { return error_; }

  // Frees buffers that grew for one unusually large command.
  void trim() noexcept;

 private:
  enum class Stage : std::uint8_t { kStart, kInline, kCount, kBulkHeader, kBulkData, kFailed };
  enum class Line : std::uint8_t { kFound, kIncomplete, kTooLong };

  Result parse_inline(std::string_view in);
  Result parse_multibulk(std::string_view in);
  Line find_line(std::string_view in, char end, std::size_t& at);
  Result complete(std::string_view base, std::size_t consumed);
  Result need(std::size_t bytes);
  Result fail(std::string message);

  Stage stage_ = Stage::kStart;
  std::size_t pos_ = 0;        // bytes of the current command parsed so far
  std::size_t scan_ = 0;       // where the search for the current line's end resumes
  std::size_t expected_ = 0;   // arguments the multibulk count announced
  std::size_t bulk_len_ = 0;   // length of the argument whose data is awaited
  std::vector<std::pair<std::size_t, std::size_t>> spans_;  // (offset, length) of each argument
  std::vector<std::string_view> args_;
  std::string unquoted_;       // inline arguments after quote and escape processing
  std::size_t consumed_ = 0;
  std::size_t wanted_ = 0;
  std::string error_;
};

// Reply encoders: each appends one RESP2 value to `out`.
void append_simple(std::string& out, std::string_view s);  // +OK
void append_error(std::string& out, std::string_view s);   // -ERR ...; CR/LF become spaces
void append_integer(std::string& out, int64_t v);           // :42
void append_bulk(std::string& out, std::string_view s);    // $3\r\nabc
void append_null(std::string& out);                         // $-1 (nil)
void append_array(std::string& out, std::size_t n);         // *n, then n values
// A request as clients send it: a multibulk array of bulk strings.
void append_command(std::string& out, std::span<const std::string_view> args);

}  // namespace resp
