// How links end: a peer that failed or left (what waited for it fails, what it sent whole stays),
// and close(), which tells every peer why, stops the threads and fails everything pending.
#include "myccl/cpu/transport/TcpState.hpp"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "myccl/Threads.hpp"

namespace myccl::cpu {

using namespace tcp;

// Called with mu_ held when the control socket to `peer` ended or broke.
void TcpTransport::markVanishedLocked(int peer) {
  auto& p = *peers_[peer];
  if (!closed_ && !p.dead && !p.orderlyGoodbye && !p.goodbyeIsFailure) p.vanished = true;
}

std::vector<int> TcpTransport::vanishedPeers() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<int> out;
  for (int r = 0; r < setup_.size; ++r)
    if (r != setup_.rank && peers_[r]->vanished) out.push_back(r);
  return out;
}

// Called with mu_ held, on the epoll thread (or in close() after it stopped).
void TcpTransport::peerFailedLocked(int peer, const std::string& why, std::vector<std::function<void()>>& done) {
  auto& p = *peers_[peer];
  if (p.dead) return;
  // A peer that vanished without an orderly goodbye is a failure worth diagnosing (not when we
  // are the ones closing, and not twice if it already said it failed).
  if (!closed_ && !p.orderlyGoodbye && !p.goodbyeIsFailure) {
    done.push_back([this, peer, why] { notifyPeerFailed(peer, why); });
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
  // What it sent whole stays for later receives (see Matcher::dropPeer).
  const auto orphans = match_.dropPeer(peer);
  for (auto& pr : orphans.posted) failReq(pr->req);
  for (auto& kv : p.activeRecvs) failReq(kv.second->req);
  p.activeRecvs.clear();
  for (auto& kv : p.directRecvs) failReq(kv.second->req);
  p.directRecvs.clear();
  // A peer that said goodbye wrote its messages' data-socket parts before it did: those still
  // being read are kept.
  dropLanesLocked(peer, why, !closed_ && (p.orderlyGoodbye || p.goodbyeIsFailure) && !p.lanesBroken, done);
  if (p.readingFor) failReq(p.readingFor->req);
  if (p.readingUnexpected && p.readingUnexpected->waiter) failReq(p.readingUnexpected->waiter->req);
  p.readingFor.reset();
  p.readingUnexpected.reset();
  p.inPayload = false;
  p.wantOut = false;
  // A receive-from-any fails only when none of its peers is left.
  for (auto& pr : orphans.any) failReq(pr->req);
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
  joinOrDetach(io_);  // closed from a completion callback: detached, the loop exits on its own
  for (auto& lanePtr : lanes_) {
    Lane& lane = *lanePtr;
    if (lane.wakeFd >= 0) wakeLane(lane);
    joinOrDetach(lane.thread);
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
    for (auto& pr : match_.takeAny()) {
      auto req = pr->req;
      done.push_back([req, reason] { req->fail(CommErrorKind::Aborted, reason, -1); });
    }
  }
  for (auto& f : done) f();
  if (epfd_ >= 0) ::close(epfd_), epfd_ = -1;
  if (wakeFd_ >= 0) ::close(wakeFd_), wakeFd_ = -1;
  for (auto& lanePtr : lanes_) {
    if (lanePtr->epfd >= 0) ::close(lanePtr->epfd), lanePtr->epfd = -1;
    if (lanePtr->wakeFd >= 0) ::close(lanePtr->wakeFd), lanePtr->wakeFd = -1;
  }
}

}  // namespace myccl::cpu
