// One-sided windows on a CPU group (Window.hpp): registration (a collective exchange of what
// each rank registered, and the mapping of local peers' shared memory), puts and signals, and
// the receive chains through which an owner's transport thread applies remote puts.
#include "myccl/cpu/Window.hpp"

#if MYCCL_HAS_WINDOW

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstring>
#include <deque>

#include "myccl/Arguments.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Work.hpp"
#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/algorithms/Tags.hpp"
#include "myccl/cpu/transport/Shm.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

namespace {

// What travels before every put's payload, and alone for a signal (step 0 of the window's tag).
struct WindowHeader {
  uint32_t kind = 0;  // kPut or kSignal
  uint32_t pad = 0;
  uint64_t offset = 0;  // bytes into the owner's window
  uint64_t nbytes = 0;
};
// A fence says "every put I made before is ahead of this on the chain" (tensor_deregister).
constexpr uint32_t kPut = 1, kSignal = 2, kFence = 3;
constexpr uint32_t kHeaderStep = 0, kPayloadStep = 1;

// What a rank tells the others when it registers (int64 words of an all_gather).
enum Desc : int { kNbytes, kElemSize, kDtype, kShared, kRegion0, kRegion1, kDescWords };

using WorkPtr = c10::intrusive_ptr<MycclWork>;

}  // namespace

struct WindowState {
  std::mutex mu;
  Transport* tp = nullptr;
  uint64_t tagBase = 0;
  int rank = 0, size = 1;
  std::string group;
  std::chrono::milliseconds timeout{0};
  uint64_t ops = 0;  // numbers this rank's window ops (OpInfo::seq)

  bool registered = false;
  at::Tensor mine;  // held while registered when owning (else the caller keeps it alive)
  char* base = nullptr;
  int64_t nbytes = 0;

  struct PeerInfo {
    int64_t nbytes = 0;
    int64_t elemSize = 0;
    at::ScalarType dtype = at::kByte;
    char* mapped = nullptr;  // the peer's window in this process (same host, shared memory)
  };
  std::vector<PeerInfo> peers;

  // Per peer: the receive chain for its puts and signals, and the signals not yet waited for.
  struct Inbox {
    WindowHeader hdr;
    RequestPtr pending;  // the chain's posted receive (header or payload)
    std::vector<char> sink;
    uint64_t signals = 0;
    uint64_t fences = 0;
    std::deque<WorkPtr> waiters;
    std::string error;  // the chain stopped (peer gone, window closed)
  };
  std::vector<std::unique_ptr<Inbox>> inbox;
  std::condition_variable fenced;  // a fence arrived (tensor_deregister waits for one per peer)

  uint64_t tag(uint32_t step) const { return tagBase | step; }

  OpInfo info(const char* name, const std::string& what, std::chrono::milliseconds t) {
    OpInfo i;
    i.type = c10d::OpType::UNKNOWN;
    i.name = name;
    i.op = what;
    i.rank = rank;
    i.size = size;
    i.group = group;
    i.timeout = (t == c10d::kUnsetTimeout || t.count() <= 0) ? timeout : t;
    std::lock_guard<std::mutex> lk(mu);
    i.seq = ++ops;
    return i;
  }
};

namespace {

void postHeader(const std::shared_ptr<WindowState>& st, int peer);

// Called with st->mu held: a signal from `peer` arrived (or one to this rank itself).
WorkPtr deliverSignalLocked(WindowState& st, int peer) {
  auto& in = *st.inbox[peer];
  if (!in.waiters.empty()) {
    WorkPtr w = in.waiters.front();
    in.waiters.pop_front();
    return w;
  }
  ++in.signals;
  return {};
}

// The chain for `peer` stops: its waiters fail with `why`.
void stopChain(const std::shared_ptr<WindowState>& st, int peer, const std::string& why) {
  std::deque<WorkPtr> waiters;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    auto& in = *st->inbox[peer];
    if (in.error.empty()) in.error = why;
    in.pending.reset();
    waiters.swap(in.waiters);
  }
  for (auto& w : waiters) w->markDone(makeDistError("myccl: " + w->info().describe() + ": " + why));
}

void onPayload(const std::shared_ptr<WindowState>& st, int peer, const RequestPtr& req) {
  try {
    req->rethrow();
  } catch (const std::exception& e) {
    return stopChain(st, peer, std::string("window: a put from rank ") + std::to_string(peer) + " failed: " + e.what());
  }
  postHeader(st, peer);
}

void onHeader(const std::shared_ptr<WindowState>& st, int peer, const RequestPtr& req) {
  try {
    req->rethrow();
  } catch (const std::exception& e) {
    return stopChain(st, peer, std::string("window: the link to rank ") + std::to_string(peer) + " ended: " + e.what());
  }
  WorkPtr woken;
  {
    std::unique_lock<std::mutex> lk(st->mu);
    auto& in = *st->inbox[peer];
    if (!in.error.empty()) return;
    const WindowHeader h = in.hdr;
    if (h.kind == kSignal) {
      woken = deliverSignalLocked(*st, peer);
    } else if (h.kind == kFence) {
      ++in.fences;
      st->fenced.notify_all();
    } else {
      // The sender checked the bounds against what this rank published; a put that still does
      // not fit (a bug, or a registration in between) is read and dropped, never written past.
      char* dst;
      if (st->base != nullptr && h.offset + h.nbytes <= static_cast<uint64_t>(st->nbytes)) {
        dst = st->base + h.offset;
      } else {
        in.sink.resize(h.nbytes);
        dst = in.sink.data();
      }
      auto r = st->tp->irecv(peer, st->tag(kPayloadStep), dst, h.nbytes);
      in.pending = r;
      lk.unlock();
      std::weak_ptr<WindowState> weak = st;
      r->onDone([weak, peer, r] {
        if (auto s = weak.lock()) onPayload(s, peer, r);
      });
      return;
    }
  }
  if (woken) woken->markDone();
  postHeader(st, peer);
}

void postHeader(const std::shared_ptr<WindowState>& st, int peer) {
  RequestPtr r;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    auto& in = *st->inbox[peer];
    if (!in.error.empty()) return;
    r = st->tp->irecv(peer, st->tag(kHeaderStep), &in.hdr, sizeof(WindowHeader));
    in.pending = r;
  }
  std::weak_ptr<WindowState> weak = st;
  r->onDone([weak, peer, r] {
    if (auto s = weak.lock()) onHeader(s, peer, r);
  });
}

// Sends `hdr` (and `payload`, if any) to `peer` on the window's tag; `w` completes once both
// are out of this rank's hands (local completion: the bytes are the peer's to apply in order).
void sendToPeer(WindowState& st, int peer, const WindowHeader& hdr, const at::Tensor& payload, const WorkPtr& w) {
  auto header = std::make_shared<WindowHeader>(hdr);
  std::vector<RequestPtr> reqs;
  reqs.push_back(st.tp->isend(peer, st.tag(kHeaderStep), header.get(), sizeof(WindowHeader)));
  if (payload.defined() && hdr.nbytes > 0) {
    reqs.push_back(st.tp->isend(peer, st.tag(kPayloadStep), payload.data_ptr(), hdr.nbytes));
  }
  auto left = std::make_shared<std::atomic<int>>(static_cast<int>(reqs.size()));
  for (auto& r : reqs) {
    r->onDone([r, w, left, header] {
      try {
        r->rethrow();
      } catch (const std::exception& e) {
        w->markDone(makeDistError("myccl: " + w->info().describe() + " failed: " + e.what()));
        return;
      }
      if (left->fetch_sub(1) == 1) w->markDone();
    });
  }
}

}  // namespace

MycclWindow::MycclWindow(c10::intrusive_ptr<c10d::Backend> backend, std::shared_ptr<CpuEngine> engine, uint64_t id,
                         std::chrono::milliseconds timeout, std::string group)
    : backend_(std::move(backend)), engine_(std::move(engine)), st_(std::make_shared<WindowState>()) {
  st_->tp = &engine_->transport();
  st_->tagBase = collectiveTagBase(OpCode::Window, id);
  st_->rank = backend_->getRank();
  st_->size = backend_->getSize();
  st_->group = std::move(group);
  st_->timeout = timeout;
  st_->peers.resize(st_->size);
  for (int r = 0; r < st_->size; ++r) st_->inbox.push_back(std::make_unique<WindowState::Inbox>());
  // Every peer's puts and signals are applied from the moment the window exists: a peer may
  // signal before this rank registers anything.
  for (int r = 0; r < st_->size; ++r)
    if (r != st_->rank) postHeader(st_, r);
}

MycclWindow::~MycclWindow() {
  for (int r = 0; r < st_->size; ++r) {
    if (r == st_->rank) continue;
    RequestPtr pending;
    {
      std::lock_guard<std::mutex> lk(st_->mu);
      pending = st_->inbox[r]->pending;
    }
    if (pending) st_->tp->cancel(pending);
    stopChain(st_, r, "window destroyed");
  }
}

std::string MycclWindow::where(const char* op) const {
  return std::string("window ") + op + " (rank " + std::to_string(st_->rank) + ")";
}

void MycclWindow::checkPeer(const char* op, int64_t peer) const {
  MYCCL_CHECK_ARG(peer >= 0 && peer < st_->size, where(op), ": rank ", peer, " is not in [0, ", st_->size, ")");
}

void MycclWindow::checkRegistered(const char* op) const {
  std::lock_guard<std::mutex> lk(st_->mu);
  MYCCL_CHECK_ARG(st_->registered, where(op), ": no tensor is registered with this window; call tensor_register() "
                  "on every rank first");
}

void MycclWindow::tensor_register(const at::Tensor& tensor, bool owning) {
  const auto w = where("tensor_register");
  MYCCL_CHECK_ARG(tensor.defined() && tensor.device().is_cpu(), w, ": the window's tensor must be a CPU tensor, got ",
                  tensor.defined() ? describe(tensor) : std::string("an undefined tensor"));
  MYCCL_CHECK_ARG(tensor.is_contiguous(), w, ": the window's tensor must be contiguous (puts address it by element "
                  "offset), got a tensor of shape ", shapeOf(tensor), " that is not");
  const int64_t nbytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  {
    // Where puts land, before any peer can learn of it: a peer may put as soon as it has this
    // rank's part of the exchange below, before this rank's own exchange has returned.
    std::lock_guard<std::mutex> lk(st_->mu);
    MYCCL_CHECK_ARG(!st_->registered, w, ": a tensor is already registered; tensor_deregister() it first");
    st_->mine = owning ? tensor : at::Tensor();
    st_->base = static_cast<char*>(tensor.data_ptr());
    st_->nbytes = nbytes;
  }
  // Shared with this host's other ranks when the tensor lives in registered memory
  // (allocate_tensor): they then write into it directly.
  ShmGroup* shm = engine_->sharedMemory();
  ShmGroup::Region region;
  if (shm != nullptr && nbytes > 0) region = shm->locate(tensor.data_ptr(), static_cast<size_t>(nbytes));
  at::Tensor mine = at::zeros({kDescWords}, at::kLong);
  auto* d = mine.data_ptr<int64_t>();
  d[kNbytes] = nbytes;
  d[kElemSize] = tensor.element_size();
  d[kDtype] = static_cast<int64_t>(tensor.scalar_type());
  d[kShared] = region.slot >= 0 ? 1 : 0;
  ShmGroup::packRegion(region, reinterpret_cast<uint64_t*>(d + kRegion0));
  std::vector<at::Tensor> all;
  for (int r = 0; r < st_->size; ++r) all.push_back(at::empty({kDescWords}, at::kLong));
  std::vector<std::vector<at::Tensor>> outs{all};
  std::vector<at::Tensor> ins{mine};
  backend_->allgather(outs, ins, c10d::AllgatherOptions())->wait();
  const Topology& topo = engine_->topology();
  std::vector<WindowState::PeerInfo> peers(st_->size);
  for (int r = 0; r < st_->size; ++r) {
    const auto* p = outs[0][r].data_ptr<int64_t>();
    peers[r].nbytes = p[kNbytes];
    peers[r].elemSize = p[kElemSize];
    peers[r].dtype = static_cast<at::ScalarType>(p[kDtype]);
    if (r != st_->rank && p[kShared] && shm != nullptr && topo.sameHost(r, st_->rank)) {
      const int local = static_cast<int>(
          std::find(topo.localRanks.begin(), topo.localRanks.end(), r) - topo.localRanks.begin());
      peers[r].mapped = shm->resolve(local, ShmGroup::unpackRegion(reinterpret_cast<const uint64_t*>(p + kRegion0)));
    }
  }
  std::lock_guard<std::mutex> lk(st_->mu);
  st_->peers = std::move(peers);
  st_->registered = true;
}

void MycclWindow::tensor_deregister() {
  const auto w = where("tensor_deregister");
  checkRegistered("tensor_deregister");
  // Collective: every rank sends each peer a fence behind its puts on that peer's chain, and
  // waits for one from every peer; once it has them, every put made into its tensor before the
  // peers deregistered has landed, and none comes after.
  for (int r = 0; r < st_->size; ++r) {
    if (r == st_->rank) continue;
    WindowHeader h;
    h.kind = kFence;
    auto done = c10::make_intrusive<MycclWork>(st_->info("fence", "window fence to rank " + std::to_string(r),
                                                         c10d::kUnsetTimeout),
                                               std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
    sendToPeer(*st_, r, h, at::Tensor(), done);
  }
  std::unique_lock<std::mutex> lk(st_->mu);
  auto missing = [&] {
    std::vector<int> m;
    for (int r = 0; r < st_->size; ++r)
      if (r != st_->rank && st_->inbox[r]->fences == 0 && st_->inbox[r]->error.empty()) m.push_back(r);
    return m;
  };
  if (!st_->fenced.wait_for(lk, st_->timeout, [&] { return missing().empty(); })) {
    std::string names;
    for (int r : missing()) names += (names.empty() ? "" : ", ") + std::to_string(r);
    throwDistError("myccl: " + w + ": Timed out after " + std::to_string(st_->timeout.count()) +
                   " ms waiting for rank(s) " + names + " to deregister too (tensor_deregister is collective)");
  }
  for (int r = 0; r < st_->size; ++r)
    if (r != st_->rank && st_->inbox[r]->fences > 0) --st_->inbox[r]->fences;
  st_->registered = false;
  st_->base = nullptr;
  st_->nbytes = 0;
  st_->mine = at::Tensor();
  for (auto& p : st_->peers) p = WindowState::PeerInfo{};
}

c10::intrusive_ptr<c10d::Work> MycclWindow::put(const at::Tensor& tensor, int64_t dstRank,
                                                int64_t targetOffsetNelems, bool asyncOp,
                                                const c10d::PutOptions& opts) {
  const auto w = where("put");
  checkPeer("put", dstRank);
  checkRegistered("put");
  MYCCL_CHECK_ARG(tensor.defined() && tensor.device().is_cpu(), w, ": expected a CPU tensor, got ",
                  tensor.defined() ? describe(tensor) : std::string("an undefined tensor"));
  WindowState::PeerInfo target;
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    target = st_->peers[dstRank];
  }
  MYCCL_CHECK_ARG(tensor.scalar_type() == target.dtype, w, ": rank ", dstRank, "'s window holds ",
                  scalarTypeName(target.dtype), ", the tensor put is ", scalarTypeName(tensor.scalar_type()));
  MYCCL_CHECK_ARG(targetOffsetNelems >= 0, w, ": target offset ", targetOffsetNelems, " is negative");
  const int64_t nbytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
  const int64_t offset = targetOffsetNelems * target.elemSize;
  MYCCL_CHECK_ARG(offset + nbytes <= target.nbytes, w, ": ", tensor.numel(), " elements at offset ",
                  targetOffsetNelems, " do not fit rank ", dstRank, "'s window of ",
                  target.elemSize ? target.nbytes / target.elemSize : 0, " elements");
  at::Tensor src = tensor.contiguous();
  auto work = c10::make_intrusive<MycclWork>(
      st_->info("put", "window put of " + std::to_string(nbytes) + " bytes to rank " + std::to_string(dstRank),
                opts.timeout),
      std::vector<at::Tensor>{src}, std::vector<at::Tensor>{});
  if (dstRank == st_->rank || target.mapped != nullptr) {
    // Straight into the window's memory: ours, or a local peer's shared memory.
    char* dst;
    {
      std::lock_guard<std::mutex> lk(st_->mu);
      dst = (dstRank == st_->rank ? st_->base : target.mapped) + offset;
    }
    if (nbytes > 0) std::memcpy(dst, src.data_ptr(), static_cast<size_t>(nbytes));
    work->markDone();
  } else {
    WindowHeader h;
    h.kind = kPut;
    h.offset = static_cast<uint64_t>(offset);
    h.nbytes = static_cast<uint64_t>(nbytes);
    sendToPeer(*st_, static_cast<int>(dstRank), h, src, work);
  }
  if (!asyncOp) work->wait(work->info().timeout);  // a large put waits for the peer's transport
  return work;
}

at::Tensor MycclWindow::map_remote_tensor(int64_t rank) {
  const auto w = where("map_remote_tensor");
  checkPeer("map_remote_tensor", rank);
  checkRegistered("map_remote_tensor");
  std::lock_guard<std::mutex> lk(st_->mu);
  const auto& p = st_->peers[rank];
  char* base = rank == st_->rank ? st_->base : p.mapped;
  MYCCL_CHECK_ARG(base != nullptr || p.nbytes == 0, w, ": rank ", rank, "'s window cannot be mapped here (",
                  engine_->topology().sameHost(static_cast<int>(rank), st_->rank)
                      ? "its tensor is not in shared memory: register one from allocate_tensor()"
                      : "it is on another host",
                  "); use put() and get_attr() says SEPARATE");
  const int64_t numel = p.elemSize ? p.nbytes / p.elemSize : 0;
  // A view of the peer's memory: the mapping stays while this rank's group lives, the memory while
  // the peer keeps its registration.
  return at::from_blob(base, {numel}, [](void*) {}, at::TensorOptions().dtype(p.dtype).device(at::kCPU));
}

c10::intrusive_ptr<c10d::Work> MycclWindow::signal(int64_t peerRank, bool asyncOp, const c10d::SignalOptions& opts) {
  checkPeer("signal", peerRank);
  auto work = c10::make_intrusive<MycclWork>(
      st_->info("signal", "window signal to rank " + std::to_string(peerRank), opts.timeout),
      std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  if (peerRank == st_->rank) {
    WorkPtr woken;
    {
      std::lock_guard<std::mutex> lk(st_->mu);
      woken = deliverSignalLocked(*st_, st_->rank);
    }
    if (woken) woken->markDone();
    work->markDone();
  } else {
    // Behind this rank's earlier puts to the peer on the same chain: when the peer's wait_signal
    // returns, every one of them is in its window.
    WindowHeader h;
    h.kind = kSignal;
    sendToPeer(*st_, static_cast<int>(peerRank), h, at::Tensor(), work);
  }
  if (!asyncOp) work->wait(work->info().timeout);
  return work;
}

c10::intrusive_ptr<c10d::Work> MycclWindow::wait_signal(int64_t peerRank, bool asyncOp,
                                                        const c10d::WaitSignalOptions& opts) {
  checkPeer("wait_signal", peerRank);
  auto work = c10::make_intrusive<MycclWork>(
      st_->info("wait_signal", "window wait_signal from rank " + std::to_string(peerRank), opts.timeout),
      std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  std::string error;
  bool ready = false;
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    auto& in = *st_->inbox[peerRank];
    if (in.signals > 0) {
      --in.signals;
      ready = true;
    } else if (!in.error.empty()) {
      error = in.error;
    } else {
      in.waiters.push_back(work);
    }
  }
  if (ready) {
    work->markDone();
  } else if (!error.empty()) {
    work->markDone(makeDistError("myccl: " + work->info().describe() + ": " + error));
  } else {
    // wait() gives up at the op's timeout and withdraws the waiter.
    std::weak_ptr<WindowState> weak = st_;
    MycclWork* raw = work.get();
    const int peer = static_cast<int>(peerRank);
    work->setCanceller([weak, raw, peer] {
      auto s = weak.lock();
      if (!s) return false;
      std::lock_guard<std::mutex> lk(s->mu);
      auto& q = s->inbox[peer]->waiters;
      auto it = std::find_if(q.begin(), q.end(), [&](const WorkPtr& x) { return x.get() == raw; });
      if (it == q.end()) return false;
      q.erase(it);
      return true;
    });
  }
  if (!asyncOp) work->wait();
  return work;
}

c10d::WindowAttr MycclWindow::get_attr(int64_t peerRank) {
  checkPeer("get_attr", peerRank);
  c10d::WindowAttr attr;
  std::lock_guard<std::mutex> lk(st_->mu);
  const bool unified = peerRank == st_->rank ? st_->registered : st_->peers[peerRank].mapped != nullptr;
  attr.access_type = unified ? c10d::WindowAccessType::UNIFIED : c10d::WindowAccessType::SEPARATE;
  return attr;
}

}  // namespace myccl::cpu

#endif  // MYCCL_HAS_WINDOW
