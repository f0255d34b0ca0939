// Lanes: extra data sockets to each peer on another host, one thread per lane, because one TCP
// stream is bound to about one core's worth of kernel work. A message from kStripeMinBytes is
// cut into one contiguous part per lane; its receive completes when every lane has delivered.
#include "myccl/cpu/transport/TcpState.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace myccl::cpu {

using namespace tcp;

bool TcpTransport::hasLanes(int peer) const {
  if (laneCount_ == 0 || peer == setup_.rank) return false;
  return !(peer < static_cast<int>(setup_.directPeers.size()) && setup_.directPeers[peer]);
}

bool TcpTransport::striped(int peer, size_t nbytes) const {
  return nbytes >= kStripeMinBytes && hasLanes(peer) && !lanes_.empty();
}

// The shared record of one message spread over the lanes, for either side of it.
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

// Called with mu_ held: the receiver cleared a large send to a peer with lanes; each lane
// writes its part on its own thread.
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

}  // namespace myccl::cpu
