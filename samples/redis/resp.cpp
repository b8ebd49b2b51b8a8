// RESP2 request parser and reply encoders; see resp.hpp.
#include "resp.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>

namespace resp {

bool parse_int64(std::string_view s, int64_t& out) noexcept {
  // 20 characters hold "-9223372036854775808"; anything longer cannot fit.
  if (s.empty() || s.size() > 20) return false;
  const bool negative = s[0] == '-';
  std::size_t i = negative ? 1 : 0;
  if (i == s.size()) return false;
  if (s[i] == '0') {
    // Only "0" itself: Redis refuses leading zeros and "-0", so each integer has one spelling.
    if (s.size() != 1) return false;
    out = 0;
    return true;
  }
  uint64_t v = 0;
  for (; i < s.size(); ++i) {
    const auto digit = static_cast<unsigned>(static_cast<unsigned char>(s[i]) - '0');
    if (digit > 9) return false;
    if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10) return false;
    v = v * 10 + digit;
  }
  constexpr auto kMax = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (negative) {
    if (v > kMax + 1) return false;
    out = v == kMax + 1 ? std::numeric_limits<int64_t>::min() : -static_cast<int64_t>(v);
  } else {
    if (v > kMax) return false;
    out = static_cast<int64_t>(v);
  }
  return true;
}

Parser::Result Parser::parse(std::string_view in) {
  if (stage_ == Stage::kFailed) return Result::kError;
  if (stage_ == Stage::kStart) {
    if (in.empty()) return need(1);
    spans_.clear();
    pos_ = 0;
    scan_ = 0;
    stage_ = in[0] == '*' ? Stage::kCount : Stage::kInline;
  }
  return stage_ == Stage::kInline ? parse_inline(in) : parse_multibulk(in);
}

// Looks for `end` in the line that starts at pos_, at most kMaxLine bytes in. The search resumes
// where the previous call for the same line stopped, so a line trickling in byte by byte is
// scanned once. The verdict depends only on the bytes in that window, never on how much of the
// input had arrived when the search ran.
Parser::Line Parser::find_line(std::string_view in, char end, std::size_t& at) {
  const std::size_t limit = std::min(in.size(), pos_ + kMaxLine);
  const std::size_t from = std::max(scan_, pos_);
  if (from < limit) {
    const void* p = std::memchr(in.data() + from, end, limit - from);
    if (p != nullptr) {
      at = static_cast<std::size_t>(static_cast<const char*>(p) - in.data());
      return Line::kFound;
    }
  }
  scan_ = std::max(scan_, limit);
  return in.size() - pos_ >= kMaxLine ? Line::kTooLong : Line::kIncomplete;
}

Parser::Result Parser::parse_multibulk(std::string_view in) {
  for (;;) {
    switch (stage_) {
      case Stage::kCount: {
        std::size_t cr = 0;
        const Line line = find_line(in, '\r', cr);
        if (line == Line::kTooLong) return fail("Protocol error: too big mbulk count string");
        if (line == Line::kIncomplete) return need(in.size() + 1);
        if (cr + 1 >= in.size()) {
          scan_ = cr;  // found again next time, once the byte after it is here
          return need(cr + 2);
        }
        int64_t n = 0;
        if (in[cr + 1] != '\n' || !parse_int64(in.substr(pos_ + 1, cr - pos_ - 1), n) ||
            n > static_cast<int64_t>(kMaxArgs)) {
          return fail("Protocol error: invalid multibulk length");
        }
        pos_ = cr + 2;
        if (n <= 0) return complete(in, pos_);  // "*0" and "*-1": nothing to run, as in Redis
        expected_ = static_cast<std::size_t>(n);
        // Grown as arguments arrive, not from the announced count: "*1000000" alone costs nothing.
        spans_.reserve(std::min<std::size_t>(expected_, 64));
        stage_ = Stage::kBulkHeader;
        break;
      }
      case Stage::kBulkHeader: {
        if (pos_ >= in.size()) return need(pos_ + 1);
        if (in[pos_] != '$') {
          return fail(std::string("Protocol error: expected '$', got '") + in[pos_] + "'");
        }
        std::size_t cr = 0;
        const Line line = find_line(in, '\r', cr);
        if (line == Line::kTooLong) return fail("Protocol error: too big bulk count string");
        if (line == Line::kIncomplete) return need(in.size() + 1);
        if (cr + 1 >= in.size()) {
          scan_ = cr;
          return need(cr + 2);
        }
        int64_t len = 0;
        if (in[cr + 1] != '\n' || !parse_int64(in.substr(pos_ + 1, cr - pos_ - 1), len) || len < 0 ||
            len > static_cast<int64_t>(kMaxBulkLen)) {
          return fail("Protocol error: invalid bulk length");
        }
        pos_ = cr + 2;
        bulk_len_ = static_cast<std::size_t>(len);
        stage_ = Stage::kBulkData;
        break;
      }
      case Stage::kBulkData: {
        // The two bytes after the data are the CRLF; like Redis, they are skipped unread (the
        // length already says where the argument ends).
        if (in.size() - pos_ < bulk_len_ + 2) return need(pos_ + bulk_len_ + 2);
        spans_.emplace_back(pos_, bulk_len_);
        pos_ += bulk_len_ + 2;
        if (spans_.size() == expected_) return complete(in, pos_);
        stage_ = Stage::kBulkHeader;
        break;
      }
      default:
        return fail("Protocol error: internal parser state");
    }
  }
}

namespace {

bool is_space(char c) noexcept { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

char unescape(char c) noexcept {
  switch (c) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'b': return '\b';
    case 'a': return '\a';
    default: return c;
  }
}

// Splits an inline request into arguments, appending their bytes to `out` and their (offset,
// length) to `spans`. Words are separated by whitespace; a quote starts a quoted part (also in
// the middle of a word, as redis-cli and Redis accept it): "..." takes \n \r \t \b \a \xHH and
// \<any>, '...' takes \' only. A closing quote must end the word. False: unbalanced quotes.
bool split_inline(std::string_view line, std::string& out, std::vector<std::pair<std::size_t, std::size_t>>& spans) {
  std::size_t i = 0;
  for (;;) {
    while (i < line.size() && is_space(line[i])) ++i;
    if (i == line.size()) return true;
    const std::size_t start = out.size();
    char quote = 0;  // the quote we are inside of, or 0
    for (;;) {
      if (i == line.size()) {
        if (quote != 0) return false;  // unterminated
        break;
      }
      const char c = line[i];
      if (quote == 0) {
        if (is_space(c)) break;
        if (c == '"' || c == '\'') {
          quote = c;
        } else {
          out += c;
        }
        ++i;
      } else if (c == quote) {
        ++i;
        if (i < line.size() && !is_space(line[i])) return false;  // "ab"c
        break;
      } else if (c == '\\' && i + 1 < line.size()) {
        const char next = line[i + 1];
        if (quote == '\'') {
          out += next == '\'' ? '\'' : '\\';
          i += next == '\'' ? 2 : 1;
        } else if (next == 'x' && i + 3 < line.size() && hex_value(line[i + 2]) >= 0 && hex_value(line[i + 3]) >= 0) {
          out += static_cast<char>(hex_value(line[i + 2]) * 16 + hex_value(line[i + 3]));
          i += 4;
        } else {
          out += unescape(next);
          i += 2;
        }
      } else {
        out += c;
        ++i;
      }
    }
    spans.emplace_back(start, out.size() - start);
  }
}

}  // namespace

Parser::Result Parser::parse_inline(std::string_view in) {
  std::size_t nl = 0;
  const Line line = find_line(in, '\n', nl);
  if (line == Line::kTooLong) return fail("Protocol error: too big inline request");
  if (line == Line::kIncomplete) return need(in.size() + 1);
  std::string_view text = in.substr(0, nl);
  if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
  // Redis splits the line as a C string: a NUL byte ends it.
  text = text.substr(0, text.find('\0'));
  // Unquoting never makes the text longer: with this reserve, `unquoted_` does not reallocate.
  unquoted_.clear();
  unquoted_.reserve(text.size());
  if (!split_inline(text, unquoted_, spans_)) return fail("Protocol error: unbalanced quotes in request");
  return complete(unquoted_, nl + 1);
}

Parser::Result Parser::complete(std::string_view base, std::size_t consumed) {
  args_.resize(spans_.size());
  for (std::size_t i = 0; i < spans_.size(); ++i) args_[i] = base.substr(spans_[i].first, spans_[i].second);
  consumed_ = consumed;
  stage_ = Stage::kStart;
  return Result::kCommand;
}

Parser::Result Parser::need(std::size_t bytes) {
  wanted_ = bytes;
  return Result::kIncomplete;
}

Parser::Result Parser::fail(std::string message) {
  error_ = std::move(message);
  stage_ = Stage::kFailed;
  return Result::kError;
}

void Parser::trim() noexcept {
  constexpr std::size_t kKeep = 1024;
  if (spans_.capacity() > kKeep && spans_.size() <= kKeep) {
    spans_.shrink_to_fit();
  }
  if (args_.capacity() > kKeep && args_.size() <= kKeep) args_.shrink_to_fit();
  if (unquoted_.capacity() > 16 * kKeep && stage_ == Stage::kStart) std::string().swap(unquoted_);
}

// ---- replies ----

namespace {

// "<prefix><n>\r\n" in one append.
void append_header(std::string& out, char prefix, int64_t n) {
  char buf[24];
  buf[0] = prefix;
  char* end = std::to_chars(buf + 1, buf + sizeof buf - 2, n).ptr;
  *end++ = '\r';
  *end++ = '\n';
  out.append(buf, static_cast<std::size_t>(end - buf));
}

}  // namespace

void append_simple(std::string& out, std::string_view s) {
  out += '+';
  out += s;
  out += "\r\n";
}

void append_error(std::string& out, std::string_view s) {
  // An error is one line: a CR or LF inside it (an echoed argument, say) would end the reply
  // early and desynchronise the client, so they become spaces, as Redis does.
  const std::size_t at = out.size();
  out += '-';
  out += s;
  std::replace_if(out.begin() + static_cast<std::ptrdiff_t>(at), out.end(), [](char c) { return c == '\r' || c == '\n'; }, ' ');
  out += "\r\n";
}

void append_integer(std::string& out, int64_t v) { append_header(out, ':', v); }

void append_bulk(std::string& out, std::string_view s) {
  append_header(out, '$', static_cast<int64_t>(s.size()));
  out += s;
  out += "\r\n";
}

void append_null(std::string& out) { out += "$-1\r\n"; }

void append_array(std::string& out, std::size_t n) { append_header(out, '*', static_cast<int64_t>(n)); }

void append_command(std::string& out, std::span<const std::string_view> args) {
  append_array(out, args.size());
  for (const auto a : args) append_bulk(out, a);
}

}  // namespace resp
