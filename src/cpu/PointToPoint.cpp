// The CPU engine's send, recv and recv-from-any-source: posted to the transport at once, outside
// the op queue (they never block a collective), completed by the transport's thread.
#include "myccl/cpu/Engine.hpp"

#include "cpu/Staging.hpp"
#include "myccl/cpu/algorithms/Tags.hpp"
#include "myccl/cpu/transport/Transport.hpp"

#include <ATen/ATen.h>

namespace myccl::cpu {

namespace {

// Runs inside the request's own completion (so `req` is alive); captures no RequestPtr, which
// would keep a withdrawn request alive forever through its own callback.
struct P2PDone {
  std::shared_ptr<Stats> stats;
  std::shared_ptr<Recorder> recorder;
  uint64_t record;
  const char* transport;
  std::shared_ptr<std::atomic<int64_t>> inFlight;  // the engine's count of posted requests
};

void finishP2P(const c10::intrusive_ptr<MycclWork>& w, const Request& req, const std::function<void()>& onOk,
               const P2PDone& d) {
  const char* via = req.via() ? req.via() : d.transport;
  std::string msg;
  try {
    req.rethrow();
    if (onOk) onOk();
    d.stats->add(w->info().name, via, req.nbytes(),
                 std::chrono::duration<double>(Clock::now() - w->startTime()).count());
    d.recorder->ended(d.record, "p2p", via, req.nbytes(), "");
    w->setSourceRank(req.source());
  } catch (const std::exception& e) {
    msg = "myccl: " + w->info().describe() + " failed: " + e.what();
    d.recorder->ended(d.record, "p2p", via, req.nbytes(), msg);
  }
  // Out of the count before a waiter can see the Work done.
  d.inFlight->fetch_sub(1, std::memory_order_relaxed);
  if (msg.empty()) {
    w->markDone();
  } else {
    w->markDone(makeDistError(msg));
  }
}

// Lets a timed-out wait() withdraw the receive without keeping transport or request alive. A
// withdrawn request never completes, so it leaves the engine's in-flight count here.
std::function<bool()> canceller(const std::shared_ptr<Transport>& tp, const RequestPtr& req,
                                std::shared_ptr<std::atomic<int64_t>> inFlight) {
  std::weak_ptr<Transport> wt = tp;
  std::weak_ptr<Request> wr = req;
  return [wt, wr, inFlight = std::move(inFlight)] {
    auto t = wt.lock();
    auto r = wr.lock();
    const bool withdrawn = t && r && t->cancel(r);
    if (withdrawn) inFlight->fetch_sub(1, std::memory_order_relaxed);
    return withdrawn;
  };
}

}  // namespace

CpuEngine::WorkPtr CpuEngine::send(OpInfo info, at::Tensor t, int peer, int tag) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  at::Tensor c = t.contiguous();
  w->setCanceller([] { return false; });
  w->setSpinWait(p2pSpin_);
  w->markStarted();
  p2pInFlight_->fetch_add(1, std::memory_order_relaxed);
  auto req = transport_->isend(peer, p2pTag(tag), c.data_ptr(), c.numel() * c.element_size());
  P2PDone d{stats_, recorder_, recorder_->queued(w->info(), true), transport_->name(), p2pInFlight_};
  req->onDone([w, r = req.get(), c, d] { finishP2P(w, *r, nullptr, d); });
  return w;
}

// A receive posted by `post(buffer, nbytes)`: into the tensor, or a contiguous stand-in written
// back once it arrived.
template <class Post>
CpuEngine::WorkPtr CpuEngine::receive(OpInfo info, const at::Tensor& t, Post&& post) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  auto s = Staged::of(t, false);
  w->setSpinWait(p2pSpin_);
  w->markStarted();
  p2pInFlight_->fetch_add(1, std::memory_order_relaxed);
  RequestPtr req = post(s.ptr(), s.nbytes());
  w->setCanceller(canceller(transport_, req, p2pInFlight_));
  P2PDone d{stats_, recorder_, recorder_->queued(w->info(), true), transport_->name(), p2pInFlight_};
  req->onDone([w, r = req.get(), s, d] { finishP2P(w, *r, [s] { s.commit(); }, d); });
  return w;
}

CpuEngine::WorkPtr CpuEngine::recv(OpInfo info, at::Tensor t, int peer, int tag) {
  return receive(std::move(info), t, [&](void* p, size_t n) { return transport_->irecv(peer, p2pTag(tag), p, n); });
}

CpuEngine::WorkPtr CpuEngine::recvAny(OpInfo info, at::Tensor t, int tag) {
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) peers.push_back(r);
  return receive(std::move(info), t, [&](void* p, size_t n) { return transport_->irecvAny(peers, p2pTag(tag), p, n); });
}

}  // namespace myccl::cpu
