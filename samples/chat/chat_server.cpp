// chat_server: a line-based TCP chat room, built the Go way: one hub fiber owns the room, and
// every connection talks to it through channels.
//
//   build/release/samples/chat/chat_server [PORT]    (default 6667; $PORT also; 0: any free port)
//   nc 127.0.0.1 6667                                 (a client; several, to see them talk)
//
// Once it accepts connections it prints "chat_server: listening on 127.0.0.1:PORT with N
// processors" on stderr. SIGTERM or SIGINT ends it with status 0: every member gets
// "* server shutting down", then the connections close.
//
// Protocol. Lines end with "\n" (a "\r" before it is dropped); lines from the server start with
// "* " when the server itself speaks.
//   on connect            the client gets "* welcome <nick>" with a generated nick "user<N>";
//                         the others get "* <nick> joined"
//   /nick NAME            renames: NAME is 1-32 characters of A-Z a-z 0-9 _ -. Everyone, the
//                         renamer included, gets "* <old> is now <new>"; a name in use or an
//                         invalid one gets "* error: ..." (to the sender only)
//   /who                  "* members: <nick>, <nick>, ..." (in order of arrival), to the sender
//   /quit                 "* bye" to the sender, then the server closes the connection
//   another /word         "* error: unknown command ..."
//   an empty line         ignored
//   any other line        "<nick>: <line>" to every other member (never back to the sender)
//   a line over 4096 bytes (not counting "\r\n"), or one containing a NUL byte:
//                         "* error: ..." to the sender, then the server closes the connection
// When a member goes, the others get "* <nick> left", or "* <nick> was disconnected (too slow)"
// (see below). Bytes after the last "\n" when a client closes are dropped. Idle members are never
// timed out.
//
// Architecture:
//   hub     one fiber owns the member table (nicks, outgoing queues); nothing else touches it,
//           so it needs no lock. It waits in a select over three channels: joins (from the
//           accept loop), leaves and messages (from the readers). The accept loop closing the
//           join channel is the signal to shut down.
//   reader  one fiber per connection: splits the input into lines, handles /quit and malformed
//           input itself and sends every other line to the hub.
//   writer  one fiber per connection: drains the member's own bounded queue of outgoing lines
//           (a Channel<std::string>) into the socket. The hub closes the queue to end it.
// The hub never blocks on a member: it delivers with try_send, and a member whose queue is full
// (it stopped reading: first its socket buffers filled up, then its queue) is disconnected as
// too slow, so a stuck client never holds up the room.
#include <fiber/fiber.hpp>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/server.hpp"

namespace {

using namespace std::chrono_literals;

constexpr std::size_t kMaxLine = 4096;  // bytes in a line from a client, without the "\r\n"
constexpr std::size_t kMaxNick = 32;
// Outgoing lines queued for a member before it counts as too slow: room for a burst in which a
// thousand members each say something at once. With lines at the maximum length that is at most
// about 4 MiB per member.
constexpr std::size_t kQueueLines = 1024;
// A writer sends whatever is queued, up to this much, in one write.
constexpr std::size_t kWriteBatch = 64 * 1024;
// How long a closing connection waits for its last lines (a farewell, an error) to go out, and
// then for the client to close its end. A stop waits for the connections still closing, so it
// can take up to about twice this long when a client neither reads nor closes.
constexpr auto kLinger = 3s;

using Outbox = fiber::Channel<std::string>;

struct Join {
  std::uint64_t id = 0;
  int fd = -1;  // for shutdown(2) only: the connection's reader owns it and closes it after its Leave
  std::shared_ptr<Outbox> out;
};
struct Leave {
  std::uint64_t id = 0;
  std::string farewell;  // a last line for the leaving member ("": none)
};
struct Message {
  std::uint64_t id = 0;
  std::string text;  // a whole line without its "\r\n"
};

bool valid_nick(std::string_view name) {
  if (name.empty() || name.size() > kMaxNick) return false;
  for (const char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// The room. Connections talk to it only through the three channels; run() is the hub fiber.
class Hub {
 public:
  // Unbuffered on purpose: a send returns once the hub has taken the value, and the hub handles
  // each value completely before it selects again. So a member's join, its lines and its leave
  // reach the hub in the order they happened, although select picks at random among the
  // channels that are ready.
  fiber::Channel<Join> joins;  // closed by the accept loop when it stops: time to shut down
  fiber::Channel<Leave> leaves;
  fiber::Channel<Message> messages;

  void run() {
    for (;;) {
      std::optional<Join> join;
      std::optional<Leave> leave;
      std::optional<Message> message;
      const std::size_t chosen = fiber::select(fiber::recv_case(joins, join), fiber::recv_case(leaves, leave),
                                               fiber::recv_case(messages, message));
      if (chosen == 0 && !join) break;  // joins closed: no connection will come any more
      if (join) admit(std::move(*join));
      if (leave) depart(std::move(*leave));
      if (message) handle(std::move(*message));
      disconnect_slow();
    }
    shut_down();
  }

 private:
  static constexpr std::uint64_t kNobody = 0;  // connection ids start at 1

  struct Member {
    std::string nick;
    int fd = -1;
    std::shared_ptr<Outbox> out;
    bool slow = false;  // its queue overflowed; disconnected at the end of the current step
  };

  void admit(Join j) {
    ++connections_;
    std::string nick;
    do {
      nick = "user" + std::to_string(next_nick_++);
    } while (nicks_.contains(nick));  // someone may have renamed themselves "user<N>"
    nicks_.insert(nick);
    Member& m = members_.emplace(j.id, Member{nick, j.fd, std::move(j.out)}).first->second;
    deliver(j.id, m, "* welcome " + nick);
    broadcast("* " + nick + " joined", j.id);
  }

  void depart(Leave l) {
    --connections_;
    const auto it = members_.find(l.id);
    if (it == members_.end()) return;  // the hub disconnected it already
    if (!l.farewell.empty()) deliver(l.id, it->second, l.farewell);
    const std::string nick = remove(it);
    broadcast("* " + nick + " left", kNobody);
  }

  void handle(Message msg) {
    const auto it = members_.find(msg.id);
    if (it == members_.end()) return;  // disconnected by the hub; its reader has not noticed yet
    Member& m = it->second;
    const std::string_view text = msg.text;
    if (!text.starts_with('/')) {
      broadcast(m.nick + ": " + msg.text, msg.id);
      return;
    }
    const std::size_t space = text.find(' ');
    const std::string_view command = text.substr(0, space);
    const std::string_view arg = space == std::string_view::npos ? std::string_view() : text.substr(space + 1);
    if (command == "/nick") {
      rename(msg.id, m, arg);
    } else if (command == "/who") {
      std::string who = "* members:";
      const char* separator = " ";
      for (const auto& entry : members_) {
        who.append(separator).append(entry.second.nick);
        separator = ", ";
      }
      deliver(msg.id, m, who);
    } else {
      deliver(msg.id, m, "* error: unknown command " + std::string(command) + " (try /nick NAME, /who, /quit)");
    }
  }

  void rename(std::uint64_t id, Member& m, std::string_view name) {
    if (!valid_nick(name)) {
      deliver(id, m, "* error: invalid nick (use 1-32 characters of A-Z a-z 0-9 _ -)");
    } else if (name == m.nick) {
      deliver(id, m, "* error: you are already " + m.nick);
    } else if (nicks_.contains(name)) {
      deliver(id, m, "* error: nick " + std::string(name) + " is taken");
    } else {
      nicks_.erase(m.nick);
      nicks_.emplace(name);
      const std::string old = std::exchange(m.nick, std::string(name));
      broadcast("* " + old + " is now " + m.nick, kNobody);
    }
  }

  // Queues a line for one member, never waiting: a full queue marks the member as too slow.
  void deliver(std::uint64_t id, Member& m, std::string_view text) {
    if (m.slow) return;
    std::string line;
    line.reserve(text.size() + 1);
    line.append(text).push_back('\n');
    if (!m.out->try_send(std::move(line))) {
      m.slow = true;
      slow_.push_back(id);
    }
  }

  void broadcast(const std::string& text, std::uint64_t except) {
    for (auto& [id, m] : members_) {
      if (id != except) deliver(id, m, text);
    }
  }

  // Disconnects the members whose queue overflowed. Announcing that can overflow another
  // member's queue, hence the loop.
  void disconnect_slow() {
    while (!slow_.empty()) {
      const auto it = members_.find(slow_.back());
      slow_.pop_back();
      if (it == members_.end()) continue;  // left meanwhile
      std::fprintf(stderr, "chat_server: disconnecting %s: too slow (%zu lines queued)\n", it->second.nick.c_str(),
                   kQueueLines);
      // Ends the writer's stuck write and the reader's read; the reader then leaves as usual.
      ::shutdown(it->second.fd, SHUT_RDWR);
      const std::string nick = remove(it);
      broadcast("* " + nick + " was disconnected (too slow)", kNobody);
    }
  }

  // Takes a member out of the room and closes its queue, which ends its writer once the lines
  // queued so far are written. Returns its nick.
  std::string remove(std::map<std::uint64_t, Member>::iterator it) {
    std::string nick = std::move(it->second.nick);
    it->second.out->close();
    nicks_.erase(nick);
    members_.erase(it);
    return nick;
  }

  void shut_down() {
    // Say goodbye, and end each reader by shutting its socket's read side: each then leaves.
    // Even a client that keeps sending cannot keep its reader going: once the read side is shut,
    // Linux TCP no longer opens the receive window, and a read returns end of stream as soon as
    // what was already let in has been read. Writers still write what is queued (the goodbye)
    // before their queue's end.
    for (auto& [id, m] : members_) {
      deliver(id, m, "* server shutting down");
      m.out->close();
      ::shutdown(m.fd, SHUT_RD);
    }
    members_.clear();
    nicks_.clear();
    slow_.clear();
    // Take every remaining leave (and drop the lines that still come in), so that no reader
    // stays blocked in a send to a hub that is gone.
    while (connections_ > 0) {
      std::optional<Leave> leave;
      std::optional<Message> ignored;
      if (fiber::select(fiber::recv_case(leaves, leave), fiber::recv_case(messages, ignored)) == 0) --connections_;
    }
  }

  std::map<std::uint64_t, Member> members_;  // by connection id, so in order of arrival
  std::set<std::string, std::less<>> nicks_;
  std::vector<std::uint64_t> slow_;  // members marked slow and not yet disconnected
  std::uint64_t next_nick_ = 1;
  // Connections that joined and have not left yet: the members, plus those the hub disconnected
  // whose reader has not noticed yet.
  std::size_t connections_ = 0;
};

// Splits the input into lines and hands them to the hub until the client closes, quits or
// breaks the protocol. Returns the farewell line for the client ("" for none).
std::string read_lines(fiber::net::Stream& conn, Hub& hub, std::uint64_t id) {
  const std::string overlong = "* error: line longer than " + std::to_string(kMaxLine) + " bytes";
  std::string pending;  // bytes received after the last "\n"
  char buf[16384];
  for (;;) {
    const ssize_t n = conn.read(buf, sizeof buf);
    if (n <= 0) return {};  // closed, reset, or shut down by the hub
    pending.append(buf, static_cast<std::size_t>(n));
    std::size_t start = 0;
    for (std::size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string_view line(pending.data() + start, nl - start);
      if (line.ends_with('\r')) line.remove_suffix(1);
      if (line.size() > kMaxLine) return overlong;
      if (line.find('\0') != std::string_view::npos) return "* error: line contains a NUL byte";
      if (line == "/quit") return "* bye";
      if (!line.empty()) hub.messages.send(Message{id, std::string(line)});
    }
    pending.erase(0, start);
    // Refuse a line as soon as it is too long, rather than buffer it until its "\n" comes
    // (+ 1: a "\r" may still come before the "\n").
    if (pending.size() > kMaxLine + 1) return overlong;
  }
}

// Writes the member's queued lines to the socket until the hub closes the queue.
void write_lines(fiber::net::Stream& conn, Outbox& out) {
  bool connected = true;
  std::string batch;
  while (std::optional<std::string> line = out.recv()) {
    batch = std::move(*line);
    // Take what else is queued already: a busy room costs one write per wake-up, not per line.
    while (batch.size() < kWriteBatch) {
      auto more = out.try_recv();
      if (!more) break;
      batch += *more;
    }
    if (connected && conn.write_all(batch.data(), batch.size()) < 0) {
      connected = false;
      conn.shutdown(SHUT_RDWR);  // so that the reader notices too, and leaves
    }
    // Gone or not, keep draining until the hub closes the queue: a full queue would make the
    // hub report a departed client as a slow one.
  }
}

// One connection, from its join (already sent by the accept loop) to its close.
void serve(fiber::net::Stream conn, Hub& hub, std::uint64_t id, std::shared_ptr<Outbox> out) {
  auto writer = fiber::spawn([&conn, out] { write_lines(conn, *out); });
  std::string farewell = read_lines(conn, hub, id);
  hub.leaves.send(Leave{id, std::move(farewell)});
  // The hub has taken the leave, so it closes the queue (if it has not already) after queueing
  // the farewell, and never touches this socket again. Wait for the writer to write the last
  // lines, but not forever: a client that does not read has its connection cut.
  if (!writer.wait_for(kLinger)) conn.shutdown(SHUT_RDWR);
  writer.join();
  sample::linger_close(conn, kLinger);  // the farewell must not be lost to a reset
}  // ~Stream closes the socket

// Accepts connections until the listener is closed. Returns true when that was a requested stop,
// false on an unexpected error.
bool accept_loop(fiber::net::Listener& ln, const std::atomic<bool>& stopping, Hub& hub) {
  std::uint64_t next_id = 1;
  for (;;) {
    auto conn = ln.accept();
    if (stopping) return true;
    if (conn) {
      const std::uint64_t id = next_id++;
      auto out = std::make_shared<Outbox>(kQueueLines);
      // Joined here, before the reader runs: once the accept loop closes the join channel, every
      // connection it accepted has joined.
      hub.joins.send(Join{id, conn->fd(), out});
      go [&hub, id, out = std::move(out), c = std::move(*conn)]() mutable { serve(std::move(c), hub, id, std::move(out)); };
      continue;
    }
    switch (sample::classify_accept_error(conn.error())) {
      case sample::AcceptFailure::kRetry:
        break;
      case sample::AcceptFailure::kPause:  // out of descriptors, or one client's network trouble
        fiber::this_fiber::sleep_for(sample::kAcceptPause);
        break;
      case sample::AcceptFailure::kFatal:
        std::fprintf(stderr, "chat_server: %s\n", conn.message().c_str());
        return false;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // SIGTERM/SIGINT are taken by a thread of ours. The stop differs from samples/common's
  // sample::Server, which cancels every connection: here the hub says goodbye first.
  sigset_t stop_signals = sample::block_stop_signals();
  sample::raise_nofile_limit();
  auto ln = fiber::net::Listener::listen("127.0.0.1:" + sample::port_arg(argc, argv, "6667"));
  if (!ln) {
    std::fprintf(stderr, "chat_server: %s\n", ln.message().c_str());
    return 1;
  }
  // Our own scheduler ($FIBER_PROCS processors, else one per core) rather than the global one,
  // which is never destroyed: this one stops and joins its threads when main returns.
  fiber::Scheduler scheduler({.name = "chat"});
  std::fprintf(stderr, "chat_server: listening on 127.0.0.1:%u with %zu processors\n", ln->port(),
               scheduler.processors());

  std::atomic<bool> stopping{false};
  std::thread signals([&stop_signals, &stopping, listen_fd = ln->fd()] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    stopping = true;
    // Ends the accept waiting on it (and any later one) with EINVAL. Only the system call: the
    // Listener object is the accept loop's, and main closes it.
    ::shutdown(listen_fd, SHUT_RDWR);
  });
  Hub hub;  // outlives every fiber: block_on returns once all of them have ended
  const bool stopped = fiber::block_on({.scheduler = &scheduler}, [&] {
    go [&hub] { hub.run(); };
    const bool requested = accept_loop(*ln, stopping, hub);
    hub.joins.close();  // the hub says goodbye, and ends once every connection has closed
    return requested;
  });
  // After an accept error the signal thread still waits: hand it the signal it waits for.
  if (!stopped) pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  return stopped ? 0 : 1;
}
