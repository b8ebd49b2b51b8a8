// HTTP/1.x request parser; see http_parser.hpp for what it accepts and rejects.
#include "http_parser.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace http {
namespace {

// tchar of RFC 9110 5.6.2: the characters of a token (method, header name).
constexpr bool is_tchar(unsigned char c) noexcept {
  if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return true;
  switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-':
    case '.': case '^': case '_': case '`': case '|': case '~':
      return true;
    default:
      return false;
  }
}

// A field value may hold visible characters, blanks and obs-text; no other control character.
constexpr bool is_value_char(unsigned char c) noexcept { return c == '\t' || (c >= 0x20 && c != 0x7f); }

constexpr bool is_blank(char c) noexcept { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) noexcept {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  return s;
}

// The next line of `s` from `pos` (without its LF and a CR before it); pos moves past the LF.
// Precondition: an LF follows pos.
std::string_view next_line(std::string_view s, size_t& pos) noexcept {
  const size_t nl = s.find('\n', pos);
  std::string_view line = s.substr(pos, nl - pos);
  pos = nl + 1;
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  return line;
}

// Decimal digits only: no sign, no blanks. False when there are none, or on overflow.
bool parse_decimal(std::string_view s, size_t& out) noexcept {
  if (s.empty()) return false;
  size_t v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
    if (v > (SIZE_MAX - 9) / 10) return false;
    v = v * 10 + static_cast<size_t>(c - '0');
  }
  out = v;
  return true;
}

int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Whether a comma-separated header value (Connection) holds `token`.
bool has_token(std::string_view list, std::string_view token) noexcept {
  while (!list.empty()) {
    const size_t comma = list.find(',');
    if (iequals(trim(list.substr(0, comma)), token)) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace

bool iequals(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    char x = a[i], y = b[i];
    if (x >= 'A' && x <= 'Z') x = static_cast<char>(x - 'A' + 'a');
    if (y >= 'A' && y <= 'Z') y = static_cast<char>(y - 'A' + 'a');
    if (x != y) return false;
  }
  return true;
}

std::string_view Request::header(std::string_view name) const noexcept {
  for (size_t i = 0; i < header_count; ++i) {
    if (iequals(headers[i].name, name)) return headers[i].value;
  }
  return {};
}

void Parser::reset_request() noexcept {
  lead_ = scanned_ = head_end_ = 0;
  body_ = Body::kNone;
  content_length_ = 0;
  expect_continue_ = false;
  chunk_ = Chunk::kSize;
  chunk_pos_ = chunk_left_ = trailer_bytes_ = 0;
}

void Parser::shrink() {
  // Above this, decoded-body storage is a large request's and is not kept for the next ones.
  constexpr size_t kKeep = 64 * 1024;
  if (head_end_ == 0 && chunked_body_.capacity() > kKeep) std::string().swap(chunked_body_);
}

Parse Parser::parse(std::string_view in, Request& req) {
  consumed_ = 0;
  const Parse p = parse_request(in, req);
  if (p != Parse::kIncomplete) reset_request();  // the next call starts a new request
  return p;
}

Parse Parser::parse_request(std::string_view in, Request& req) {
  bool head_fresh = false;  // req's views were filled from `in` during this call
  if (head_end_ == 0) {
    chunked_body_.clear();
    const Parse p = find_head(in);
    if (p != Parse::kComplete) return p;
    if (parse_head(in.substr(lead_, head_end_ - lead_), req) == Parse::kError) return Parse::kError;
    head_fresh = true;
    chunk_pos_ = head_end_;
  }

  size_t end = head_end_;
  switch (body_) {
    case Body::kNone:
      break;
    case Body::kLength:
      if (in.size() - head_end_ < content_length_) return Parse::kIncomplete;
      end = head_end_ + content_length_;
      break;
    case Body::kChunked: {
      const Parse p = scan_chunks(in);
      if (p != Parse::kComplete) return p;
      end = chunk_pos_;
      break;
    }
  }
  // The header was parsed on an earlier call, into views of a buffer that may since have moved:
  // parse it again from `in` (the same bytes, so it succeeds again).
  if (!head_fresh) parse_head(in.substr(lead_, head_end_ - lead_), req);
  req.body = body_ == Body::kChunked ? std::string_view(chunked_body_) : in.substr(head_end_, end - head_end_);
  consumed_ = end;
  return Parse::kComplete;
}

Parse Parser::find_head(std::string_view in) {
  // Empty lines before the request line are skipped (a client may send CRLF after a body).
  while (lead_ < in.size()) {
    if (in[lead_] == '\n') {
      ++lead_;
    } else if (in[lead_] == '\r' && lead_ + 1 < in.size() && in[lead_ + 1] == '\n') {
      lead_ += 2;
    } else {
      break;
    }
    if (lead_ > limits_.max_header_bytes) return fail(431, "too many empty lines before the request");
  }
  // The header ends at an empty line: LF followed by LF, or by CR LF.
  size_t pos = scanned_ > lead_ ? scanned_ : lead_;
  for (;;) {
    const void* nl = pos < in.size() ? std::memchr(in.data() + pos, '\n', in.size() - pos) : nullptr;
    if (nl == nullptr) {
      scanned_ = in.size();
      break;
    }
    pos = static_cast<size_t>(static_cast<const char*>(nl) - in.data());
    if (pos + 1 >= in.size() || (in[pos + 1] == '\r' && pos + 2 >= in.size())) {
      scanned_ = pos;  // cannot tell yet: look at this LF again next time
      break;
    }
    if (in[pos + 1] == '\n' || (in[pos + 1] == '\r' && in[pos + 2] == '\n')) {
      head_end_ = pos + (in[pos + 1] == '\n' ? 2 : 3);
      if (head_end_ - lead_ > limits_.max_header_bytes) return fail(431, "request header too large");
      return Parse::kComplete;
    }
    ++pos;
  }
  if (scanned_ - lead_ > limits_.max_header_bytes) return fail(431, "request header too large");
  return Parse::kIncomplete;
}

Parse Parser::parse_head(std::string_view head, Request& req) {
  req.header_count = 0;
  req.body = {};
  size_t pos = 0;

  // Request line: method SP request-target SP HTTP-version.
  const std::string_view line = next_line(head, pos);
  const size_t sp1 = line.find(' ');
  if (sp1 == std::string_view::npos || sp1 == 0) return fail(400, "malformed request line");
  req.method = line.substr(0, sp1);
  for (const char c : req.method) {
    if (!is_tchar(static_cast<unsigned char>(c))) return fail(400, "malformed method");
  }
  const size_t sp2 = line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || sp2 == sp1 + 1) return fail(400, "malformed request line");
  req.target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  for (const char c : req.target) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) return fail(400, "malformed request target");
  }
  const std::string_view version = line.substr(sp2 + 1);
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' || version[5] < '0' ||
      version[5] > '9' || version[7] < '0' || version[7] > '9') {
    return fail(400, "malformed HTTP version");
  }
  if (version[5] != '1' || (version[7] != '0' && version[7] != '1')) return fail(505, "HTTP version not supported");
  req.minor_version = version[7] - '0';
  req.keep_alive = req.minor_version == 1;

  // Header fields.
  bool have_length = false, chunked = false, have_te = false, close = false;
  size_t hosts = 0;
  body_ = Body::kNone;
  content_length_ = 0;
  expect_continue_ = false;
  while (pos < head.size()) {
    const std::string_view field = next_line(head, pos);
    if (field.empty()) break;  // the blank line ending the header
    if (is_blank(field.front())) return fail(400, "obsolete line folding");
    const size_t colon = field.find(':');
    if (colon == std::string_view::npos || colon == 0) return fail(400, "malformed header field");
    const std::string_view name = field.substr(0, colon);
    for (const char c : name) {
      if (!is_tchar(static_cast<unsigned char>(c))) return fail(400, "malformed header field name");
    }
    const std::string_view value = trim(field.substr(colon + 1));
    for (const char c : value) {
      if (!is_value_char(static_cast<unsigned char>(c))) return fail(400, "control character in a header field");
    }
    if (req.header_count == Request::kMaxHeaders) return fail(431, "too many header fields");
    req.headers[req.header_count++] = Header{name, value};

    if (iequals(name, "content-length")) {
      size_t n = 0;
      if (!parse_decimal(value, n)) return fail(400, "malformed Content-Length");
      if (have_length && n != content_length_) return fail(400, "conflicting Content-Length fields");
      have_length = true;
      content_length_ = n;
    } else if (iequals(name, "transfer-encoding")) {
      if (have_te || !iequals(value, "chunked")) return fail(501, "unsupported Transfer-Encoding");
      have_te = chunked = true;
    } else if (iequals(name, "connection")) {
      if (has_token(value, "close")) {
        close = true;
      } else if (has_token(value, "keep-alive")) {
        req.keep_alive = true;
      }
    } else if (iequals(name, "host")) {
      ++hosts;
    } else if (iequals(name, "expect") && req.minor_version == 1) {
      // A list of expectations (RFC 9110 10.1.1), of which 100-continue is the only one defined;
      // empty members count for nothing, as in any list field.
      for (std::string_view rest = value; !rest.empty();) {
        const size_t comma = rest.find(',');
        const std::string_view member = trim(rest.substr(0, comma));
        if (iequals(member, "100-continue")) {
          expect_continue_ = true;
        } else if (!member.empty()) {
          return fail(417, "unsupported expectation");
        }
        rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      }
    }
  }
  if (req.minor_version == 1 && hosts != 1) return fail(400, hosts == 0 ? "missing Host" : "more than one Host");
  if (chunked && have_length) return fail(400, "both Content-Length and Transfer-Encoding");
  // "close" wins over "keep-alive" whatever their order; and a 1.0 request with a transfer
  // coding is answered, then the connection closes (RFC 9112 6.1: its framing is suspect).
  if (close || (chunked && req.minor_version == 0)) req.keep_alive = false;
  if (chunked) {
    body_ = Body::kChunked;
  } else if (have_length && content_length_ > 0) {
    if (content_length_ > limits_.max_body) return fail(413, "request body too large");
    body_ = Body::kLength;
  }
  return Parse::kComplete;
}

// Reads the chunked body from chunk_pos_ as far as `in` goes, copying chunk data into
// chunked_body_; kComplete once the last chunk and the trailer section have arrived.
Parse Parser::scan_chunks(std::string_view in) {
  for (;;) {
    switch (chunk_) {
      case Chunk::kSize: {
        // The size line (with any extension) may be up to kMaxChunkLine bytes, LF included.
        constexpr size_t kMaxChunkLine = 1024;
        const size_t nl = in.find('\n', chunk_pos_);
        if (nl == std::string_view::npos ? in.size() - chunk_pos_ >= kMaxChunkLine : nl - chunk_pos_ >= kMaxChunkLine) {
          return fail(400, "chunk size line too long");
        }
        if (nl == std::string_view::npos) return Parse::kIncomplete;
        size_t pos = chunk_pos_;
        std::string_view line = next_line(in, pos);
        size_t size = 0, digits = 0;
        for (; digits < line.size() && hex_value(line[digits]) >= 0; ++digits) {
          if (size > limits_.max_body) return fail(413, "request body too large");
          size = size * 16 + static_cast<size_t>(hex_value(line[digits]));
        }
        if (digits == 0) return fail(400, "malformed chunk size");
        std::string_view ext = line.substr(digits);
        while (!ext.empty() && is_blank(ext.front())) ext.remove_prefix(1);
        if (!ext.empty() && ext.front() != ';') return fail(400, "malformed chunk size");
        for (const char c : ext) {
          if (!is_value_char(static_cast<unsigned char>(c))) return fail(400, "control character in a chunk extension");
        }
        if (size > limits_.max_body - chunked_body_.size()) return fail(413, "request body too large");
        chunk_pos_ = pos;
        if (raw_body_over_limit()) return fail(413, "request body too large");
        chunk_left_ = size;
        chunk_ = size == 0 ? Chunk::kTrailer : Chunk::kData;
        break;
      }
      case Chunk::kData: {
        const size_t take = std::min(chunk_left_, in.size() - chunk_pos_);
        chunked_body_.append(in.data() + chunk_pos_, take);
        chunk_pos_ += take;
        chunk_left_ -= take;
        if (raw_body_over_limit()) return fail(413, "request body too large");
        if (chunk_left_ > 0) return Parse::kIncomplete;
        chunk_ = Chunk::kDataEnd;
        break;
      }
      case Chunk::kDataEnd:  // the CRLF (or LF) after a chunk's data
        if (chunk_pos_ >= in.size()) return Parse::kIncomplete;
        if (in[chunk_pos_] == '\n') {
          chunk_pos_ += 1;
        } else if (in[chunk_pos_] == '\r') {
          if (chunk_pos_ + 1 >= in.size()) return Parse::kIncomplete;
          if (in[chunk_pos_ + 1] != '\n') return fail(400, "chunk data not followed by CRLF");
          chunk_pos_ += 2;
        } else {
          return fail(400, "chunk data not followed by CRLF");
        }
        chunk_ = Chunk::kSize;
        break;
      case Chunk::kTrailer: {  // trailer fields are skipped; an empty line ends the message
        const size_t nl = in.find('\n', chunk_pos_);
        if (nl == std::string_view::npos) {
          if (trailer_bytes_ + (in.size() - chunk_pos_) > limits_.max_header_bytes) {
            return fail(431, "trailer section too large");
          }
          return Parse::kIncomplete;
        }
        size_t pos = chunk_pos_;
        const std::string_view line = next_line(in, pos);
        trailer_bytes_ += pos - chunk_pos_;
        if (trailer_bytes_ > limits_.max_header_bytes) return fail(431, "trailer section too large");
        chunk_pos_ = pos;
        if (line.empty()) return Parse::kComplete;
        for (const char c : line) {
          if (!is_value_char(static_cast<unsigned char>(c))) return fail(400, "control character in a trailer field");
        }
        break;
      }
    }
  }
}

const char* reason_phrase(int status) noexcept {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

}  // namespace http
