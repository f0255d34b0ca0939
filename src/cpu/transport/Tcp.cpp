// TcpTransport's calls: posting sends and receives, and what becomes of a receive that meets a
// message already here; cancel, and what the transport knows of its peers and waiting messages.
#include "myccl/cpu/transport/TcpState.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <unistd.h>

#include <cstring>

namespace myccl::cpu {

using namespace tcp;

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

}  // namespace myccl::cpu
