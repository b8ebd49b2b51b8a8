// An HTTP/1.x request parser: plain C++, no I/O and no runtime, so it is fuzzed alone
// (tests/fuzz/fuzz_http.cpp).
//
//   http::Parser parser;                      // one per connection; limits in Parser::Limits
//   http::Request req;
//   std::string_view in = ...;               // bytes received and not yet consumed
//   switch (parser.parse(in, req)) {
//     case http::Parse::kComplete:   handle(req); in.remove_prefix(parser.consumed()); break;
//     case http::Parse::kIncomplete: read more, call parse again with the longer buffer;
//     case http::Parse::kError:      reply parser.error_status() and close the connection;
//   }
//
// What it accepts (RFC 9112): a request line `METHOD SP target SP HTTP/1.x`, header fields
// `name: value` (a name is a token; the value has leading and trailing blanks removed), lines
// ending in CRLF or a bare LF, and a body given by Content-Length or by chunked
// Transfer-Encoding (decoded; chunk extensions and trailers are skipped). An HTTP/1.1 request
// may carry `Expect: 100-continue` (see expects_continue()); HTTP/1.0 ones have Expect ignored,
// as RFC 9110 10.1.1 says. Everything else is an error with the status a server should answer:
//   400  malformed request line or header, obsolete line folding, a Content-Length that is not a
//        number or that disagrees with another, Content-Length together with Transfer-Encoding,
//        a bad chunk, HTTP/1.1 without Host
//   413  a body over Limits::max_body; or a chunked body whose framing (size lines,
//        extensions) makes it take more than max_body + max_body / 4 + 64 KiB on the wire
//   417  an HTTP/1.1 Expect field with anything but 100-continue
//   431  the request line and headers over Limits::max_header_bytes, or more than
//        Request::kMaxHeaders fields
//   501  a Transfer-Encoding other than chunked
//   505  a version other than 1.0 and 1.1
//
// The views in a Request point into the caller's buffer (the body of a chunked request into the
// Parser): they are valid until the buffer changes or the next call to parse.
//
// Cost: linear in the bytes received, however they are split. While a request is incomplete
// the parser remembers how far it got (the end-of-header search, the body framing, the chunk
// being read), so a client dribbling bytes does not make it rescan what it has seen.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace http {

struct Header {
  std::string_view name;
  std::string_view value;
};

struct Request {
  static constexpr size_t kMaxHeaders = 64;

  std::string_view method;
  std::string_view target;  // as sent: "/path?query"
  int minor_version = 1;    // HTTP/1.<minor_version>
  std::array<Header, kMaxHeaders> headers{};
  size_t header_count = 0;
  bool keep_alive = true;   // after this request (version default, overridden by Connection)
  std::string_view body;

  // The value of the first field with this name (case-insensitive), or empty.
  std::string_view header(std::string_view name) const noexcept;
  std::string_view path() const noexcept { return target.substr(0, target.find('?')); }
};

enum class Parse { kComplete, kIncomplete, kError };

class Parser {
 public:
  struct Limits {
    size_t max_header_bytes = 16 * 1024;  // request line + header fields
    size_t max_body = 1024 * 1024;
  };

  Parser() = default;
  explicit Parser(Limits limits) : limits_(limits) {}

  // Parses the request at the start of `in`. kComplete: `req` holds it and consumed() is its
  // length; kIncomplete: more bytes are needed (call again with `in` extended, same start);
  // kError: error_status() and error_reason() say why. Repeated calls on a growing buffer
  // do not rescan bytes already searched for the end of the header.
  Parse parse(std::string_view in, Request& req);

  size_t consumed() const noexcept { return consumed_; }
  // After kIncomplete: the header is complete and asks for "100 Continue", and the body has not
  // all arrived. On the call that completed the header (the first on which this holds), `req`
  // holds the request line and header fields; later kIncomplete calls leave `req` alone.
  bool expects_continue() const noexcept { return head_end_ != 0 && expect_continue_ && body_ != Body::kNone; }
  int error_status() const noexcept { return status_; }
  const char* error_reason() const noexcept { return reason_; }

  // Frees the decoded-body storage that a large chunked request grew, unless a request is being
  // received. Call it between requests, once the last request's body is no longer needed.
  void shrink();
  // Bytes of decoded-body storage held (its capacity), for tests of shrink().
  size_t retained() const noexcept { return chunked_body_.capacity(); }

 private:
  Parse fail(int status, const char* reason) noexcept {
    status_ = status;
    reason_ = reason;
    return Parse::kError;
  }
  Parse parse_request(std::string_view in, Request& req);
  Parse find_head(std::string_view in);
  Parse parse_head(std::string_view head, Request& req);
  Parse scan_chunks(std::string_view in);
  void reset_request() noexcept;
  // The chunked body's bytes on the wire so far (data and framing) are over their bound: a
  // sender of one-byte chunks with 1 KiB extensions must not make the server buffer 1000x the
  // body limit before it says no.
  bool raw_body_over_limit() const noexcept {
    return chunk_pos_ - head_end_ > limits_.max_body + limits_.max_body / 4 + 64 * 1024;
  }

  enum class Body { kNone, kLength, kChunked };
  enum class Chunk { kSize, kData, kDataEnd, kTrailer };

  Limits limits_;
  // The request being received; offsets are from the start of `in`. Reset after each request.
  size_t lead_ = 0;      // empty lines before the request line (RFC 9112 2.2 says skip them)
  size_t scanned_ = 0;   // where the search for the header's end resumes
  size_t head_end_ = 0;  // just past the blank line ending the header; 0 while unknown
  Body body_ = Body::kNone;
  size_t content_length_ = 0;
  bool expect_continue_ = false;  // an HTTP/1.1 request with Expect: 100-continue
  Chunk chunk_ = Chunk::kSize;
  size_t chunk_pos_ = 0;        // the next byte of the chunked body to look at
  size_t chunk_left_ = 0;       // bytes of the current chunk not yet copied
  size_t trailer_bytes_ = 0;
  std::string chunked_body_;    // the decoded chunked body, filled as chunks arrive

  size_t consumed_ = 0;
  int status_ = 0;
  const char* reason_ = "";
};

// The standard reason phrase of a status code ("OK", "Not Found", ...); "Unknown" otherwise.
const char* reason_phrase(int status) noexcept;

// Case-insensitive ASCII comparison (header names and tokens).
bool iequals(std::string_view a, std::string_view b) noexcept;

}  // namespace http
