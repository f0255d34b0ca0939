// A group on links it shares with the group it was split from (Channel.hpp). Every request is
// posted on the links with the group's channel in its tag and peers translated to the links'
// numbering; the request the group sees completes when the links' one does, in its own numbering.
#include "myccl/cpu/transport/Channel.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>

#include "myccl/cpu/algorithms/Tags.hpp"

namespace myccl::cpu {

namespace {

// A failure notice: the reason, cut to fit one fixed-size eager message.
constexpr size_t kNoteBytes = 1024;

}  // namespace

SharedLinks::SharedLinks(std::shared_ptr<Transport> base, const std::string& owner)
    : base_(std::move(base)), owner_(owner.empty() ? "the group it was split from" : "group '" + owner + "'") {}

void SharedLinks::hold() {
  std::lock_guard<std::mutex> lk(mu_);
  ++users_;
}

void SharedLinks::release(const std::string& reason) {
  bool last;
  {
    std::lock_guard<std::mutex> lk(mu_);
    last = --users_ == 0;
  }
  if (last) base_->close(reason);
}

int SharedLinks::nextChannel() {
  std::lock_guard<std::mutex> lk(mu_);
  return channels_ < kMaxChannel ? ++channels_ : -1;
}

struct ChannelTransport::State {
  std::shared_ptr<SharedLinks> links;
  std::vector<int> members;  // this group's rank -> the links' rank
  std::vector<int> local;    // the links' rank -> this group's rank (-1: not a member)
  int rank = 0;
  int channel = 0;
  std::string group;
  std::chrono::milliseconds grace{0};

  struct Live {
    RequestPtr mine, base;
    bool send = false;
  };
  mutable std::mutex mu;
  std::condition_variable posted;
  int posting = 0;  // posts under way outside mu
  bool closed = false;
  std::string closeReason;
  std::unordered_map<const Request*, Live> live;  // posted on the links, not yet done
  std::vector<std::string> gone;                  // by rank: why it left the group (a notice came)
  std::vector<char> goneFailed;                   // by rank: it left because it failed
  std::vector<std::array<char, kNoteBytes>> notes;
  std::vector<RequestPtr> noteRecvs;

  std::mutex viewMu;  // guards view: the notices' callbacks may outlive it
  ChannelTransport* view = nullptr;

  Transport& base() const { return links->base(); }
  int toLocal(int peer) const { return peer >= 0 && peer < static_cast<int>(local.size()) ? local[peer] : -1; }
  uint64_t wire(uint64_t tag) const { return withChannel(tag, channel); }
  uint64_t noteTag() const { return wire(collectiveTagBase(OpCode::ChannelClose, 0)); }

  // The links' error, in this group's words.
  std::string translate(const CommError& e) const {
    std::string msg = e.what();
    if (e.kind() == CommErrorKind::Aborted) return "the links shared with " + links->owner() + " closed: " + msg;
    const int mine = toLocal(e.peer());
    if (mine >= 0 && mine != e.peer()) {
      msg += " (rank " + std::to_string(e.peer()) + " of " + links->owner() + " is rank " +
             std::to_string(mine) + " of this one)";
    }
    return msg;
  }

  // Posts on the links (`postBase`) unless the group is closed or `peer` has gone. One exception:
  // a receive from a peer that left in order. What that peer sent before its notice came before it
  // on one ordered stream, and its eager messages wait here whole: a receive that takes one
  // completes as it posts. Anything else it finds (nothing, or an announcement the peer withdrew
  // as it left) will never be answered, so it fails with the peer's notice. A notice that comes
  // while this posts is treated the same way. Not under mu: the links may complete other requests
  // of this group while posting.
  template <class Post>
  static RequestPtr post(const std::shared_ptr<State>& self, RequestPtr mine, bool send, int peer, Post&& postBase) {
    {
      std::lock_guard<std::mutex> lk(self->mu);
      if (self->closed) {
        mine->fail(CommErrorKind::Aborted, self->closeReason, -1);
        return mine;
      }
      if (peer >= 0 && !self->gone[peer].empty() && (send || self->goneFailed[peer])) {
        mine->fail(CommErrorKind::PeerGone, self->gone[peer], peer);
        return mine;
      }
      ++self->posting;  // close() waits for it
    }
    RequestPtr base = postBase();
    std::string gone;
    {
      std::lock_guard<std::mutex> lk(self->mu);
      self->live.emplace(mine.get(), Live{mine, base, send});
      --self->posting;
      if (peer >= 0) gone = self->gone[peer];
    }
    self->posted.notify_all();
    base->onDone([self, mine, base] { self->finished(mine, base); });
    if (!gone.empty() && !base->done()) {
      if (!self->withdraw(Live{mine, base, send})) {
        if (send) return mine;  // its bytes are leaving: it finishes on its own
        std::lock_guard<std::mutex> lk(self->mu);
        self->live.erase(mine.get());  // it took an announcement nobody will send: no byte comes
      }
      mine->fail(CommErrorKind::PeerGone, gone, peer);
    }
    return mine;
  }

  void finished(const RequestPtr& mine, const RequestPtr& base) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (live.erase(mine.get()) == 0) return;  // withdrawn: its owner was told already
    }
    try {
      base->rethrow();
    } catch (const CommError& e) {
      mine->fail(e.kind(), translate(e), toLocal(e.peer()));
      return;
    }
    if (const char* via = base->via()) mine->setVia(via);
    mine->complete(toLocal(base->source()));
  }

  bool withdraw(const Live& e) {
    if (!base().cancel(e.base)) return false;
    std::lock_guard<std::mutex> lk(mu);
    live.erase(e.mine.get());
    return true;
  }

  void notifyView(int peer, const std::string& why) {
    std::lock_guard<std::mutex> lk(viewMu);
    if (view) view->notifyPeerFailed(peer, why);
  }

  // A peer closed its side of the group and said so (first byte: 'F' failed, 'L' left orderly):
  // what waits for it here and has not started moving fails now, as it would on its own links.
  void noticeFrom(int peer, const std::string& notice) {
    const bool failed = notice.empty() || notice[0] != 'L';
    const std::string text = notice.empty() ? notice : notice.substr(1);
    const std::string why = "rank " + std::to_string(peer) + " of group '" + group + "' " +
                            (failed ? "failed and left it: " : "left it: ") + text;
    std::vector<Live> theirs;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (closed || !gone[peer].empty()) return;
      gone[peer] = why;
      goneFailed[peer] = failed;
      for (auto& [k, e] : live)
        if (e.mine->peer() == peer) theirs.push_back(e);
    }
    for (auto& e : theirs)
      if (withdraw(e)) e.mine->fail(CommErrorKind::PeerGone, why, peer);
    if (failed) notifyView(peer, why);
  }

  void sendNotices(const std::string& reason, bool failure) {
    auto text = std::make_shared<std::array<char, kNoteBytes>>();
    text->fill(0);
    (*text)[0] = failure ? 'F' : 'L';
    std::memcpy(text->data() + 1, reason.data(), std::min(reason.size(), kNoteBytes - 2));
    for (int p = 0; p < static_cast<int>(members.size()); ++p) {
      if (p == rank) continue;
      base().isend(members[p], noteTag(), text->data(), kNoteBytes)->onDone([text] {});
    }
  }
};

ChannelTransport::ChannelTransport(std::shared_ptr<SharedLinks> links, std::vector<int> members, int rank, int channel,
                                   std::string group, std::chrono::milliseconds grace)
    : st_(std::make_shared<State>()) {
  auto& s = *st_;
  s.links = std::move(links);
  s.members = std::move(members);
  s.rank = rank;
  s.channel = channel;
  s.group = std::move(group);
  s.grace = grace;
  const int size = static_cast<int>(s.members.size());
  const int linkSize = s.members.empty() ? 0 : *std::max_element(s.members.begin(), s.members.end()) + 1;
  s.local.assign(linkSize, -1);
  for (int r = 0; r < size; ++r) s.local[s.members[r]] = r;
  s.gone.resize(size);
  s.goneFailed.assign(size, 0);
  s.notes.resize(size);
  s.view = this;
  s.links->hold();
  std::weak_ptr<State> weak = st_;
  s.base().addPeerFailedCallback([weak](int peer, const std::string& why) {
    auto st = weak.lock();
    if (!st) return;
    const int mine = st->toLocal(peer);
    if (mine >= 0) st->notifyView(mine, why);
  });
  // One notice receive per peer, into buffers of the state, which each keeps alive until done.
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    auto req = s.base().irecv(s.members[p], s.noteTag(), s.notes[p].data(), kNoteBytes);
    s.noteRecvs.push_back(req);
    auto self = st_;
    Request* raw = req.get();
    req->onDone([self, raw, p] {
      try {
        raw->rethrow();
      } catch (const CommError&) {
        return;  // the links closed
      }
      const auto& n = self->notes[p];
      self->noticeFrom(p, std::string(n.data(), strnlen(n.data(), n.size())));
    });
  }
}

ChannelTransport::~ChannelTransport() {
  close("process group destroyed");
  std::lock_guard<std::mutex> lk(st_->viewMu);
  st_->view = nullptr;
}

const char* ChannelTransport::name() const {
  return st_->base().name();
}

RequestPtr ChannelTransport::send(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check,
                                  bool posted) {
  auto mine = std::make_shared<Request>(peer, tag, nbytes);
  const auto& s = *st_;
  if (peer < 0 || peer >= static_cast<int>(s.members.size())) {
    mine->fail(CommErrorKind::Local, "send to rank " + std::to_string(peer) + ", which is not in the group", peer);
    return mine;
  }
  return State::post(st_, mine, true, peer, [&] {
    return posted ? s.base().isendPosted(s.members[peer], s.wire(tag), data, nbytes, check)
                  : s.base().isend(s.members[peer], s.wire(tag), data, nbytes, check);
  });
}

RequestPtr ChannelTransport::isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check) {
  return send(peer, tag, data, nbytes, check, false);
}

RequestPtr ChannelTransport::isendPosted(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check) {
  return send(peer, tag, data, nbytes, check, true);
}

RequestPtr ChannelTransport::irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check) {
  auto mine = std::make_shared<Request>(peer, tag, nbytes);
  const auto& s = *st_;
  if (peer < 0 || peer >= static_cast<int>(s.members.size())) {
    mine->fail(CommErrorKind::Local, "receive from rank " + std::to_string(peer) + ", which is not in the group", peer);
    return mine;
  }
  return State::post(st_, mine, false, peer,
                     [&] { return s.base().irecv(s.members[peer], s.wire(tag), data, nbytes, check); });
}

RequestPtr ChannelTransport::irecvAny(const std::vector<int>& peers, uint64_t tag, void* data, size_t nbytes) {
  auto mine = std::make_shared<Request>(-1, tag, nbytes);
  const auto& s = *st_;
  std::vector<int> theirs;
  for (int p : peers) {
    if (p < 0 || p >= static_cast<int>(s.members.size())) {
      mine->fail(CommErrorKind::Local, "receive from rank " + std::to_string(p) + ", which is not in the group", p);
      return mine;
    }
    theirs.push_back(s.members[p]);
  }
  return State::post(st_, mine, false, -1, [&] { return s.base().irecvAny(theirs, s.wire(tag), data, nbytes); });
}

void ChannelTransport::close(const std::string& reason, bool failure) {
  auto& s = *st_;
  std::vector<State::Live> entries;
  {
    std::unique_lock<std::mutex> lk(s.mu);
    if (s.closed) return;
    s.closed = true;
    s.closeReason = reason;
    s.posted.wait(lk, [&] { return s.posting == 0; });
    for (auto& [k, e] : s.live) entries.push_back(e);
  }
  for (auto& r : s.noteRecvs) s.base().cancel(r);  // their buffers are the state's own
  s.noteRecvs.clear();
  // What has not started moving is withdrawn; the rest must finish before this group's buffers
  // can go, as the links go on for the other groups.
  std::vector<State::Live> inFlight;
  for (auto& e : entries) {
    if (s.withdraw(e)) {
      e.mine->fail(CommErrorKind::Aborted, reason, -1);
    } else {
      inFlight.push_back(e);
    }
  }
  s.sendNotices(reason, failure);  // peers still waiting for this rank fail at once, with its reason
  const Deadline deadline = Clock::now() + s.grace;
  bool stuck = false;
  for (auto& e : inFlight) {
    try {
      e.base->wait(deadline);
    } catch (const CommError&) {
      stuck = stuck || !e.base->done();
    }
  }
  if (stuck) {
    s.base().close("group '" + s.group + "' (on links shared with " + s.links->owner() +
                       ") closed with a transfer still in flight that it could not withdraw within " +
                       std::to_string(s.grace.count()) + " ms, so every group on these links closes: " + reason,
                   /*failure=*/true);
  }
  s.links->release(reason);
}

std::string ChannelTransport::describePeer(int peer) const {
  const auto& s = *st_;
  if (peer == s.rank) return "self";
  if (peer < 0 || peer >= static_cast<int>(s.members.size())) return "not in the group";
  const int there = s.members[peer];
  return s.base().describePeer(there) + " (links shared with " + s.links->owner() +
         (there != peer ? ", where it is rank " + std::to_string(there) : std::string()) + ")";
}

std::string ChannelTransport::peerGone(int peer) const {
  const auto& s = *st_;
  if (peer < 0 || peer >= static_cast<int>(s.members.size())) return "";
  {
    std::lock_guard<std::mutex> lk(s.mu);
    if (s.closed) return s.closeReason;
    if (!s.gone[peer].empty()) return s.gone[peer];
  }
  return s.base().peerGone(s.members[peer]);
}

bool ChannelTransport::cancel(const RequestPtr& req) {
  auto& s = *st_;
  State::Live e;
  {
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.live.find(req.get());
    if (it == s.live.end()) return false;
    e = it->second;
  }
  return s.withdraw(e);
}

std::vector<std::pair<int, uint64_t>> ChannelTransport::unmatched() const {
  const auto& s = *st_;
  std::vector<std::pair<int, uint64_t>> out;
  for (auto& [peer, tag] : s.base().unmatched()) {
    const int mine = s.toLocal(peer);
    if (mine < 0 || tagChannel(tag) != s.channel) continue;
    if (isCollectiveTag(tag) && tagOpCode(tag) == OpCode::ChannelClose) continue;
    out.emplace_back(mine, withChannel(tag, 0));
  }
  return out;
}

std::vector<int> ChannelTransport::vanishedPeers() const {
  std::vector<int> out;
  for (int peer : st_->base().vanishedPeers())
    if (int mine = st_->toLocal(peer); mine >= 0) out.push_back(mine);
  return out;
}

}  // namespace myccl::cpu
