// Receive matching as plain bookkeeping: posted receives waiting for a message, and messages
// (whole, partial or only announced) waiting for a receive, per peer, with receive-from-any over
// a set of peers. No sockets, threads or locks: TcpTransport runs it under its own mutex, and
// tests/cpp/test_matching.cpp runs it alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace myccl::cpu {

// What matching reads of a posted receive; the transport's record derives from it.
struct Posting {
  uint64_t tag = 0;
  int peer = -1;           // the one peer it takes from, unless anyOf is set
  std::vector<int> anyOf;  // non-empty: a receive-from-any over these peers
  uint64_t order = 0;      // when it was queued (set by Matcher)
};

// What matching reads of a message that arrived before its receive; the transport's record
// derives from it and updates `complete` as the payload comes in.
struct Arrival {
  uint64_t tag = 0;
  // Every byte is here, or in a shared-memory slot the sender filled. Not so for a message still
  // arriving, nor for an announcement: its bytes stay with the sender until a receive asks.
  bool complete = false;
  uint64_t order = 0;  // when it arrived (set by Matcher)
};

// Why a message and the receive it matched cannot be delivered ("" when they can). A message
// never fills a receive of another size (no truncation, no overflow); agreement words (0: none)
// catch ranks that disagree about an op's dtype, reduce op or element count.
inline std::string matchError(int peer, uint64_t msgBytes, uint32_t msgCheck, uint64_t recvBytes,
                              uint32_t recvCheck) {
  if (msgBytes != recvBytes)
    return "message from rank " + std::to_string(peer) + " has " + std::to_string(msgBytes) +
           " bytes but the receive expects " + std::to_string(recvBytes);
  if (msgCheck && recvCheck && msgCheck != recvCheck) {
    char buf[320];
    snprintf(buf, sizeof(buf),
             "rank %d sent data for a different variant of this op (agreement word %08x, this rank %08x): "
             "the ranks disagree about its dtype, reduce op or element count",
             peer, msgCheck, recvCheck);
    return buf;
  }
  return "";
}

// R derives from Posting, M from Arrival; both are held by shared_ptr, so the caller keeps
// whatever else it needs in them. Messages between a pair with one tag match in the order they
// came; receives in the order they were posted.
template <class R, class M>
class Matcher {
 public:
  using RecvPtr = std::shared_ptr<R>;
  using MsgPtr = std::shared_ptr<M>;

  explicit Matcher(int size) : peers_(static_cast<size_t>(size)) {
    static_assert(std::is_base_of_v<Posting, R> && std::is_base_of_v<Arrival, M>);
  }

  struct Found {
    int peer = -1;
    MsgPtr msg;  // null: no waiting message matches
  };

  // A receive was posted: the waiting message it takes, no longer waiting. From each peer only
  // the first message with its tag is a candidate; across a receive-from-any's peers, the
  // candidate that arrived first wins.
  Found takeArrived(const Posting& r) {
    Found best;
    typename std::deque<MsgPtr>::iterator bestIt;
    auto consider = [&](int peer) {
      auto& q = peers_[peer].arrived;
      auto it = std::find_if(q.begin(), q.end(), [&](const MsgPtr& m) { return m->tag == r.tag; });
      if (it != q.end() && (!best.msg || (*it)->order < best.msg->order)) {
        best = {peer, *it};
        bestIt = it;
      }
    };
    if (r.anyOf.empty()) {
      consider(r.peer);
    } else {
      for (int peer : r.anyOf) consider(peer);
    }
    if (best.msg) peers_[best.peer].arrived.erase(bestIt);
    return best;
  }

  // Queues a receive that found no message. False, queuing nothing, when it can never match: its
  // peer is gone, or every peer of a receive-from-any is.
  bool post(RecvPtr r) {
    if (r->anyOf.empty()) {
      if (peers_[r->peer].gone) return false;
      r->order = next_++;
      peers_[r->peer].posted.push_back(std::move(r));
      return true;
    }
    if (allGone(*r)) return false;
    r->order = next_++;
    any_.push_back(std::move(r));
    return true;
  }

  // A message with `tag` arrived from `peer`: the queued receive it fills, no longer queued
  // (null: none). The peer's own receives and the receives-from-any that include it compete by
  // the order in which they were posted.
  RecvPtr takePosted(int peer, uint64_t tag) {
    auto& q = peers_[peer].posted;
    auto pit = std::find_if(q.begin(), q.end(), [&](const RecvPtr& r) { return r->tag == tag; });
    auto ait = std::find_if(any_.begin(), any_.end(), [&](const RecvPtr& r) {
      return r->tag == tag && std::find(r->anyOf.begin(), r->anyOf.end(), peer) != r->anyOf.end();
    });
    RecvPtr match;
    if (pit != q.end() && (ait == any_.end() || (*pit)->order < (*ait)->order)) {
      match = std::move(*pit);
      q.erase(pit);
    } else if (ait != any_.end()) {
      match = std::move(*ait);
      any_.erase(ait);
    }
    return match;
  }

  // Keeps a message no receive was waiting for, behind the earlier ones from its peer.
  void arrived(int peer, MsgPtr m) {
    m->order = next_++;
    peers_[peer].arrived.push_back(std::move(m));
  }

  // Withdraws the queued receive that `is` picks: among the receives-from-any, then among
  // `peer`'s own (-1: skip those). False when there is none: it was matched, or never queued.
  template <class Is>
  bool cancel(int peer, Is&& is) {
    auto drop = [&](std::deque<RecvPtr>& q) {
      auto it = std::find_if(q.begin(), q.end(), [&](const RecvPtr& r) { return is(*r); });
      if (it == q.end()) return false;
      q.erase(it);
      return true;
    };
    if (drop(any_)) return true;
    return peer >= 0 && peer < static_cast<int>(peers_.size()) && drop(peers_[peer].posted);
  }

  // Messages no receive has taken: (peer, tag), by peer, then in the order they came.
  std::vector<std::pair<int, uint64_t>> unmatched() const {
    std::vector<std::pair<int, uint64_t>> out;
    for (size_t peer = 0; peer < peers_.size(); ++peer)
      for (const auto& m : peers_[peer].arrived) out.emplace_back(static_cast<int>(peer), m->tag);
    return out;
  }

  struct Orphans {
    std::vector<RecvPtr> posted;  // the peer's own queued receives
    std::vector<RecvPtr> any;     // receives-from-any none of whose peers is left
  };

  // `peer` is gone: returns the receives that can never match now (for the caller to fail). Its
  // messages that arrived whole stay: a peer that did its part of an op and exited must not
  // make this rank lose what it sent. Announcements and partial messages are dropped: their
  // bytes can no longer come.
  Orphans dropPeer(int peer) {
    Orphans out;
    auto& p = peers_[peer];
    p.gone = true;
    out.posted.assign(std::make_move_iterator(p.posted.begin()), std::make_move_iterator(p.posted.end()));
    p.posted.clear();
    std::erase_if(p.arrived, [](const MsgPtr& m) { return !m->complete; });
    for (auto it = any_.begin(); it != any_.end();) {
      if (allGone(**it)) {
        out.any.push_back(std::move(*it));
        it = any_.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }

  // Every queued receive-from-any, no longer queued (the transport is closing).
  std::vector<RecvPtr> takeAny() {
    std::vector<RecvPtr> out(std::make_move_iterator(any_.begin()), std::make_move_iterator(any_.end()));
    any_.clear();
    return out;
  }

 private:
  struct PerPeer {
    std::deque<RecvPtr> posted;  // receives from this peer only, in post order
    std::deque<MsgPtr> arrived;  // messages no receive has taken, in arrival order
    bool gone = false;
  };

  bool allGone(const Posting& r) const {
    return std::all_of(r.anyOf.begin(), r.anyOf.end(), [&](int peer) { return peers_[peer].gone; });
  }

  std::vector<PerPeer> peers_;
  std::deque<RecvPtr> any_;  // receives-from-any, in post order
  uint64_t next_ = 1;        // orders receives and messages alike (each only among its own kind)
};

}  // namespace myccl::cpu
