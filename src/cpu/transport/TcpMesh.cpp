// Setting up the TCP transport: a full mesh (lower rank accepts, higher rank connects) where
// every connection must present the group's secret before it is kept, then the epoll thread and
// one thread per lane.
#include <pthread.h>
#include "myccl/cpu/transport/TcpState.hpp"
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
#include <unistd.h>

#include "myccl/Log.hpp"

#include <sstream>

namespace myccl::cpu {

using namespace tcp;

namespace {

std::string lanesMismatch(int peer, uint32_t theirs, int mine) {
  return "rank " + std::to_string(peer) + " spreads large messages over " + std::to_string(std::max(1u, theirs)) +
         " sockets per peer and this rank over " + std::to_string(std::max(1, mine)) +
         ": set MYCCL_SOCKETS_PER_PEER to the same value on every rank";
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

TcpTransport::TcpTransport(c10d::Store& store, const std::string& keyPrefix, TcpSetup setup,
                           const std::string& token)
    : setup_(std::move(setup)), match_(setup_.size) {
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
      store.wait({keyPrefix + "addr/" + std::to_string(peer)}, setup_.timeout);  // the group's, not the store's
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

}  // namespace myccl::cpu
