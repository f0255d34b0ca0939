// TcpTransport's calls: posting sends and receives, and what becomes of a receive that meets a
// message already here; cancel, and what the transport knows of its peers and waiting messages.
#include "myccl/cpu/transport/TcpState.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <unistd.h>

#include <cstring>

namespace myccl::cpu {

using namespace tcp;

RequestPtr TcpTransport::send(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check, bool posted) {
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
    } else if (static_cast<int64_t>(nbytes) <= p.eagerBytes || (posted && !p.direct)) {
      // Small, or a receive is waiting for it (a peer on this host copies it straight out of our
      // memory instead, announced): the bytes follow the header at once.
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
  pr->peer = peer;
  pr->check = check;
  pr->data = static_cast<char*>(data);
  pr->nbytes = nbytes;
  return postRecv(pr);
}

RequestPtr TcpTransport::irecvAny(const std::vector<int>& peers, uint64_t tag, void* data, size_t nbytes) {
  auto pr = std::make_shared<PostedRecv>();
  pr->req = std::make_shared<Request>(-1, tag, nbytes);
  pr->anyOf = peers;
  pr->tag = tag;
  pr->data = static_cast<char*>(data);
  pr->nbytes = nbytes;
  return postRecv(pr);
}

RequestPtr TcpTransport::postRecv(const std::shared_ptr<PostedRecv>& pr) {
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) {
      pr->req->fail(CommErrorKind::Aborted, closeReason_, pr->req->peer());
      return pr->req;
    }
    matchPostedLocked(pr, done);
  }
  for (auto& f : done) f();
  return pr->req;
}

// A receive was just posted: it takes the oldest matching message already here, or waits.
void TcpTransport::matchPostedLocked(const std::shared_ptr<PostedRecv>& pr,
                                     std::vector<std::function<void()>>& done) {
  auto req = pr->req;
  const auto found = match_.takeArrived(*pr);
  const int src = found.peer;
  if (const auto& u = found.msg) {
    if (meetLocked(src, pr, u->hdr, done)) return;
    if (!u->complete) {
      u->waiter = pr;  // the epoll thread finishes it when the payload is in
      return;
    }
    if (!u->data.empty()) std::memcpy(pr->data, u->data.data(), u->data.size());
    done.push_back([req, src] { req->complete(src); });
    return;
  }
  if (match_.post(pr)) return;
  if (pr->anyOf.empty()) {
    const int peer = pr->peer;
    auto why = peers_[peer]->deadReason;
    done.push_back([req, why, peer] { req->fail(CommErrorKind::PeerGone, why, peer); });
  } else {
    done.push_back([req] { req->fail(CommErrorKind::PeerGone, "every peer of this receive-from-any is gone", -1); });
  }
}

// A receive meets a message from `peer` with header `f`, whichever came first. Settles all but an
// eager message the receive accepts (returns false for that: its bytes are the caller's to
// deliver). A receive that disagrees with its message fails and the message is refused: an
// announcing sender is told (NACK) and fails too, a slot is freed, an eager payload is the
// caller's to drop. An announcement is granted; a filled slot is copied out.
bool TcpTransport::meetLocked(int peer, const std::shared_ptr<PostedRecv>& pr, const Frame& f,
                              std::vector<std::function<void()>>& done) {
  const uint32_t kind = f.magicKind & 0xff;
  std::string why = matchError(peer, f.nbytes, f.check, pr->nbytes, pr->check);
  if (!why.empty()) {
    auto req = pr->req;
    done.push_back([req, why, peer] { req->fail(CommErrorKind::Protocol, why, peer); });
    if (kind == kRts) pushSend(peer, SendItem::control(kNack, f.id, 0, pr->nbytes), done);
    if (kind == kMailbox) setup_.mailbox->drop(peer, static_cast<int>(f.id));
    return true;
  }
  if (kind == kRts) {
    grantLocked(peer, pr, f.id, f, done);
    return true;
  }
  if (kind == kMailbox) {
    takeFromMailboxLocked(peer, static_cast<int>(f.id), pr, done);
    return true;
  }
  return false;
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
  const int peer = req->peer();
  const bool own = peer >= 0 && peer < setup_.size && peer != setup_.rank;
  if (match_.cancel(own ? peer : -1, [&](const PostedRecv& pr) { return pr.req == req; })) return true;
  if (!own) return false;
  // A send is withdrawn while none of its bytes has left: an eager frame still whole in the queue,
  // or an announcement not yet answered (the receiver's later answer is dropped; it has read
  // nothing of ours). Anything further along finishes on its own.
  auto& p = *peers_[peer];
  for (auto it = p.awaitingCts.begin(); it != p.awaitingCts.end(); ++it) {
    if (it->second.req != req) continue;
    p.withdrawn.insert(it->first);
    p.awaitingCts.erase(it);
    return true;
  }
  for (auto it = p.sendq.begin(); it != p.sendq.end(); ++it) {
    auto& item = **it;
    if (item.req != req) continue;
    if ((item.hdr.magicKind & 0xff) != kEager || item.hdrOff != 0) return false;
    p.sendq.erase(it);
    if (p.sendq.empty()) {
      p.wantOut = false;
      updateInterestLocked(peer);
    }
    return true;
  }
  return false;
}

std::vector<std::pair<int, uint64_t>> TcpTransport::unmatched() const {
  std::lock_guard<std::mutex> lk(mu_);
  return match_.unmatched();
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
