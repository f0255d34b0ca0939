// The records TcpTransport keeps: a queued send, a posted receive, a message that arrived
// before its receive, everything per peer (send queue, handshakes in flight, the read state
// machine) and per lane. Private to src/cpu/transport/Tcp*.cpp.
#pragma once

#include "myccl/cpu/transport/Tcp.hpp"
#include "myccl/cpu/transport/TcpWire.hpp"

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace myccl::cpu {

struct TcpTransport::SendItem {
  Frame hdr{};
  size_t hdrOff = 0;
  const char* data = nullptr;
  size_t nbytes = 0;
  size_t off = 0;
  RequestPtr req;  // completed when fully written; null for control frames

  // A frame without payload (CTS, NACK, DIRECT_DONE, DIRECT_ACK).
  static std::unique_ptr<SendItem> control(uint32_t kind, uint64_t id, uint64_t tag = 0, uint64_t nbytes = 0) {
    auto item = std::make_unique<SendItem>();
    item->hdr.magicKind = tcp::kMagic << 8 | kind;
    item->hdr.id = id;
    item->hdr.tag = tag;
    item->hdr.nbytes = nbytes;
    return item;
  }
};

// A posted receive; matching reads its Posting part (tag, peer or peers).
struct TcpTransport::PostedRecv : Posting {
  RequestPtr req;
  uint32_t check = 0;
  char* data = nullptr;
  size_t nbytes = 0;
};

// A message that arrived before its receive; matching reads its Arrival part (tag, whether all
// its bytes are here).
struct TcpTransport::Unexpected : Arrival {
  Frame hdr{};  // as it came: size, agreement word, send id or slot, where a direct copy reads
  std::vector<char> data;  // an eager payload
  std::shared_ptr<PostedRecv> waiter;  // matched while its payload was still arriving
};

struct TcpTransport::Peer {
  int fd = -1;
  std::string addr;
  bool dead = false;
  // Its connection ended without a goodbye while this side was open: the process died (or its
  // host or network did). Not set for a peer that closed orderly or said it failed.
  bool vanished = false;
  std::string deadReason;
  // Send side (under mu_).
  std::deque<std::unique_ptr<SendItem>> sendq;
  bool wantOut = false;
  struct PendingRts {
    RequestPtr req;
    const char* data;
    size_t nbytes;
  };
  std::unordered_map<uint64_t, PendingRts> awaitingCts;
  // Announced sends their owner withdrew (cancel) before the answer came: an answer to one of
  // these is dropped, never acted on (its buffer may be gone).
  std::unordered_set<uint64_t> withdrawn;
  // Receive side (under mu_; receives and messages still unmatched are in match_).
  std::unordered_map<uint64_t, std::shared_ptr<PostedRecv>> activeRecvs;  // awaiting DATA
  // Receives being copied directly from the sender's memory, then awaiting its DIRECT_ACK.
  std::unordered_map<uint64_t, std::shared_ptr<PostedRecv>> directRecvs;
  bool direct = false;  // large messages from this peer may be copied directly
  int64_t eagerBytes = 0;  // messages to this peer up to this size are sent at once
  int64_t mailboxBytes = 0;  // from kMailboxMinBytes up to this size: through a mailbox slot
  // Read state machine (epoll thread only; targets are fixed under mu_ at header time).
  Frame hdr{};
  size_t hdrGot = 0;
  bool inPayload = false;
  char* target = nullptr;
  size_t targetLen = 0;
  size_t targetGot = 0;
  std::shared_ptr<PostedRecv> readingFor;
  std::shared_ptr<Unexpected> readingUnexpected;
  bool discarding = false;
  std::vector<char> sink;
  bool readingGoodbye = false;
  bool goodbyeIsFailure = false;
  bool orderlyGoodbye = false;  // the peer said it shuts down normally
  bool lanesBroken = false;  // a data socket to it failed (some message can no longer be whole)
  std::string goodbye;

  // The frame just read is followed by `n` payload bytes, for `dst`.
  void readPayload(char* dst, size_t n) {
    target = dst;
    targetLen = n;
    inPayload = true;
  }
  // ... for nobody: read into the sink and forgotten.
  void discardPayload(size_t n) {
    discarding = true;
    if (sink.empty()) sink.resize(1 << 16);
    targetLen = n;
    inPayload = true;
  }
};

// One message spread over the lanes; each lane moves one contiguous part of it.
struct TcpTransport::Stripes {
  RequestPtr req;
  char* data = nullptr;  // the receive's destination, or the send's source
  size_t nbytes = 0;
  std::atomic<int> left{0};  // parts not yet fully moved
};

struct TcpTransport::Part {
  Frame hdr{};
  size_t hdrOff = 0;
  size_t off = 0, len = 0, moved = 0;
  std::shared_ptr<Stripes> st;
};

struct TcpTransport::Lane {
  int index = 0;
  // Held by the lane's thread while it works (its system calls read and write user buffers),
  // and taken after mu_ when both are needed, never the other way round: once peerFailedLocked
  // has dropped a peer's parts under it, no lane touches that peer's buffers again.
  std::mutex mu;
  // New work, handed over under a lock held only for a push: the epoll thread (holding mu_)
  // must never wait for a lane's system call.
  std::mutex intakeMu;
  std::vector<std::pair<int, Part>> newParts;  // (peer, part to send)
  std::vector<std::tuple<int, uint64_t, std::shared_ptr<Stripes>>> newRecvs;  // (peer, receive id, message)
  int epfd = -1;
  int wakeFd = -1;
  std::thread thread;
  struct Conn {
    int fd = -1;
    std::deque<Part> out;
    bool wantOut = false;
    std::unordered_map<uint64_t, std::shared_ptr<Stripes>> expected;  // receive id -> message
    Frame hdr{};
    size_t hdrGot = 0;
    std::shared_ptr<Stripes> in;  // the message whose part is being read
    uint64_t inId = 0;
    size_t inOff = 0, inLen = 0, inGot = 0;
    bool ended = false;  // the peer closed this socket between messages
  };
  std::vector<Conn> conns;  // by peer
};

}  // namespace myccl::cpu
