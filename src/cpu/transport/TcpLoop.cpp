// The TCP transport's epoll thread: reads every control socket, acts on each frame as its header
// arrives (reading a payload straight into its destination), and writes what the posting
// threads could not; sends are written by the posting thread when the socket is idle.
#include "myccl/cpu/transport/TcpState.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace myccl::cpu {

using namespace tcp;

namespace {

// Moves the entry for `id` out of `awaiting` into `out`; false when there is none (the peer
// answered something this side never asked: a protocol error).
template <class Map, class V>
bool takeEntry(Map& awaiting, uint64_t id, V& out) {
  auto it = awaiting.find(id);
  if (it == awaiting.end()) return false;
  out = std::move(it->second);
  awaiting.erase(it);
  return true;
}

}  // namespace

void TcpTransport::wake() {
  uint64_t one = 1;
  ssize_t r = ::write(wakeFd_, &one, sizeof(one));
  (void)r;
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
        markVanishedLocked(peer);
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
      markVanishedLocked(peer);
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

// Called with mu_ held when a full frame header has arrived from `peer`: clears the read state
// and hands the frame to the handler of its kind, which says what payload follows, if any.
void TcpTransport::onHeader(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if ((f.magicKind >> 8) != kMagic) {
    peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (bad frame magic)", done);
    return;
  }
  p.discarding = false;
  p.readingFor.reset();
  p.readingUnexpected.reset();
  p.target = nullptr;
  p.targetLen = 0;
  p.targetGot = 0;
  p.inPayload = false;
  switch (f.magicKind & 0xff) {
    case kEager:
    case kRts:
    case kMailbox:
      onMessage(peer, f, done);
      return;
    case kCts:
    case kNack:
      onClearToSend(peer, f, done);
      return;
    case kDirectDone:
      onDirectDone(peer, f, done);
      return;
    case kDirectAck:
      onDirectAck(peer, f, done);
      return;
    case kData:
      onData(peer, f, done);
      return;
    case kGoodbye:
      onGoodbye(peer, f, done);
      return;
  }
  peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (unknown frame kind)", done);
}

// EAGER, RTS or MAILBOX: a message meets the oldest receive posted for it, or waits for one.
void TcpTransport::onMessage(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  const uint32_t kind = f.magicKind & 0xff;
  if (kind == kMailbox &&
      !(setup_.mailbox && f.id < static_cast<uint64_t>(ShmGroup::kMailboxSlots) &&
        f.nbytes <= setup_.mailbox->slotBytes() && setup_.mailbox->holds(peer, static_cast<int>(f.id)))) {
    peerFailedLocked(peer,
                     "protocol error: rank " + std::to_string(peer) + " announced a message in shared-memory slot " +
                         std::to_string(f.id) + " that holds none",
                     done);
    return;
  }
  auto match = match_.takePosted(peer, f.tag);
  if (!match) {
    auto u = std::make_shared<Unexpected>();
    u->tag = f.tag;
    u->hdr = f;
    if (kind == kMailbox) {
      u->complete = true;
    } else if (kind == kEager) {
      u->data.resize(f.nbytes);
      u->complete = (f.nbytes == 0);
      if (f.nbytes > 0) {
        p.readingUnexpected = u;
        p.readPayload(u->data.data(), f.nbytes);
      }
    }
    match_.arrived(peer, std::move(u));
    return;
  }
  if (meetLocked(peer, match, f, done)) {
    if (kind == kEager && f.nbytes > 0) p.discardPayload(f.nbytes);  // refused: read, then dropped
    return;
  }
  if (f.nbytes == 0) {
    auto req = match->req;
    done.push_back([req, peer] { req->complete(peer); });
    return;
  }
  p.readingFor = match;
  p.readPayload(match->data, f.nbytes);
}

// CTS or NACK: the receiver answered an announcement of ours; send the message, or fail it.
void TcpTransport::onClearToSend(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  Peer::PendingRts pending{};
  if (!takeEntry(peers_[peer]->awaitingCts, f.id, pending)) {
    if (peers_[peer]->withdrawn.erase(f.id)) return;  // its owner gave up on it (cancel)
    peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " answered an unknown send", done);
    return;
  }
  if ((f.magicKind & 0xff) == kNack) {
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
}

// DIRECT_DONE: the receiver copied an announced message out of our memory; the send is done.
void TcpTransport::onDirectDone(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  Peer::PendingRts pending{};
  if (!takeEntry(peers_[peer]->awaitingCts, f.id, pending)) {
    // Withdrawn: never confirmed, so the receiver never takes what it copied.
    if (peers_[peer]->withdrawn.erase(f.id)) return;
    peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " copied an unknown send", done);
    return;
  }
  auto req = pending.req;
  req->setVia("direct");
  done.push_back([req, peer] { req->complete(peer); });
  pushSend(peer, SendItem::control(kDirectAck, f.tag), done);
}

// DIRECT_ACK: the sender's buffer held the message throughout our copy; the receive is done.
void TcpTransport::onDirectAck(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  std::shared_ptr<PostedRecv> pr;
  if (!takeEntry(peers_[peer]->directRecvs, f.id, pr)) {
    peerFailedLocked(peer, "protocol error: rank " + std::to_string(peer) + " confirmed an unknown copy", done);
    return;
  }
  auto req = pr->req;
  if (!req->via()) req->setVia("direct");  // else "direct-parallel", set by the copy
  done.push_back([req, peer] { req->complete(peer); });
}

// DATA: the payload of a message we cleared, read straight into its receive's buffer.
void TcpTransport::onData(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  auto it = p.activeRecvs.find(f.id);
  if (it == p.activeRecvs.end() || it->second->nbytes != f.nbytes) {
    peerFailedLocked(peer, "protocol error: unexpected data frame from rank " + std::to_string(peer), done);
    return;
  }
  p.readingFor = it->second;
  p.activeRecvs.erase(it);
  p.readPayload(p.readingFor->data, f.nbytes);
  if (f.nbytes == 0) {
    auto req = p.readingFor->req;
    done.push_back([req, peer] { req->complete(peer); });
    p.readingFor.reset();
    p.inPayload = false;
  }
}

// GOODBYE: the peer is closing and says why; its words become the error of anything still
// waiting for it.
void TcpTransport::onGoodbye(int peer, const Frame& f, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if (f.nbytes > kMaxGoodbye) {
    peerFailedLocked(peer, "corrupt stream from rank " + std::to_string(peer) + " (oversized goodbye)", done);
    return;
  }
  p.goodbye.assign(f.nbytes, '\0');
  p.readPayload(p.goodbye.data(), f.nbytes);
  p.readingGoodbye = true;
  p.goodbyeIsFailure = f.id == 1;
}

// Called with mu_ held when a payload has fully arrived.
void TcpTransport::finishRead(int peer, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  p.inPayload = false;
  if (p.readingGoodbye) {
    p.readingGoodbye = false;
    p.deadReason = "rank " + std::to_string(peer) +
                 (p.goodbyeIsFailure ? " failed and closed its connections: " : " left the group and closed its connections: ") +
                 p.goodbye;
    p.orderlyGoodbye = !p.goodbyeIsFailure;
    if (p.goodbyeIsFailure) {
      auto why = p.deadReason;
      done.push_back([this, peer, why] { notifyPeerFailed(peer, why); });
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

}  // namespace myccl::cpu
