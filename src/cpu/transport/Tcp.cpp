// TCP transport. Setup builds a full mesh (lower rank accepts, higher rank connects) where
// every connection must present the group's secret before it is kept. After setup one epoll
// thread reads every socket; sends are written by the posting thread when the socket is idle
// and by the epoll thread otherwise. Messages up to eagerBytes travel at once; larger ones
// announce themselves (RTS) and are sent when the receiver has posted a buffer (CTS), so a
// receiver never buffers a large unexpected message and never stalls other tags behind it.
// Between ranks of one host the receiver answers an announcement by copying the message
// straight out of the sender's memory (process_vm_readv: one copy instead of two through the
// kernel's socket buffers) and says so (DIRECT_DONE); the sender completes its send and
// confirms (DIRECT_ACK), and only then does the receive complete. A sender that failed and
// may have reused its buffer never confirms, so a receive never completes with bytes read
// from a buffer that was no longer the message. Where the kernel refuses (ptrace policy,
// other pid namespace) the transfer falls back to the socket. Mid-size messages between ranks
// of one host go through a shared-memory mailbox slot instead when one is free (MAILBOX: the
// frame announces a slot the sender has filled; the receiver copies it out and frees it).
// Between hosts, a message from kStripeMinBytes is cut into one contiguous part per lane: extra
// data sockets to that peer, each read and written by its own thread (one TCP stream is bound
// to about one core's worth of kernel work). The handshake stays on the control socket; the
// receive completes when every lane has delivered its part.
#include <pthread.h>
#include "myccl/cpu/transport/Tcp.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "myccl/Log.hpp"

#include <cerrno>
#include <cstring>
#include <sstream>

namespace myccl::cpu {

namespace {

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

// Writes what is left of a frame (header, then payload) without blocking and advances both
// offsets. Returns false with errno set when the socket failed; EAGAIN is not a failure.
bool writeFrameSome(int fd, char* hdr, size_t& hdrOff, size_t hdrLen, const char* payload, size_t len,
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

std::pair<size_t, size_t> stripeRange(size_t nbytes, int parts, int part) {
  size_t piece = (nbytes + parts - 1) / parts;
  piece = (piece + 4095) / 4096 * 4096;
  const size_t off = std::min(nbytes, piece * static_cast<size_t>(part));
  return {off, std::min(piece, nbytes - off)};
}
constexpr size_t kMaxGoodbye = 4096;

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

std::string lanesMismatch(int peer, uint32_t theirs, int mine) {
  return "rank " + std::to_string(peer) + " spreads large messages over " + std::to_string(std::max(1u, theirs)) +
         " sockets per peer and this rank over " + std::to_string(std::max(1, mine)) +
         ": set MYCCL_SOCKETS_PER_PEER to the same value on every rank";
}

std::string errnoStr(int err) {
  return std::string(strerror(err));
}

void setNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Blocking full read/write with a deadline, used only during setup.
bool ioFull(int fd, void* buf, size_t n, bool writing, Deadline deadline) {
  char* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0};
    int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (pr < 0 && errno != EINTR) return false;
    if (pr <= 0) continue;
    ssize_t r = writing ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return false;
    }
    done += static_cast<size_t>(r);
  }
  return true;
}

std::string mismatchText(int peer, uint32_t theirs, uint32_t mine) {
  char buf[320];
  snprintf(buf, sizeof(buf),
           "rank %d sent data for a different variant of this op (agreement word %08x, this rank %08x): "
           "the ranks disagree about its dtype, reduce op or element count",
           peer, theirs, mine);
  return buf;
}

bool constantTimeEqual(const char* a, const char* b, size_t n) {
  unsigned char diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string formatAddr(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
  port = ntohs(in6->sin6_port);
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

// "1.2.3.4:5" or "[::1]:5" -> sockaddr
bool parseAddr(const std::string& s, sockaddr_storage& out, socklen_t& len) {
  std::string host, port;
  if (!s.empty() && s[0] == '[') {
    auto close = s.find(']');
    if (close == std::string::npos || close + 2 > s.size()) return false;
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == std::string::npos) return false;
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return false;
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}

}  // namespace

struct TcpTransport::Frame {
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
    item->hdr.magicKind = kMagic << 8 | kind;
    item->hdr.id = id;
    item->hdr.tag = tag;
    item->hdr.nbytes = nbytes;
    return item;
  }
};

struct TcpTransport::PostedRecv {
  RequestPtr req;
  std::vector<int> anyOf;  // non-empty for receive-from-any
  uint64_t tag = 0;
  uint32_t check = 0;
  char* data = nullptr;
  size_t nbytes = 0;
  uint64_t order = 0;
};

struct TcpTransport::Unexpected {
  uint64_t tag = 0;
  uint32_t check = 0;
  bool rts = false;
  uint64_t sendId = 0;
  size_t nbytes = 0;
  Frame announced{};  // the announcement (for a direct copy)
  std::vector<char> data;
  bool complete = false;
  int mailboxSlot = -1;  // >= 0: the payload waits in the sender's shared-memory slot
  uint64_t order = 0;
  std::shared_ptr<PostedRecv> waiter;  // matched while its payload was still arriving
};

struct TcpTransport::Peer {
  int fd = -1;
  std::string addr;
  bool dead = false;
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
  // Receive side (under mu_).
  std::deque<std::shared_ptr<PostedRecv>> posted;
  std::deque<std::shared_ptr<Unexpected>> unexpected;
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

TcpTransport::TcpTransport(c10d::Store& store, const std::string& keyPrefix, TcpSetup setup,
                           const std::string& token)
    : setup_(std::move(setup)) {
  peers_.resize(setup_.size);
  for (auto& p : peers_) p = std::make_unique<Peer>();
  struct stat ns {};
  if (::stat("/proc/self/ns/pid", &ns) == 0) pidNs_ = static_cast<uint64_t>(ns.st_ino);
  for (int r = 0; r < setup_.size; ++r) {
    auto& p = *peers_[r];
    p.direct = r != setup_.rank && r < static_cast<int>(setup_.directPeers.size()) && setup_.directPeers[r] &&
               pidNs_ != 0;
    // A direct copy takes three messages through sleeping threads (announce, done, ack): for
    // a peer on this host the socket's extra copy is cheaper up to a few hundred KiB.
    p.eagerBytes = p.direct ? std::max(setup_.eagerBytes, setup_.localEagerBytes) : setup_.eagerBytes;
    if (setup_.mailbox && setup_.mailbox->reaches(r)) {
      // Up to that size such a message goes through a shared-memory slot when one is free. One
      // that finds none is sent at once only if it is small: a larger one is announced and
      // copied directly, which holds the sender back until the receiver has caught up (a
      // loopback socket moves it at a third of that speed).
      p.mailboxBytes = std::min<int64_t>(p.eagerBytes, static_cast<int64_t>(setup_.mailbox->slotBytes()));
      p.eagerBytes = setup_.eagerBytes;
    }
  }
  laneCount_ = setup_.socketsPerPeer >= 2 ? setup_.socketsPerPeer : 0;
  bool anyRemote = false;
  for (int r = 0; r < setup_.size; ++r) anyRemote |= hasLanes(r);
  for (int j = 0; anyRemote && j < laneCount_; ++j) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->index = j;
    lanes_.back()->conns.resize(setup_.size);
  }
  connectMesh(store, keyPrefix, token);
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  wakeFd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MYCCL_CHECK(epfd_ >= 0 && wakeFd_ >= 0, "tcp transport: epoll/eventfd: ", errnoStr(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u32 = UINT32_MAX;
  epoll_ctl(epfd_, EPOLL_CTL_ADD, wakeFd_, &ev);
  for (int r = 0; r < setup_.size; ++r) {
    if (r == setup_.rank) continue;
    auto& p = *peers_[r];
    setNonBlocking(p.fd, true);
    setNoDelay(p.fd);
    epoll_event pev{};
    pev.events = EPOLLIN;
    pev.data.u32 = static_cast<uint32_t>(r);
    epoll_ctl(epfd_, EPOLL_CTL_ADD, p.fd, &pev);
  }
  for (auto& lanePtr : lanes_) {
    Lane& lane = *lanePtr;
    lane.epfd = epoll_create1(EPOLL_CLOEXEC);
    lane.wakeFd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    MYCCL_CHECK(lane.epfd >= 0 && lane.wakeFd >= 0, "tcp transport: lane epoll/eventfd: ", errnoStr(errno));
    epoll_event wev{};
    wev.events = EPOLLIN;
    wev.data.u32 = UINT32_MAX;
    epoll_ctl(lane.epfd, EPOLL_CTL_ADD, lane.wakeFd, &wev);
    for (int r = 0; r < setup_.size; ++r) {
      const int fd = lane.conns[r].fd;
      if (fd < 0) continue;
      setNonBlocking(fd, true);
      setNoDelay(fd);
      epoll_event pev{};
      pev.events = EPOLLIN;
      pev.data.u32 = static_cast<uint32_t>(r);
      epoll_ctl(lane.epfd, EPOLL_CTL_ADD, fd, &pev);
    }
  }
  try {
    io_ = std::thread([this] { ioLoop(); });
    pthread_setname_np(io_.native_handle(), "myccl-tcp-io");
    for (auto& lanePtr : lanes_) {
      Lane& lane = *lanePtr;
      lane.thread = std::thread([this, &lane] { laneLoop(lane); });
      const std::string name = "myccl-tcp-ln" + std::to_string(lane.index);
      pthread_setname_np(lane.thread.native_handle(), name.c_str());
    }
  } catch (const std::exception& e) {  // no threads to be had: stop those that started, tell peers
    close(std::string("could not start the TCP transport's threads: ") + e.what(), true);
    throw;
  }
}

bool TcpTransport::hasLanes(int peer) const {
  if (laneCount_ == 0 || peer == setup_.rank) return false;
  return !(peer < static_cast<int>(setup_.directPeers.size()) && setup_.directPeers[peer]);
}

bool TcpTransport::striped(int peer, size_t nbytes) const {
  return nbytes >= kStripeMinBytes && hasLanes(peer) && !lanes_.empty();
}

TcpTransport::~TcpTransport() {
  close("transport destroyed");
}

void TcpTransport::connectMesh(c10d::Store& store, const std::string& keyPrefix,
                               const std::string& token) {
  const int rank = setup_.rank, size = setup_.size;
  setup_.peerAddresses.assign(size, "");
  if (size == 1) return;
  MYCCL_CHECK(token.size() == kTokenBytes, "tcp transport: bad group secret length");
  const Deadline deadline = Clock::now() + setup_.timeout;

  // Listen on the chosen interface only.
  sockaddr_storage bindAddr{};
  socklen_t bindLen = 0;
  MYCCL_CHECK(parseAddr(setup_.bindAddress + ":0", bindAddr, bindLen) ||
                  parseAddr("[" + setup_.bindAddress + "]:0", bindAddr, bindLen),
              "tcp transport (rank ", rank, "): cannot parse listen address '", setup_.bindAddress, "'");
  int lfd = ::socket(bindAddr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MYCCL_CHECK(lfd >= 0, "tcp transport (rank ", rank, "): socket(): ", errnoStr(errno));
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&bindAddr), bindLen) != 0 || ::listen(lfd, size + 64) != 0) {
    int err = errno;
    ::close(lfd);
    MYCCL_CHECK(false, "tcp transport (rank ", rank, "): cannot listen on ", setup_.bindAddress, ": ",
                errnoStr(err), " (set MYCCL_SOCKET_IFNAME to pick another interface)");
  }
  sockaddr_storage actual{};
  socklen_t alen = sizeof(actual);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&actual), &alen);
  const std::string myAddr = formatAddr(actual);
  setup_.peerAddresses[rank] = myAddr;
  store.set(keyPrefix + "addr/" + std::to_string(rank), std::vector<uint8_t>(myAddr.begin(), myAddr.end()));

  // The socket for (peer, lane): lane 0 is the control socket, 1..laneCount_ the data lanes.
  auto slot = [&](int peer, uint32_t lane) -> int& {
    return lane == 0 ? peers_[peer]->fd : lanes_[lane - 1]->conns[peer].fd;
  };
  auto socketsTo = [&](int peer) { return 1 + (hasLanes(peer) && !lanes_.empty() ? laneCount_ : 0); };

  // Accept from lower ranks on a helper thread while this thread connects to higher ranks,
  // so the mesh forms in one round instead of a chain.
  std::string acceptError;
  std::thread acceptor([&] {
    int needed = 0;
    for (int r = 0; r < rank; ++r) needed += socketsTo(r);
    while (needed > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      pollfd pfd{lfd, POLLIN, 0};
      int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 200)));
      if (pr <= 0) continue;
      sockaddr_storage from{};
      socklen_t flen = sizeof(from);
      int fd = ::accept4(lfd, reinterpret_cast<sockaddr*>(&from), &flen, SOCK_CLOEXEC);
      if (fd < 0) continue;
      const std::string fromStr = formatAddr(from);
      Hello h{};
      Deadline helloDeadline = std::min(deadline, Clock::now() + std::chrono::seconds(5));
      bool ok = ioFull(fd, &h, sizeof(h), false, helloDeadline);
      std::string why;
      if (!ok) {
        why = "no complete hello within 5 s";
      } else if (h.magic != kHelloMagic || h.version != kVersion) {
        why = "not a myccl peer of this version (bad magic/version)";
      } else if (static_cast<int>(h.size) != size || static_cast<int>(h.rank) >= rank) {
        why = "claims rank " + std::to_string(h.rank) + " of " + std::to_string(h.size);
      } else if (!constantTimeEqual(h.token, token.data(), kTokenBytes)) {
        why = "wrong group secret";
      } else if (h.lanes == static_cast<uint32_t>(laneCount_) &&
                 h.lane >= static_cast<uint32_t>(socketsTo(static_cast<int>(h.rank)))) {
        why = "claims lane " + std::to_string(h.lane) + " of rank " + std::to_string(h.rank);
      } else if (h.lanes == static_cast<uint32_t>(laneCount_) && slot(static_cast<int>(h.rank), h.lane) >= 0) {
        why = "duplicate connection for rank " + std::to_string(h.rank);
      }
      if (!why.empty()) {
        ::close(fd);
        rejected_.fetch_add(1);
        log(LogLevel::Warning, "rank " + std::to_string(rank) + " rejected a connection from " + fromStr + ": " + why);
        continue;
      }
      HelloAck ack{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(laneCount_)};
      if (!ioFull(fd, &ack, sizeof(ack), true, deadline)) {
        ::close(fd);
        continue;
      }
      if (h.lanes != static_cast<uint32_t>(laneCount_)) {  // a genuine peer, configured differently
        ::close(fd);
        acceptError = lanesMismatch(static_cast<int>(h.rank), h.lanes, laneCount_);
        return;
      }
      slot(static_cast<int>(h.rank), h.lane) = fd;
      if (h.lane == 0) peers_[h.rank]->addr = fromStr;
      --needed;
    }
    if (needed > 0) {
      std::ostringstream os;
      os << "ranks";
      for (int r = 0; r < rank; ++r) {
        bool all = true;
        for (int l = 0; l < socketsTo(r); ++l) all &= slot(r, l) >= 0;
        if (!all) os << " " << r;
      }
      os << " never connected";
      acceptError = os.str();
    }
  });

  std::string connectError;
  if (setup_.connectDelay.count() > 0) std::this_thread::sleep_for(setup_.connectDelay);
  for (int peer = rank + 1; peer < size && connectError.empty(); ++peer) {
    std::string addr;
    try {
      auto v = store.get(keyPrefix + "addr/" + std::to_string(peer));
      addr.assign(v.begin(), v.end());
    } catch (const std::exception& e) {
      connectError = "rank " + std::to_string(peer) + " never published its address: " + e.what();
      break;
    }
    setup_.peerAddresses[peer] = addr;
    sockaddr_storage sa{};
    socklen_t salen = 0;
    if (!parseAddr(addr, sa, salen)) {
      connectError = "rank " + std::to_string(peer) + " published a bad address '" + addr + "'";
      break;
    }
    for (int lane = 0; lane < socketsTo(peer) && connectError.empty(); ++lane) {
      int lastErr = 0;
      int fd = -1;
      auto backoff = std::chrono::milliseconds(10);
      while (Clock::now() < deadline) {
        fd = ::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&sa), salen) == 0) break;
        lastErr = errno;
        if (fd >= 0) ::close(fd);
        fd = -1;
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      }
      if (fd < 0) {
        connectError = "cannot connect to rank " + std::to_string(peer) + " at " + addr + ": " +
                       errnoStr(lastErr ? lastErr : ETIMEDOUT) +
                       " (is the address reachable from this host? set MYCCL_SOCKET_IFNAME)";
        break;
      }
      Hello h{kHelloMagic, kVersion, static_cast<uint32_t>(rank), static_cast<uint32_t>(size),
              static_cast<uint32_t>(lane), static_cast<uint32_t>(laneCount_), {}};
      std::memcpy(h.token, token.data(), kTokenBytes);
      HelloAck ack{};
      if (!ioFull(fd, &h, sizeof(h), true, deadline) || !ioFull(fd, &ack, sizeof(ack), false, deadline) ||
          ack.magic != kHelloMagic || static_cast<int>(ack.rank) != peer) {
        ::close(fd);
        connectError = "handshake with rank " + std::to_string(peer) + " at " + addr +
                       " failed (peer closed the connection or is not part of this group)";
        break;
      }
      if (ack.lanes != static_cast<uint32_t>(laneCount_)) {
        ::close(fd);
        connectError = lanesMismatch(peer, ack.lanes, laneCount_);
        break;
      }
      slot(peer, lane) = fd;
    }
    peers_[peer]->addr = addr;
  }
  if (!connectError.empty()) {
    // Unblock the acceptor early: nothing will succeed now.
    ::shutdown(lfd, SHUT_RDWR);
  }
  acceptor.join();
  ::close(lfd);
  if (!connectError.empty() || !acceptError.empty()) {
    for (int r = 0; r < size; ++r)
      for (int l = 0; l < socketsTo(r); ++l)
        if (r != rank && slot(r, l) >= 0) ::close(slot(r, l)), slot(r, l) = -1;
    throwDistError("myccl: rank " + std::to_string(rank) + " could not connect its TCP mesh within " +
                   std::to_string(setup_.timeout.count()) + " ms: " +
                   (connectError.empty() ? acceptError : connectError));
  }
}

void TcpTransport::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(wakeFd_, &one, sizeof(one));
  (void)r;
}

RequestPtr TcpTransport::isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check) {
  auto req = std::make_shared<Request>(peer, tag, nbytes);
  std::vector<std::function<void()>> done;
  // A local message that fits a free shared-memory slot is copied there now, outside the lock
  // (the send is then complete as far as the caller's buffer goes); the frame announces it.
  auto& mb = setup_.mailbox;
  int slot = -1;
  if (nbytes >= kMailboxMinBytes && static_cast<int64_t>(nbytes) <= peers_[peer]->mailboxBytes)
    slot = mb->put(peer, data, nbytes);
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& p = *peers_[peer];
    if (closed_ || p.dead) {
      if (slot >= 0) mb->unclaim(peer, slot);
      req->fail(closed_ ? CommErrorKind::Aborted : CommErrorKind::PeerGone,
                closed_ ? closeReason_ : p.deadReason, peer);
      return req;
    }
    auto item = std::make_unique<SendItem>();
    item->hdr.tag = tag;
    item->hdr.nbytes = nbytes;
    item->hdr.check = check;
    if (slot >= 0) {
      item->hdr.magicKind = kMagic << 8 | kMailbox;
      item->hdr.id = static_cast<uint64_t>(slot);
      item->req = req;
      req->setVia("mailbox");
    } else if (static_cast<int64_t>(nbytes) <= p.eagerBytes) {
      item->hdr.magicKind = kMagic << 8 | kEager;
      item->data = static_cast<const char*>(data);
      item->nbytes = nbytes;
      item->req = req;
    } else {
      uint64_t id = nextId_++;
      item->hdr.magicKind = kMagic << 8 | kRts;
      item->hdr.id = id;
      if (p.direct) {
        item->hdr.addr = reinterpret_cast<uintptr_t>(data);
        item->hdr.pid = static_cast<uint64_t>(::getpid());
        item->hdr.pidNs = pidNs_;
      }
      p.awaitingCts.emplace(id, Peer::PendingRts{req, static_cast<const char*>(data), nbytes});
    }
    pushSend(peer, std::move(item), done);
  }
  for (auto& f : done) f();
  return req;
}

RequestPtr TcpTransport::irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check) {
  auto pr = std::make_shared<PostedRecv>();
  pr->req = std::make_shared<Request>(peer, tag, nbytes);
  pr->tag = tag;
  pr->check = check;
  pr->data = static_cast<char*>(data);
  pr->nbytes = nbytes;
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pr->order = nextId_++;
    if (closed_) {
      pr->req->fail(CommErrorKind::Aborted, closeReason_, peer);
      return pr->req;
    }
    matchPostedLocked(pr, done);
  }
  for (auto& f : done) f();
  return pr->req;
}

RequestPtr TcpTransport::irecvAny(const std::vector<int>& peers, uint64_t tag, void* data, size_t nbytes) {
  auto pr = std::make_shared<PostedRecv>();
  pr->req = std::make_shared<Request>(-1, tag, nbytes);
  pr->anyOf = peers;
  pr->tag = tag;
  pr->data = static_cast<char*>(data);
  pr->nbytes = nbytes;
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pr->order = nextId_++;
    if (closed_) {
      pr->req->fail(CommErrorKind::Aborted, closeReason_, -1);
      return pr->req;
    }
    matchPostedLocked(pr, done);
  }
  for (auto& f : done) f();
  return pr->req;
}

// A receive was just posted: take the oldest matching unexpected message, if any.
void TcpTransport::matchPostedLocked(const std::shared_ptr<PostedRecv>& pr,
                                     std::vector<std::function<void()>>& done) {
  int bestPeer = -1;
  std::deque<std::shared_ptr<Unexpected>>::iterator best;
  auto consider = [&](int peer) {
    auto& p = *peers_[peer];
    for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
      if ((*it)->tag == pr->tag) {
        if (bestPeer < 0 || (*it)->order < (*best)->order) {
          bestPeer = peer;
          best = it;
        }
        return;
      }
    }
  };
  if (pr->anyOf.empty()) {
    consider(pr->req->peer());
  } else {
    for (int peer : pr->anyOf) consider(peer);
  }
  if (bestPeer < 0) {
    if (pr->anyOf.empty()) {
      auto& p = *peers_[pr->req->peer()];
      if (p.dead) {
        auto req = pr->req;
        auto why = p.deadReason;
        int peer = pr->req->peer();
        done.push_back([req, why, peer] { req->fail(CommErrorKind::PeerGone, why, peer); });
        return;
      }
      p.posted.push_back(pr);
    } else {
      bool anyAlive = false;
      for (int peer : pr->anyOf) anyAlive |= !peers_[peer]->dead;
      if (!anyAlive) {
        auto req = pr->req;
        done.push_back([req] { req->fail(CommErrorKind::PeerGone, "every peer of this receive-from-any is gone", -1); });
        return;
      }
      anyRecvs_.push_back(pr);
    }
    return;
  }
  auto& p = *peers_[bestPeer];
  std::shared_ptr<Unexpected> u = *best;
  p.unexpected.erase(best);
  auto req = pr->req;
  if (u->nbytes != pr->nbytes || (u->check && pr->check && u->check != pr->check)) {
    std::string msg = u->nbytes != pr->nbytes
                          ? "message from rank " + std::to_string(bestPeer) + " has " + std::to_string(u->nbytes) +
                                " bytes but the receive expects " + std::to_string(pr->nbytes)
                          : mismatchText(bestPeer, u->check, pr->check);
    int peer = bestPeer;
    done.push_back([req, msg, peer] { req->fail(CommErrorKind::Protocol, msg, peer); });
    if (u->rts) {
      pushSend(bestPeer, SendItem::control(kNack, u->sendId, 0, pr->nbytes), done);
    }
    if (u->mailboxSlot >= 0) setup_.mailbox->drop(bestPeer, u->mailboxSlot);
    return;
  }
  if (u->rts) {
    grantLocked(bestPeer, pr, u->sendId, u->announced, done);
    return;
  }
  if (u->mailboxSlot >= 0) {
    takeFromMailboxLocked(bestPeer, u->mailboxSlot, pr, done);
    return;
  }
  if (!u->complete) {
    u->waiter = pr;  // the epoll thread finishes it when the payload is in
    return;
  }
  if (!u->data.empty()) std::memcpy(pr->data, u->data.data(), u->data.size());
  int src = bestPeer;
  done.push_back([req, src] { req->complete(src); });
}

// An announced message meets its receive: copy it directly when the peer shares this host
// and the kernel lets us, else clear the sender to send it over the socket.
void TcpTransport::grantLocked(int peer, const std::shared_ptr<PostedRecv>& pr, uint64_t sendId, const Frame& rts,
                               std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  const uint64_t recvId = nextId_++;
  if (p.direct && rts.addr != 0 && rts.pidNs == pidNs_ && pidNs_ != 0) {
    p.directRecvs.emplace(recvId, pr);
    const uint64_t addr = rts.addr, pid = rts.pid;
    done.push_back([this, peer, recvId, pr, sendId, addr, pid] { directCopy(peer, recvId, pr, sendId, addr, pid); });
    return;
  }
  if (striped(peer, pr->nbytes)) {
    stripeRecvLocked(peer, recvId, pr);
  } else {
    p.activeRecvs.emplace(recvId, pr);
  }
  pushSend(peer, SendItem::control(kCts, sendId, recvId), done);
}

// Called with mu_ held: the receiver cleared a large send to a peer with lanes; each lane
// writes its part on its own thread.
std::shared_ptr<TcpTransport::Stripes> TcpTransport::newStripes(const RequestPtr& req, char* data, size_t nbytes) {
  auto st = std::make_shared<Stripes>();
  st->req = req;
  st->data = data;
  st->nbytes = nbytes;
  int parts = 0;
  for (int j = 0; j < laneCount_; ++j) parts += stripeRange(nbytes, laneCount_, j).second > 0;
  st->left.store(parts);
  req->setVia("tcp-striped");
  return st;
}

void TcpTransport::wakeLane(Lane& lane) {
  uint64_t one = 1;
  ssize_t w = ::write(lane.wakeFd, &one, sizeof(one));
  (void)w;
}

void TcpTransport::stripeSendLocked(int peer, uint64_t recvId, const RequestPtr& req, const char* data,
                                    size_t nbytes) {
  auto st = newStripes(req, const_cast<char*>(data), nbytes);  // only read on this side
  for (int j = 0; j < laneCount_; ++j) {
    auto [off, len] = stripeRange(nbytes, laneCount_, j);
    if (len == 0) continue;
    Lane& lane = *lanes_[j];
    Part part;
    part.hdr.magicKind = kMagic << 8 | kStripe;
    part.hdr.id = recvId;
    part.hdr.tag = static_cast<uint64_t>(j);
    part.hdr.addr = off;
    part.hdr.nbytes = len;
    part.off = off;
    part.len = len;
    part.st = st;
    {
      std::lock_guard<std::mutex> lk(lane.intakeMu);
      lane.newParts.emplace_back(peer, std::move(part));
    }
    wakeLane(lane);
  }
}

// Called with mu_ held, before the clear-to-send goes out: every lane learns where its part of
// this receive belongs before the sender can start writing it.
void TcpTransport::stripeRecvLocked(int peer, uint64_t recvId, const std::shared_ptr<PostedRecv>& pr) {
  auto st = newStripes(pr->req, pr->data, pr->nbytes);
  for (int j = 0; j < laneCount_; ++j) {
    if (stripeRange(pr->nbytes, laneCount_, j).second == 0) continue;
    std::lock_guard<std::mutex> lk(lanes_[j]->intakeMu);
    lanes_[j]->newRecvs.emplace_back(peer, recvId, st);
  }
}

// Moves work handed over by the epoll thread into the lane's own queues. lane.mu held.
void TcpTransport::takeIntake(Lane& lane) {
  std::lock_guard<std::mutex> ik(lane.intakeMu);
  for (auto& [peer, part] : lane.newParts) lane.conns[peer].out.push_back(std::move(part));
  for (auto& [peer, recvId, st] : lane.newRecvs) lane.conns[peer].expected.emplace(recvId, std::move(st));
  lane.newParts.clear();
  lane.newRecvs.clear();
}

void TcpTransport::laneLoop(Lane& lane) {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  std::vector<std::function<void()>> done;
  while (!stopping_.load(std::memory_order_acquire)) {
    int n = epoll_wait(lane.epfd, events, kMaxEvents, 1000);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n; ++i) {
      const uint32_t id = events[i].data.u32;
      std::vector<std::pair<int, std::string>> broken;  // (peer, why), reported outside lane.mu
      {
        std::lock_guard<std::mutex> lk(lane.mu);
        if (id == UINT32_MAX) {  // parts were queued: drain the wake-up before taking them, so
          uint64_t v;            // parts pushed later wake this lane again
          while (::read(lane.wakeFd, &v, sizeof(v)) > 0) {
          }
        }
        takeIntake(lane);
        std::string why;
        if (id == UINT32_MAX) {
          for (int peer = 0; peer < setup_.size; ++peer) {
            laneFlush(lane, peer, done, why);
            if (!why.empty()) broken.emplace_back(peer, std::move(why)), why.clear();
          }
        } else {
          const int peer = static_cast<int>(id);
          if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) laneRead(lane, peer, done, why);
          if (why.empty() && (events[i].events & EPOLLOUT)) laneFlush(lane, peer, done, why);
          if (!why.empty()) broken.emplace_back(peer, std::move(why));
        }
      }
      for (auto& [peer, why] : broken) laneBroken(peer, why);
    }
    for (auto& f : done) f();
    done.clear();
  }
}

// Writes this lane's parts for `peer` as far as the socket takes them without blocking.
// lane.mu held.
void TcpTransport::laneFlush(Lane& lane, int peer, std::vector<std::function<void()>>& done, std::string& broken) {
  auto& c = lane.conns[peer];
  if (c.fd < 0) return;
  while (!c.out.empty()) {
    Part& pt = c.out.front();
    if (!writeFrameSome(c.fd, reinterpret_cast<char*>(&pt.hdr), pt.hdrOff, sizeof(Frame), pt.st->data + pt.off,
                        pt.len, pt.moved)) {
      broken = "sending to rank " + std::to_string(peer) + " (" + peers_[peer]->addr + ", data socket " +
               std::to_string(lane.index + 1) + ") failed: " + errnoStr(errno);
      epoll_ctl(lane.epfd, EPOLL_CTL_DEL, c.fd, nullptr);
      ::shutdown(c.fd, SHUT_RDWR);
      return;
    }
    if (pt.hdrOff < sizeof(Frame) || pt.moved < pt.len) break;  // the socket is full
    if (pt.st->left.fetch_sub(1) == 1) {
      auto req = pt.st->req;
      done.push_back([req, peer] { req->complete(peer); });
    }
    c.out.pop_front();
  }
  const bool want = !c.out.empty();
  if (want != c.wantOut) {
    c.wantOut = want;
    epoll_event ev{};
    ev.events = EPOLLIN | (want ? EPOLLOUT : 0);
    ev.data.u32 = static_cast<uint32_t>(peer);
    epoll_ctl(lane.epfd, EPOLL_CTL_MOD, c.fd, &ev);
  }
}

// Reads parts from `peer` on this lane straight into their receives' buffers. lane.mu held.
void TcpTransport::laneRead(Lane& lane, int peer, std::vector<std::function<void()>>& done, std::string& broken) {
  auto& c = lane.conns[peer];
  if (c.fd < 0) return;
  const std::string who = "rank " + std::to_string(peer) + " (" + peers_[peer]->addr + ")";
  auto fail = [&](std::string why) {
    broken = std::move(why);
    epoll_ctl(lane.epfd, EPOLL_CTL_DEL, c.fd, nullptr);
    ::shutdown(c.fd, SHUT_RDWR);
  };
  // recv() returned r: true (after failing the lane) if the link is gone.
  auto lost = [&](ssize_t r) {
    if (r > 0 || (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))) return false;
    fail(r == 0 ? who + " closed the connection in the middle of a message: the process exited or crashed"
                : "data connection to " + who + " failed: " + errnoStr(errno));
    return true;
  };
  for (int rounds = 0; rounds < 64; ++rounds) {
    if (!c.in) {
      ssize_t r = ::recv(c.fd, reinterpret_cast<char*>(&c.hdr) + c.hdrGot, sizeof(Frame) - c.hdrGot, 0);
      if (r == 0 && c.hdrGot == 0 && c.expected.empty()) {
        // Closed between messages: the peer left or died, and its control socket says which.
        epoll_ctl(lane.epfd, EPOLL_CTL_DEL, c.fd, nullptr);
        c.ended = true;
        return;
      }
      if (lost(r) || r < 0) return;
      c.hdrGot += static_cast<size_t>(r);
      if (c.hdrGot < sizeof(Frame)) continue;
      c.hdrGot = 0;
      if ((c.hdr.magicKind >> 8) != kMagic || (c.hdr.magicKind & 0xff) != kStripe) {
        fail("corrupt stream from " + who + " on data socket " + std::to_string(lane.index + 1));
        return;
      }
      auto it = c.expected.find(c.hdr.id);
      if (it == c.expected.end()) {  // registered after this lane last looked
        takeIntake(lane);
        it = c.expected.find(c.hdr.id);
      }
      if (it == c.expected.end()) {
        fail("protocol error: " + who + " sent part of a message nobody is receiving");
        return;
      }
      const auto range = stripeRange(it->second->nbytes, laneCount_, lane.index);
      if (c.hdr.tag != static_cast<uint64_t>(lane.index) || c.hdr.addr != range.first ||
          c.hdr.nbytes != range.second) {
        fail("protocol error: " + who + " sent bytes [" + std::to_string(c.hdr.addr) + ", +" +
             std::to_string(c.hdr.nbytes) + ") of a message on data socket " + std::to_string(lane.index + 1) +
             ", which carries [" + std::to_string(range.first) + ", +" + std::to_string(range.second) + ")");
        return;
      }
      c.in = it->second;
      c.inId = c.hdr.id;
      c.inOff = range.first;
      c.inLen = range.second;
      c.inGot = 0;
    }
    ssize_t r = ::recv(c.fd, c.in->data + c.inOff + c.inGot, c.inLen - c.inGot, 0);
    if (lost(r) || r < 0) return;
    c.inGot += static_cast<size_t>(r);
    if (c.inGot == c.inLen) {
      c.expected.erase(c.inId);
      if (c.in->left.fetch_sub(1) == 1) {
        auto req = c.in->req;
        done.push_back([req, peer] { req->complete(peer); });
      }
      c.in.reset();
    }
  }
}

// A lane failed. While the peer is alive the epoll thread turns this into the peer's failure (it
// may be reading into a user buffer right now, so only it may fail that peer's requests). Once
// the peer is gone, the messages still coming from it fail here, on every lane, with the reason
// the peer gave: every message has a part on every lane, and no part of them is coming now.
void TcpTransport::laneBroken(int peer, const std::string& why) {
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& p = *peers_[peer];
    if (closed_) return;
    p.lanesBroken = true;
    if (!p.dead) {
      if (p.deadReason.empty()) p.deadReason = why;
      ::shutdown(p.fd, SHUT_RDWR);
      wake();
      return;
    }
    dropLanesLocked(peer, p.deadReason, false, done);
  }
  for (auto& f : done) f();
}

// Called with mu_ held from peerFailedLocked, laneBroken and close(): fails and forgets the
// peer's parts on every lane. With keepIncoming (the peer said goodbye, no lane of it broke),
// parts of messages it is sending here stay: it wrote them before its goodbye, they are in the
// sockets, and each lane reads them up to the peer's end of stream (a lane that meets that end
// with a part still missing fails them all through laneBroken). A receive granted after a lane
// already met that end can never be whole: then nothing is kept.
void TcpTransport::dropLanesLocked(int peer, const std::string& why, bool keepIncoming,
                                   std::vector<std::function<void()>>& done) {
  for (auto& lanePtr : lanes_) {
    if (!keepIncoming) break;
    Lane& lane = *lanePtr;
    std::lock_guard<std::mutex> lk(lane.mu);
    std::lock_guard<std::mutex> ik(lane.intakeMu);
    const auto& c = lane.conns[peer];
    bool waiting = !c.expected.empty();
    for (const auto& nr : lane.newRecvs) waiting |= std::get<0>(nr) == peer;
    if (c.ended && waiting) keepIncoming = false;
  }
  auto failSt = [&](const std::shared_ptr<Stripes>& st) {
    if (!st) return;
    auto req = st->req;
    done.push_back([req, why, peer] { req->fail(CommErrorKind::PeerGone, why, peer); });
  };
  for (auto& lanePtr : lanes_) {
    Lane& lane = *lanePtr;
    std::lock_guard<std::mutex> lk(lane.mu);
    {
      std::lock_guard<std::mutex> ik(lane.intakeMu);
      for (auto it = lane.newParts.begin(); it != lane.newParts.end();) {
        if (it->first != peer) {
          ++it;
          continue;
        }
        failSt(it->second.st);
        it = lane.newParts.erase(it);
      }
      for (auto it = lane.newRecvs.begin(); it != lane.newRecvs.end() && !keepIncoming;) {
        if (std::get<0>(*it) != peer) {
          ++it;
          continue;
        }
        failSt(std::get<2>(*it));
        it = lane.newRecvs.erase(it);
      }
    }
    auto& c = lane.conns[peer];
    for (auto& pt : c.out) failSt(pt.st);
    c.out.clear();
    if (keepIncoming) continue;
    for (auto& kv : c.expected) failSt(kv.second);
    c.expected.clear();
    failSt(c.in);
    c.in.reset();
    c.hdrGot = 0;
    if (c.fd >= 0) {
      if (lane.epfd >= 0) epoll_ctl(lane.epfd, EPOLL_CTL_DEL, c.fd, nullptr);
      ::shutdown(c.fd, SHUT_RDWR);
    }
  }
}

// Direct copies from this size on are split across MYCCL_COPY_THREADS threads.
constexpr size_t kSplitCopyBytes = 1u << 20;

// Runs outside mu_ (on the thread that matched the receive).
void TcpTransport::directCopy(int peer, uint64_t recvId, std::shared_ptr<PostedRecv> pr, uint64_t sendId,
                              uint64_t addr, uint64_t pid) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || peers_[peer]->dead || !peers_[peer]->directRecvs.count(recvId)) return;
    ++copiesInFlight_;
  }
  // Copies [b, e); returns 0 or the errno that stopped it.
  auto readRange = [&](size_t b, size_t e) -> int {
    while (b < e) {
      iovec local{pr->data + b, e - b};
      iovec remote{reinterpret_cast<void*>(addr + b), e - b};
      ssize_t r = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return r < 0 ? errno : EFAULT;
      b += static_cast<size_t>(r);
    }
    return 0;
  };
  int err = 0;
  // One thread copies at 55-65% of memcpy here (process_vm_readv pins and maps the sender's
  // pages as it goes); two reach memcpy's rate. The sender is blocked until the copy is done,
  // so the second thread runs on the core it leaves idle.
  std::unique_lock<std::mutex> pool(copyPoolMu_, std::defer_lock);
  if (setup_.copyThreads > 1 && pr->nbytes >= kSplitCopyBytes && pool.try_lock() && !copyPool_) {
    try {
      copyPool_ = std::make_unique<Parallel>(setup_.copyThreads);
    } catch (const std::exception& e) {  // no threads to be had: copy alone, as with 1
      logOnce("tcp-copy-threads", LogLevel::Warning, std::string("copy helpers unavailable: ") + e.what());
      pool.unlock();
    }
  }
  if (pool.owns_lock() && copyPool_) {
    std::atomic<int> first{0};
    copyPool_->run(pr->nbytes, kSplitCopyBytes / 2, [&](size_t b, size_t e) {
      int z = 0, e2 = readRange(b, e);
      if (e2) first.compare_exchange_strong(z, e2);
    });
    err = first.load();
    pool.unlock();
    if (err == 0) pr->req->setVia("direct-parallel");
  } else {
    err = readRange(0, pr->nbytes);
  }
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (--copiesInFlight_ == 0) copiesIdle_.notify_all();
    auto& p = *peers_[peer];
    auto it = p.directRecvs.find(recvId);
    if (it != p.directRecvs.end() && !closed_ && !p.dead) {
      if (err == 0) {
        pushSend(peer, SendItem::control(kDirectDone, sendId, recvId), done);
      } else if (err == EPERM || err == EACCES || err == ENOSYS || err == ESRCH) {
        // Not allowed (Yama ptrace policy, seccomp) or not the process we think (another pid
        // namespace): use the socket for this peer from now on.
        p.direct = false;
        p.directRecvs.erase(it);
        std::string why = "direct copies between local ranks unavailable (" + errnoStr(err) +
                          "); large messages go through TCP";
        done.push_back([why] { logOnce("tcp-direct-off", LogLevel::Info, why); });
        grantLocked(peer, pr, sendId, Frame{}, done);  // clear-to-send over the socket
      } else {
        peerFailedLocked(peer,
                         "reading a message directly from rank " + std::to_string(peer) + " (pid " +
                             std::to_string(pid) + ") failed: " + errnoStr(err),
                         done);
      }
    }
  }
  for (auto& f : done) f();
}

// Called with mu_ held when a message waiting in `peer`'s mailbox slot meets its receive: the
// copy runs after the lock is released (on the thread that matched it), counted as a copy in
// flight so that close() does not return while it writes into the caller's buffer.
void TcpTransport::takeFromMailboxLocked(int peer, int slot, std::shared_ptr<PostedRecv> pr,
                                         std::vector<std::function<void()>>& done) {
  done.push_back([this, peer, slot, pr] {
    std::string aborted;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_) {
        aborted = closeReason_;
      } else {
        ++copiesInFlight_;
      }
    }
    if (!aborted.empty()) {
      pr->req->fail(CommErrorKind::Aborted, aborted, peer);
      return;
    }
    setup_.mailbox->take(peer, slot, pr->data, pr->nbytes);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--copiesInFlight_ == 0) copiesIdle_.notify_all();
    }
    // Completed after the count drops: a completion callback may close the transport.
    pr->req->setVia("mailbox");
    pr->req->complete(peer);
  });
}

void TcpTransport::pushSend(int peer, std::unique_ptr<SendItem> item, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  const bool wasIdle = p.sendq.empty();
  p.sendq.push_back(std::move(item));
  if (wasIdle) flushLocked(peer, done);
}

// Writes as much of the send queue as the socket takes without blocking.
void TcpTransport::flushLocked(int peer, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  while (!p.sendq.empty() && !p.dead) {
    SendItem& it = *p.sendq.front();
    if (!writeFrameSome(p.fd, reinterpret_cast<char*>(&it.hdr), it.hdrOff, sizeof(Frame), it.data, it.nbytes,
                        it.off)) {
      // Failure handling belongs to the epoll thread (it may be reading into a user buffer
      // right now); make it notice.
      p.deadReason = "sending to rank " + std::to_string(peer) + " (" + p.addr + ") failed: " + errnoStr(errno);
      ::shutdown(p.fd, SHUT_RDWR);
      wake();
      break;
    }
    if (it.hdrOff < sizeof(Frame) || it.off < it.nbytes) break;  // the socket is full
    if (it.req) {
      auto req = it.req;
      done.push_back([req, peer] { req->complete(peer); });
    }
    p.sendq.pop_front();
  }
  const bool want = !p.sendq.empty() && !p.dead;
  if (want != p.wantOut) {
    p.wantOut = want;
    updateInterestLocked(peer);
  }
}

void TcpTransport::updateInterestLocked(int peer) {
  auto& p = *peers_[peer];
  if (p.fd < 0 || epfd_ < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN | (p.wantOut ? EPOLLOUT : 0);
  ev.data.u32 = static_cast<uint32_t>(peer);
  epoll_ctl(epfd_, EPOLL_CTL_MOD, p.fd, &ev);
}

void TcpTransport::ioLoop() {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  std::vector<std::function<void()>> done;
  while (!stopping_.load(std::memory_order_acquire)) {
    int n = epoll_wait(epfd_, events, kMaxEvents, 1000);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < n; ++i) {
      uint32_t id = events[i].data.u32;
      if (id == UINT32_MAX) {
        uint64_t v;
        while (::read(wakeFd_, &v, sizeof(v)) > 0) {
        }
        continue;
      }
      int peer = static_cast<int>(id);
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) handleReadable(peer, done);
      if (events[i].events & EPOLLOUT) handleWritable(peer, done);
    }
    // A posting thread may have broken a socket; the read path turns that into a failure.
    for (auto& f : done) f();
    done.clear();
  }
}

void TcpTransport::handleWritable(int peer, std::vector<std::function<void()>>& done) {
  std::lock_guard<std::mutex> lk(mu_);
  flushLocked(peer, done);
}

void TcpTransport::handleReadable(int peer, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if (p.dead) return;
  // Bound the work per wake-up so one busy peer cannot starve the others.
  for (int rounds = 0; rounds < 64; ++rounds) {
    if (!p.inPayload) {
      ssize_t r = ::recv(p.fd, reinterpret_cast<char*>(&p.hdr) + p.hdrGot, sizeof(Frame) - p.hdrGot, 0);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        std::lock_guard<std::mutex> lk(mu_);
        std::string why = !p.deadReason.empty() ? p.deadReason
                          : r == 0 ? "rank " + std::to_string(peer) + " (" + p.addr +
                                         ") closed the connection: the process exited or crashed"
                                   : "connection to rank " + std::to_string(peer) + " (" + p.addr +
                                         ") failed: " + errnoStr(errno);
        peerFailedLocked(peer, why, done);
        return;
      }
      if (r < 0) return;
      p.hdrGot += static_cast<size_t>(r);
      if (p.hdrGot < sizeof(Frame)) continue;
      p.hdrGot = 0;
      std::lock_guard<std::mutex> lk(mu_);
      onHeader(peer, p.hdr, done);
      if (p.dead) return;
      if (!p.inPayload) continue;
      if (p.targetLen == 0) {
        finishRead(peer, done);
        continue;
      }
    }
    // Payload: straight into its destination, without holding the lock.
    char* dst = p.discarding ? p.sink.data() : p.target + p.targetGot;
    size_t want = p.discarding ? std::min(p.sink.size(), p.targetLen - p.targetGot) : p.targetLen - p.targetGot;
    ssize_t r = ::recv(p.fd, dst, want, 0);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      std::lock_guard<std::mutex> lk(mu_);
      std::string why = !p.deadReason.empty() ? p.deadReason
                        : "rank " + std::to_string(peer) + " (" + p.addr +
                              ") closed the connection in the middle of a message: the process exited or crashed";
      peerFailedLocked(peer, why, done);
      return;
    }
    if (r < 0) return;
    p.targetGot += static_cast<size_t>(r);
    if (p.targetGot == p.targetLen) {
      std::lock_guard<std::mutex> lk(mu_);
      finishRead(peer, done);
    }
  }
}

// Called with mu_ held when a full frame header has arrived from `peer`.
void TcpTransport::onHeader(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if ((f.magicKind >> 8) != kMagic) {
    peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (bad frame magic)", done);
    return;
  }
  const uint32_t kind = f.magicKind & 0xff;
  p.discarding = false;
  p.readingFor.reset();
  p.readingUnexpected.reset();
  p.target = nullptr;
  p.targetLen = 0;
  p.targetGot = 0;
  p.inPayload = false;

  auto startDiscard = [&](size_t n) {
    p.discarding = true;
    if (p.sink.empty()) p.sink.resize(1 << 16);
    p.targetLen = n;
    p.inPayload = true;
  };

  if (kind == kMailbox &&
      !(setup_.mailbox && f.id < static_cast<uint64_t>(ShmGroup::kMailboxSlots) &&
        f.nbytes <= setup_.mailbox->slotBytes() && setup_.mailbox->holds(peer, static_cast<int>(f.id)))) {
    peerFailedLocked(peer,
                     "protocol error: rank " + std::to_string(peer) + " announced a message in shared-memory slot " +
                         std::to_string(f.id) + " that holds none",
                     done);
    return;
  }
  if (kind == kEager || kind == kRts || kind == kMailbox) {
    // Oldest posted receive that matches: per-peer list and receive-from-any compete by order.
    std::shared_ptr<PostedRecv> match;
    auto pit = p.posted.end();
    for (auto it = p.posted.begin(); it != p.posted.end(); ++it) {
      if ((*it)->tag == f.tag) {
        pit = it;
        break;
      }
    }
    auto ait = anyRecvs_.end();
    for (auto it = anyRecvs_.begin(); it != anyRecvs_.end(); ++it) {
      if ((*it)->tag != f.tag) continue;
      bool has = false;
      for (int c : (*it)->anyOf) has |= (c == peer);
      if (has) {
        ait = it;
        break;
      }
    }
    if (pit != p.posted.end() && (ait == anyRecvs_.end() || (*pit)->order < (*ait)->order)) {
      match = *pit;
      p.posted.erase(pit);
    } else if (ait != anyRecvs_.end()) {
      match = *ait;
      anyRecvs_.erase(ait);
    }
    if (!match) {
      auto u = std::make_shared<Unexpected>();
      u->tag = f.tag;
      u->check = f.check;
      u->rts = (kind == kRts);
      u->sendId = f.id;
      u->announced = f;
      u->nbytes = f.nbytes;
      u->order = nextId_++;
      if (kind == kMailbox) {
        u->mailboxSlot = static_cast<int>(f.id);
        u->complete = true;
      } else if (kind == kEager) {
        u->data.resize(f.nbytes);
        u->complete = (f.nbytes == 0);
        if (f.nbytes > 0) {
          p.readingUnexpected = u;
          p.target = u->data.data();
          p.targetLen = f.nbytes;
          p.inPayload = true;
        }
      }
      p.unexpected.push_back(std::move(u));
      return;
    }
    auto req = match->req;
    if (f.nbytes != match->nbytes || (f.check && match->check && f.check != match->check)) {
      std::string msg = f.nbytes != match->nbytes
                            ? "message from rank " + std::to_string(peer) + " has " + std::to_string(f.nbytes) +
                                  " bytes but the receive expects " + std::to_string(match->nbytes)
                            : mismatchText(peer, f.check, match->check);
      done.push_back([req, msg, peer] { req->fail(CommErrorKind::Protocol, msg, peer); });
      if (kind == kEager) {
        if (f.nbytes > 0) startDiscard(f.nbytes);
      } else if (kind == kMailbox) {
        setup_.mailbox->drop(peer, static_cast<int>(f.id));
      } else {
        pushSend(peer, SendItem::control(kNack, f.id, 0, match->nbytes), done);
      }
      return;
    }
    if (kind == kRts) {
      grantLocked(peer, match, f.id, f, done);
      return;
    }
    if (kind == kMailbox) {
      takeFromMailboxLocked(peer, static_cast<int>(f.id), match, done);
      return;
    }
    if (f.nbytes == 0) {
      done.push_back([req, peer] { req->complete(peer); });
      return;
    }
    p.readingFor = match;
    p.target = match->data;
    p.targetLen = f.nbytes;
    p.inPayload = true;
    return;
  }
  if (kind == kCts || kind == kNack) {
    auto it = p.awaitingCts.find(f.id);
    if (it == p.awaitingCts.end()) {
      peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " answered an unknown send", done);
      return;
    }
    auto pending = it->second;
    p.awaitingCts.erase(it);
    if (kind == kNack) {
      std::string msg = "rank " + std::to_string(peer) + " expected " + std::to_string(f.nbytes) +
                        " bytes for this message but it has " + std::to_string(pending.nbytes);
      auto req = pending.req;
      done.push_back([req, msg, peer] { req->fail(CommErrorKind::Protocol, msg, peer); });
      return;
    }
    if (striped(peer, pending.nbytes)) {
      stripeSendLocked(peer, f.tag, pending.req, pending.data, pending.nbytes);
      return;
    }
    auto item = std::make_unique<SendItem>();
    item->hdr.magicKind = kMagic << 8 | kData;
    item->hdr.id = f.tag;  // the receiver's id for this transfer
    item->hdr.nbytes = pending.nbytes;
    item->data = pending.data;
    item->nbytes = pending.nbytes;
    item->req = pending.req;
    pushSend(peer, std::move(item), done);
    return;
  }
  if (kind == kDirectDone) {
    auto it = p.awaitingCts.find(f.id);
    if (it == p.awaitingCts.end()) {
      peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " copied an unknown send", done);
      return;
    }
    auto req = it->second.req;
    p.awaitingCts.erase(it);
    req->setVia("direct");
    done.push_back([req, peer] { req->complete(peer); });
    pushSend(peer, SendItem::control(kDirectAck, f.tag), done);
    return;
  }
  if (kind == kDirectAck) {
    auto it = p.directRecvs.find(f.id);
    if (it == p.directRecvs.end()) {
      peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " confirmed an unknown copy", done);
      return;
    }
    auto req = it->second->req;
    p.directRecvs.erase(it);
    if (!req->via()) req->setVia("direct");  // else "direct-parallel", set by the copy
    done.push_back([req, peer] { req->complete(peer); });
    return;
  }
  if (kind == kData) {
    auto it = p.activeRecvs.find(f.id);
    if (it == p.activeRecvs.end() || it->second->nbytes != f.nbytes) {
      peerFailedLocked(peer, "protocol error: unexpected data frame from rank " + std::to_string(peer), done);
      return;
    }
    p.readingFor = it->second;
    p.activeRecvs.erase(it);
    p.target = p.readingFor->data;
    p.targetLen = f.nbytes;
    p.inPayload = true;
    if (f.nbytes == 0) {
      auto req = p.readingFor->req;
      done.push_back([req, peer] { req->complete(peer); });
      p.readingFor.reset();
      p.inPayload = false;
    }
    return;
  }
  if (kind == kGoodbye) {
    // The peer is closing and says why; its words become the error of anything still
    // waiting for it.
    if (f.nbytes > kMaxGoodbye) {
      peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (oversized goodbye)", done);
      return;
    }
    p.goodbye.assign(f.nbytes, '\0');
    p.target = p.goodbye.data();
    p.targetLen = f.nbytes;
    p.inPayload = true;
    p.readingGoodbye = true;
    p.goodbyeIsFailure = f.id == 1;
    return;
  }
  peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (unknown frame kind)", done);
}

// Called with mu_ held when a payload has fully arrived.
void TcpTransport::finishRead(int peer, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  p.inPayload = false;
  if (p.readingGoodbye) {
    p.readingGoodbye = false;
    p.deadReason = "rank " + std::to_string(peer) + (p.goodbyeIsFailure ? " failed: " : " left the group: ") + p.goodbye;
    p.orderlyGoodbye = !p.goodbyeIsFailure;
    if (p.goodbyeIsFailure && peerFailed_) {
      auto cb = peerFailed_;
      auto why = p.deadReason;
      done.push_back([cb, peer, why] { cb(peer, why); });
    }
    return;
  }
  if (p.discarding) {
    p.discarding = false;
    return;
  }
  if (p.readingFor) {
    auto req = p.readingFor->req;
    done.push_back([req, peer] { req->complete(peer); });
    p.readingFor.reset();
    return;
  }
  if (p.readingUnexpected) {
    auto u = std::move(p.readingUnexpected);
    u->complete = true;
    if (u->waiter) {
      std::memcpy(u->waiter->data, u->data.data(), u->data.size());
      auto req = u->waiter->req;
      done.push_back([req, peer] { req->complete(peer); });
      u->waiter.reset();
    }
  }
}

// Called with mu_ held, on the epoll thread (or in close() after it stopped).
void TcpTransport::peerFailedLocked(int peer, const std::string& why, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if (p.dead) return;
  // A peer that vanished without an orderly goodbye is a failure worth diagnosing (not when we
  // are the ones closing, and not twice if it already said it failed).
  if (!closed_ && !p.orderlyGoodbye && !p.goodbyeIsFailure && peerFailed_) {
    auto cb = peerFailed_;
    done.push_back([cb, peer, why] { cb(peer, why); });
  }
  p.dead = true;
  p.deadReason = why;
  if (p.fd >= 0) {
    if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, p.fd, nullptr);
    ::shutdown(p.fd, SHUT_RDWR);
  }
  auto failReq = [&](const RequestPtr& r) {
    if (!r) return;
    done.push_back([r, why, peer] { r->fail(CommErrorKind::PeerGone, why, peer); });
  };
  for (auto& it : p.sendq) failReq(it->req);
  p.sendq.clear();
  for (auto& kv : p.awaitingCts) failReq(kv.second.req);
  p.awaitingCts.clear();
  for (auto& pr : p.posted) failReq(pr->req);
  p.posted.clear();
  for (auto& kv : p.activeRecvs) failReq(kv.second->req);
  p.activeRecvs.clear();
  for (auto& kv : p.directRecvs) failReq(kv.second->req);
  p.directRecvs.clear();
  // A peer that said goodbye wrote its messages' data-socket parts before it did: those still
  // being read are kept.
  dropLanesLocked(peer, why, !closed_ && (p.orderlyGoodbye || p.goodbyeIsFailure) && !p.lanesBroken, done);
  // Messages that arrived whole before the peer left are still good: a peer that finished
  // its part of an op and exited must not make this rank lose what it sent. Only partial
  // messages and announcements of data that can no longer come are dropped.
  for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
    if ((*it)->complete && !(*it)->rts) {
      ++it;
      continue;
    }
    if ((*it)->waiter) failReq((*it)->waiter->req);
    it = p.unexpected.erase(it);
  }
  if (p.readingFor) failReq(p.readingFor->req);
  if (p.readingUnexpected && p.readingUnexpected->waiter) failReq(p.readingUnexpected->waiter->req);
  p.readingFor.reset();
  p.readingUnexpected.reset();
  p.inPayload = false;
  p.wantOut = false;
  // A receive-from-any fails only when none of its peers is left.
  for (auto it = anyRecvs_.begin(); it != anyRecvs_.end();) {
    bool alive = false;
    for (int c : (*it)->anyOf) alive |= !peers_[c]->dead;
    if (!alive) {
      failReq((*it)->req);
      it = anyRecvs_.erase(it);
    } else {
      ++it;
    }
  }
}

void TcpTransport::close(const std::string& reason, bool failure) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    closeReason_ = reason;
    // Best effort: tell every peer why, so a peer still waiting for us reports our reason
    // instead of "connection closed". Only on an idle stream (never inside another frame).
    const std::string text = reason.substr(0, kMaxGoodbye);
    for (int r = 0; r < setup_.size; ++r) {
      if (r == setup_.rank) continue;
      auto& p = *peers_[r];
      if (p.dead || p.fd < 0 || !p.sendq.empty()) continue;
      Frame f{};
      f.magicKind = kMagic << 8 | kGoodbye;
      f.nbytes = text.size();
      f.id = failure ? 1 : 0;
      iovec iov[2] = {{&f, sizeof(f)}, {const_cast<char*>(text.data()), text.size()}};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = 2;
      ssize_t w = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)w;
    }
  }
  stopping_.store(true, std::memory_order_release);
  if (wakeFd_ >= 0) wake();
  if (io_.joinable()) {
    if (io_.get_id() == std::this_thread::get_id()) {
      io_.detach();  // closed from a completion callback: the loop exits on its own
    } else {
      io_.join();
    }
  }
  for (auto& lanePtr : lanes_) {
    Lane& lane = *lanePtr;
    if (lane.wakeFd >= 0) wakeLane(lane);
    if (!lane.thread.joinable()) continue;
    if (lane.thread.get_id() == std::this_thread::get_id()) {
      lane.thread.detach();
    } else {
      lane.thread.join();
    }
  }
  std::vector<std::function<void()>> done;
  {
    std::unique_lock<std::mutex> lk(mu_);
    // A direct copy into a caller's buffer may be running on another thread: the caller frees
    // buffers once close() returns. Copies never wait for peers, so this is short.
    copiesIdle_.wait(lk, [&] { return copiesInFlight_ == 0; });
    for (int r = 0; r < setup_.size; ++r) {
      if (r == setup_.rank) continue;
      auto& p = *peers_[r];
      if (!p.dead) {
        p.deadReason = reason;
        // Aborted, not PeerGone: this side chose to stop.
        peerFailedLocked(r, reason, done);
      } else {
        dropLanesLocked(r, p.deadReason, false, done);  // parts kept after its goodbye
      }
      if (p.fd >= 0) {
        ::close(p.fd);
        p.fd = -1;
      }
      for (auto& lanePtr : lanes_) {
        auto& c = lanePtr->conns[r];
        if (c.fd >= 0) ::close(c.fd), c.fd = -1;
      }
    }
    for (auto& pr : anyRecvs_) {
      auto req = pr->req;
      done.push_back([req, reason] { req->fail(CommErrorKind::Aborted, reason, -1); });
    }
    anyRecvs_.clear();
  }
  for (auto& f : done) f();
  if (epfd_ >= 0) ::close(epfd_), epfd_ = -1;
  if (wakeFd_ >= 0) ::close(wakeFd_), wakeFd_ = -1;
  for (auto& lanePtr : lanes_) {
    if (lanePtr->epfd >= 0) ::close(lanePtr->epfd), lanePtr->epfd = -1;
    if (lanePtr->wakeFd >= 0) ::close(lanePtr->wakeFd), lanePtr->wakeFd = -1;
  }
}

std::string TcpTransport::describePeer(int peer) const {
  if (peer == setup_.rank) return "self";
  std::lock_guard<std::mutex> lk(mu_);
  const auto& p = *peers_[peer];
  return "tcp " + (p.addr.empty() ? setup_.peerAddresses[peer] : p.addr) + (p.dead ? " (gone)" : "");
}

std::string TcpTransport::peerGone(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return closeReason_;
  const auto& p = *peers_[peer];
  return p.dead ? p.deadReason : std::string();
}

bool TcpTransport::cancel(const RequestPtr& req) {
  std::lock_guard<std::mutex> lk(mu_);
  auto drop = [&](std::deque<std::shared_ptr<PostedRecv>>& q) {
    for (auto it = q.begin(); it != q.end(); ++it) {
      if ((*it)->req == req) {
        q.erase(it);
        return true;
      }
    }
    return false;
  };
  if (drop(anyRecvs_)) return true;
  if (req->peer() >= 0 && req->peer() < setup_.size && req->peer() != setup_.rank) {
    auto& p = *peers_[req->peer()];
    if (drop(p.posted)) return true;
    for (auto& u : p.unexpected)
      if (u->waiter && u->waiter->req == req) return false;
  }
  return false;
}

std::vector<std::pair<int, uint64_t>> TcpTransport::unmatched() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::pair<int, uint64_t>> out;
  for (int r = 0; r < setup_.size; ++r) {
    if (r == setup_.rank) continue;
    for (const auto& u : peers_[r]->unexpected) out.emplace_back(r, u->tag);
  }
  return out;
}

}  // namespace myccl::cpu
