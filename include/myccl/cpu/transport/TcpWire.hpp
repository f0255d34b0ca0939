// The TCP transport's wire format: the frame every message on a socket starts with, what each
// kind means, the hello a new connection opens with, and which bytes of a striped message each
// lane carries. Private to src/cpu/transport/Tcp*.cpp; every rank of a group must agree on it.
//
// Messages up to the eager limit travel at once (EAGER). Larger ones announce themselves (RTS)
// and are sent when the receiver has posted a buffer (CTS, then DATA), so a receiver never
// buffers a large unexpected message and never stalls other tags behind it; a receive of
// another size refuses the announcement (NACK). Between ranks of one host the receiver answers
// an announcement by copying the message straight out of the sender's memory and says so
// (DIRECT_DONE); the sender completes its send and confirms (DIRECT_ACK), and only then does
// the receive complete. A sender that failed and may have reused its buffer never confirms,
// so a receive never completes with bytes read from a buffer that was no longer the message.
// Mid-size messages between ranks of one host may instead wait in a shared-memory slot the
// sender filled (MAILBOX: the frame names the slot). Between hosts, a large message cleared to
// send is cut into one contiguous part per data socket ("lane"), each part a STRIPE frame on
// its lane; the handshake stays on the control socket. A closing rank says why (GOODBYE).
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

namespace myccl::cpu::tcp {

constexpr uint32_t kMagic = 0x4d5943u;  // "MYC"
constexpr uint32_t kHelloMagic = 0x4d59434cu;
constexpr uint32_t kVersion = 2;
constexpr size_t kTokenBytes = 32;

enum Kind : uint32_t {
  kEager = 1,
  kRts = 2,
  kCts = 3,
  kData = 4,
  kNack = 5,
  kGoodbye = 6,
  kDirectDone = 7,  // receiver -> sender: copied your message (id: send id, tag: receive id)
  kDirectAck = 8,   // sender -> receiver: the send was still live throughout (id: receive id)
  kStripe = 9,      // on a lane: one part of a message (id: receive id, tag: part, addr: offset)
  kMailbox = 10,    // a message waiting in the sender's shared-memory slot (id: the slot)
};

// Local messages from this size up to the eager limit go through a shared-memory mailbox slot
// when one is free. Below it the socket is as fast and the slots stay free for larger ones.
constexpr size_t kMailboxMinBytes = 16 * 1024;

// Messages from this size to a peer with lanes are spread over them; each part starts on a
// page boundary of the message.
constexpr size_t kStripeMinBytes = 512 * 1024;

// A goodbye's reason is cut to this; a longer one can only come from a corrupt stream.
constexpr size_t kMaxGoodbye = 4096;

// The header of every message on a socket; its payload, if any, follows.
struct Frame {
  uint32_t magicKind;  // kMagic << 8 | kind: catches a desynchronised stream at once
  uint32_t check;      // sender's agreement word for the op (0: none)
  uint64_t tag;
  uint64_t nbytes;
  uint64_t id;
  // RTS between ranks of one host: where the message lives in the sender (0: use the socket).
  uint64_t addr;
  uint64_t pid;
  uint64_t pidNs;
};

struct Hello {
  uint32_t magic;
  uint32_t version;
  uint32_t rank;
  uint32_t size;
  uint32_t lane;   // 0: the control socket, 1..lanes: a data lane
  uint32_t lanes;  // the sender's lanes per remote peer (must match)
  char token[kTokenBytes];
};

struct HelloAck {
  uint32_t magic;
  uint32_t rank;
  uint32_t lanes;
};

// Writes what is left of a frame (header, then payload) without blocking and advances both
// offsets. Returns false with errno set when the socket failed; EAGAIN is not a failure.
inline bool writeFrameSome(int fd, char* hdr, size_t& hdrOff, size_t hdrLen, const char* payload, size_t len,
                           size_t& off) {
  for (;;) {
    iovec iov[2];
    int n = 0;
    if (hdrOff < hdrLen) iov[n++] = {hdr + hdrOff, hdrLen - hdrOff};
    if (off < len) iov[n++] = {const_cast<char*>(payload + off), len - off};
    if (n == 0) return true;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    const size_t wrote = static_cast<size_t>(w);
    const size_t h = std::min(wrote, hdrLen - hdrOff);
    hdrOff += h;
    off += wrote - h;
    if (wrote == 0) return true;
  }
}

// The part of an nbytes message that lane `part` of `parts` carries, as (offset, length): one
// contiguous run each, starting on a page boundary (the last may be short or empty). Sender and
// receiver each compute it, so it is part of the wire format.
inline std::pair<size_t, size_t> stripeRange(size_t nbytes, int parts, int part) {
  size_t piece = (nbytes + parts - 1) / parts;
  piece = (piece + 4095) / 4096 * 4096;
  const size_t off = std::min(nbytes, piece * static_cast<size_t>(part));
  return {off, std::min(piece, nbytes - off)};
}

inline std::string errnoStr(int err) {
  return std::string(strerror(err));
}

}  // namespace myccl::cpu::tcp
