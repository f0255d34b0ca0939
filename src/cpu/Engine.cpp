// CPU engine: the op queue, the progress thread, tensor staging (non-contiguous tensors are
// copied into contiguous buffers and written back after a successful op) and failure
// handling. Algorithms below this file see only raw buffers; the backend above it sees only
// tensors and Work objects.
#include <pthread.h>
#include "myccl/cpu/Engine.hpp"

#include "myccl/Log.hpp"
#include "myccl/Threads.hpp"
#include "myccl/cpu/Copy.hpp"
#include "myccl/cpu/Parallel.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/transport/Shm.hpp"
#include "myccl/cpu/transport/Channel.hpp"
#include "myccl/cpu/transport/Transport.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <string_view>

namespace myccl::cpu {

namespace {

// A contiguous stand-in for a user tensor; `commit` writes results back when it had to copy.
struct Staged {
  at::Tensor user;
  at::Tensor work;
  static Staged of(const at::Tensor& t, bool needsInput) {
    Staged s;
    s.user = t;
    if (t.is_contiguous()) {
      s.work = t;
    } else if (needsInput) {
      s.work = t.contiguous();
    } else {
      s.work = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    }
    return s;
  }
  char* ptr() const { return static_cast<char*>(work.data_ptr()); }
  size_t nbytes() const { return work.numel() * work.element_size(); }
  void commit() const {
    if (!work.is_same(user)) user.copy_(work);
  }
};

// A private contiguous copy (inputs that must not change, e.g. PREMUL_SUM scaling).
at::Tensor privateCopy(const at::Tensor& t) {
  return t.contiguous().clone(at::MemoryFormat::Contiguous);
}

}  // namespace

CpuEngine::CpuEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
                     std::string group, const Config& cfg, std::shared_ptr<Recorder> recorder,
                     const std::string& keyPrefix)
    : CpuEngine(store, bootstrapGroup(*store, rank, size, timeout, group, cfg, keyPrefix), std::move(group), cfg,
                std::move(recorder)) {}

CpuEngine::CpuEngine(c10::intrusive_ptr<c10d::Store> store, GroupLinks links, std::string group, const Config& cfg,
                     std::shared_ptr<Recorder> recorder)
    : store_(std::move(store)), keyPrefix_(links.keyPrefix), barrierBytes_(2 * links.topo.size),
      transport_(std::move(links.transport)),
      shared_(std::move(links.shared)),
      shm_(std::move(links.shm)), topo_(links.topo), rank_(topo_.rank), size_(topo_.size), group_(std::move(group)),
      cfg_(cfg), scratch_(std::make_unique<Scratch>()), recorder_(std::move(recorder)) {
  if (cfg_.numThreads > 1) par_ = std::make_unique<Parallel>(cfg_.numThreads);  // the op's own thread + helpers
  // A point-to-point wait yields its core for a while before sleeping (MycclWork::wait):
  // MYCCL_SPIN_US, -1 meaning 50 µs. Yielding gives the core to any thread that can run, so
  // unlike a busy spin it is also right when ranks outnumber cores.
  p2pSpin_ = std::chrono::microseconds(cfg_.spinUs >= 0 ? cfg_.spinUs : 50);
  if (cfg_.streamStoreBytes != 0)
    streamMinBytes_ = cfg_.streamStoreBytes < 0 ? streamCopyMinBytes() : static_cast<size_t>(cfg_.streamStoreBytes);
  if (shm_) {
    // A peer that dies never posts again; its TCP link (closed by the kernel) says so at once.
    std::weak_ptr<Transport> tp = transport_;
    shm_->setPeerMonitor([tp](int peer) {
      auto t = tp.lock();
      return t ? t->peerGone(peer) : std::string("transport closed");
    });
    shm_->setDescriber([](const StepDesc& d) { return describeStep(d.op, d.arg); });
  }
  // When a peer fails, dump what this rank was doing: with every survivor's dump,
  // `python -m c10d_ext.trace analyze` can tell who was where.
  std::weak_ptr<Recorder> rec = recorder_;
  const std::string dumpDir = cfg_.flightRecorderDump;
  auto dumped = std::make_shared<std::atomic<bool>>(false);
  transport_->addPeerFailedCallback([rec, dumpDir, dumped](int peer, const std::string& why) {
    auto r = rec.lock();
    if (r && !dumped->exchange(true)) r->dumpTo(dumpDir, "peer rank " + std::to_string(peer) + " failed: " + why);
  });
  thread_ = std::thread([this] { loop(); });
  pthread_setname_np(thread_.native_handle(), "myccl-engine");  // named before it can be listed
}

CpuEngine::~CpuEngine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  joinOrDetach(thread_);
  closeLinks("process group destroyed");
  if (shm_) shm_->abort("process group destroyed");
}

void CpuEngine::closeLinks(const std::string& reason) {
  if (shared_) {
    shared_->release(reason);
  } else {
    transport_->close(reason);
  }
}

SplitSource CpuEngine::splitSource() {
  // The same answer on every rank, whatever each has seen: a split that shares on some ranks and
  // not on others would never meet. (Links a failure closed fail the new group's ops, saying so.)
  if (!shared_ || !cfg_.splitSharesLinks) return {};
  const int channel = shared_->nextChannel();
  if (channel < 0) return {};
  return SplitSource{shared_, topo_, channel};
}

void CpuEngine::checkUsable(const OpInfo& info) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!failure_.empty()) {
    throwDistError("myccl: " + info.describe() + ": the group is unusable after an earlier failure: " + failure_ +
                   " (destroy the process group and create a new one)");
  }
  if (stop_) throwDistError("myccl: " + info.describe() + ": the group has been shut down");
}

CpuEngine::WorkPtr CpuEngine::enqueue(WorkPtr w, OpCode code, std::function<void(CollCtx&)> body) {
  checkUsable(w->info());
  Op op{w, code, std::move(body), recorder_->queued(w->info(), false)};
  bool inlineRun = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // A synchronous op on an idle engine runs right here: the caller is about to wait anyway,
    // and two thread hand-offs would cost more than a small collective itself.
    if (!w->info().asyncOp && queue_.empty() && !running_ && failure_.empty() && !stop_) {
      running_ = true;
      inlineRun = true;
    } else {
      queue_.push_back(std::move(op));
    }
  }
  if (!inlineRun) {
    cv_.notify_one();
    return w;
  }
  runOp(op);
  op = Op{};
  bool queued = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = false;
    queued = !queue_.empty();
  }
  // Waking the engine thread for nothing costs a futex call here and, worse, a context switch
  // on a core a peer rank may be using: only ops queued meanwhile need it.
  if (queued) cv_.notify_one();
  idleCv_.notify_all();
  return w;
}

void CpuEngine::loop() {
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || (!queue_.empty() && !running_); });
      if (queue_.empty() || running_) break;  // stopping
      op = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    runOp(op);
    op = Op{};  // drop tensors and callbacks before reporting idle
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = false;
    }
    cv_.notify_one();
    idleCv_.notify_all();
  }
}

const char* CpuEngine::transportName() const {
  if (!shm_) return transport_->name();
  return topo_.crossSize > 1 ? "shm+tcp" : "shm";
}

void CpuEngine::runOp(Op& op) {
  std::string earlier;
  {
    std::lock_guard<std::mutex> lk(mu_);
    earlier = failure_;
  }
  if (!earlier.empty()) {
    recorder_->ended(op.record, nullptr, nullptr, 0, "not run: the group failed earlier");
    op.work->markDone(makeDistError("myccl: " + op.work->info().describe() + ": not run, the group failed earlier: " +
                                    earlier));
    return;
  }
  op.work->markStarted();
  recorder_->started(op.record);
  const auto& info = op.work->info();
  CollCtx ctx{*transport_, rank_, size_, collectiveTagBase(op.code, info.seq),
              Clock::now() + info.timeout, *scratch_,
              static_cast<size_t>(std::max<int64_t>(4096, cfg_.tcpChunkBytes)), shm_.get(), &topo_};
  ctx.crossHost = topo_.crossSize > 1;
  ctx.crossHostRing = cfg_.crossHostRing;
  ctx.orderedSums = cfg_.orderedSums;
  ctx.float32Partials = cfg_.float32Partials;
  ctx.par = par_.get();
  ctx.streamMinBytes = streamMinBytes_;
  const auto t0 = Clock::now();
  try {
    chooseLevels(ctx, op.code);
    if (cfg_.debugDetail && size_ > 1) checkFingerprint(ctx, op);
    if (size_ > 1 && (!shm_ || topo_.crossSize > 1)) checkStrays(info.seq);  // shared memory checks every step
    op.body(ctx);
    stats_->add(info.name, ctx.algo, ctx.bytes,
                std::chrono::duration<double>(Clock::now() - t0).count());
    recorder_->ended(op.record, ctx.algo, transportName(), ctx.bytes, "");
    op.work->markDone();
  } catch (const std::exception& e) {
    bool timeout = false;
    std::string msg = describeFailure(op, e, timeout);
    recorder_->ended(op.record, ctx.algo, transportName(), ctx.bytes, msg);
    // The last ops of this group, for `python -m c10d_ext.trace analyze`.
    std::string dumped = recorder_->dumpTo(cfg_.flightRecorderDump, msg);
    if (!dumped.empty()) msg += " [flight recorder: " + dumped + "]";
    log(LogLevel::Error, msg);
    if (abortHooks_) abortHooks_->run(msg);  // before the links go: hooks may want to look
    failGroup(msg, timeout);
    op.work->markDone(makeDistError("myccl: " + msg));
  }
}

// MYCCL_HIERARCHICAL: forced either way, or (auto) chosen from the link, measured at the group's
// first op that has a two-level version. Every rank runs the same collectives in the same order,
// so every rank measures at the same op; until then (ops with no two-level version: gather,
// scatter, all_to_all, reduce) two levels stay the choice, as they were before anything measured.
void CpuEngine::chooseLevels(CollCtx& ctx, OpCode code) {
  if (cfg_.hierarchical >= 0) {
    ctx.hierarchical = cfg_.hierarchical == 1;
    return;
  }
  const bool twoLevelOp = code == OpCode::Allreduce || code == OpCode::Broadcast || code == OpCode::Allgather ||
                          code == OpCode::ReduceScatter || code == OpCode::Barrier;
  // Only the op runner writes link_ (ops run one at a time, handed over under mu_), so it reads
  // it without the lock; linkModel(), from other threads, takes it.
  if (!link_.measured && twoLevelOp && twoLevelsApply(ctx)) {
    const LinkModel m = measureLink(ctx, static_cast<double>(cfg_.linkMbit) * 1e6 / 8);
    {
      std::lock_guard<std::mutex> lk(mu_);
      link_ = m;
    }
    stats_->add("link_probe", m.hierarchical ? "hierarchical" : "flat", m.bytes, m.seconds);
    std::ostringstream os;
    os << "group '" << group_ << "' rank " << rank_ << ": link " << m.linkBytesPerS / 1e6 << " MB/s per host ("
       << (m.declared ? "MYCCL_LINK_MBIT" : "measured") << "), shared memory " << m.localBytesPerS / 1e6
       << " MB/s per rank, " << m.hosts << " hosts x " << m.ranksPerHost << " ranks: "
       << (m.hierarchical ? "two levels" : "flat TCP") << " (measuring took " << m.seconds * 1e3 << " ms)";
    log(LogLevel::Info, os.str());
  }
  ctx.hierarchical = link_.hierarchical;
}

LinkModel CpuEngine::linkModel() const {
  std::lock_guard<std::mutex> lk(mu_);
  return link_;
}

std::string CpuEngine::describeFailure(const Op& op, const std::exception& e, bool& timeout) const {
  const auto& info = op.work->info();
  std::ostringstream os;
  os << info.describe() << " failed: ";
  auto* ce = dynamic_cast<const CommError*>(&e);
  if (ce && ce->kind() == CommErrorKind::Timeout) {
    timeout = true;
    os << "Timed out after " << info.timeout.count() << " ms";
    if (ce->peer() >= 0) {
      // Within a host collectives wait on shared memory; the TCP link is only the lifeline.
      const bool viaShm = shm_ && topo_.sameHost(rank_, ce->peer()) && op.code != OpCode::Fingerprint;
      os << " waiting for rank " << ce->peer() << " ("
         << (viaShm ? std::string("shared memory") : transport_->describePeer(ce->peer())) << ")";
    }
    os << "; that rank has not reached this op (it may be stuck, dead, or calling something else)";
    auto stray = unmatched();
    if (!stray.empty()) {
      os << ". Unmatched messages:";
      size_t shown = 0;
      for (auto& [peer, tag] : stray) {
        if (shown++ == 4) {
          os << " ...";
          break;
        }
        os << " rank " << peer << " sent " << describeTag(tag) << ";";
      }
    }
  } else {
    os << e.what();
    if (ce && ce->kind() == CommErrorKind::Protocol && !cfg_.debugDetail) {
      os << " (ranks disagree about this op's sizes or order; set MYCCL_DEBUG=DETAIL to check every op)";
    }
    if (ce && ce->kind() == CommErrorKind::PeerGone) {
      // One death makes its neighbours close their links too: the rank that closed on us may
      // only be the messenger. Give the other links a moment to report, then name them all.
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      std::string others;
      for (int q = 0; q < size_; ++q) {
        if (q == rank_ || q == ce->peer()) continue;
        std::string why = transport_->peerGone(q);
        if (!why.empty()) others += " rank " + std::to_string(q) + ": " + why + ";";
      }
      if (!others.empty()) os << ". Also gone:" << others;
    }
  }
  return os.str();
}

// This group's messages that no receive has taken. Links lent to split groups also hold theirs,
// on other channels (a group on a channel sees only its own, as channel 0).
std::vector<std::pair<int, uint64_t>> CpuEngine::unmatched() const {
  auto out = transport_->unmatched();
  std::erase_if(out, [](const auto& m) { return tagChannel(m.second) != 0; });
  return out;
}

// A collective message of an earlier op that nobody received means the ranks disagreed about
// that op (e.g. different roots: both "roots" sent, nobody listened). Fail now instead of
// letting later ops run on a desynchronised group.
void CpuEngine::checkStrays(uint64_t seq) {
  for (auto& [peer, tag] : unmatched()) {
    if (!isCollectiveTag(tag)) continue;  // point-to-point messages may legitimately wait
    if (tagOpCode(tag) == OpCode::MonitoredBarrier) continue;  // numbered apart from the ops
    if (!seqBefore(tagSeq(tag), seq & kSeqMask)) continue;  // a peer simply ahead of us
    throw CommError(CommErrorKind::Protocol,
                    "rank " + std::to_string(peer) + " sent data for " + describeTag(tag) +
                        " that this rank never received: the ranks disagreed about that op (its root, or whether "
                        "it was theirs to send)",
                    peer);
  }
}

// MYCCL_DEBUG=DETAIL: every rank publishes what it is about to run; any difference fails the
// op on every rank with a message listing what each rank called, before any data moves.
void CpuEngine::checkFingerprint(CollCtx& ctx, const Op& op) {
  const auto& i = op.work->info();
  // Shapes must agree only where torch's semantics require it (uneven all_gather lists,
  // all_to_all splits and gather/scatter lists legitimately differ per rank). By name, not
  // OpType: older torch releases give several of these ops one OpType (COALESCED).
  static const std::string_view shaped[] = {"all_reduce", "all_reduce_coalesced", "broadcast", "reduce",
                                            "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
                                            "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"};
  bool withShape = false;
  for (auto name : shaped) withShape |= (name == i.name);
  std::string fp = i.op + " #" + std::to_string(i.seq) + " " + i.dtype;
  if (withShape) fp += " " + i.shape;
  if (i.root >= 0) fp += " root " + std::to_string(i.root);
  if (!i.redop.empty()) fp += " " + i.redop;
  constexpr size_t kLen = 200;
  fp.resize(kLen, '\0');
  CollCtx fctx = ctx;
  fctx.tagBase = collectiveTagBase(OpCode::Fingerprint, i.seq);
  std::vector<char> all(kLen * size_);
  std::vector<void*> outs(size_);
  std::vector<size_t> sizes(size_, kLen);
  for (int r = 0; r < size_; ++r) outs[r] = all.data() + r * kLen;
  cpu::allgatherv(fctx, fp.data(), outs.data(), sizes.data());
  std::vector<std::pair<std::string, std::vector<int>>> distinct;
  for (int r = 0; r < size_; ++r) {
    std::string s(all.data() + r * kLen, strnlen(all.data() + r * kLen, kLen));
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](auto& d) { return d.first == s; });
    if (it == distinct.end()) {
      distinct.push_back({s, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (distinct.size() == 1) return;
  std::ostringstream os;
  os << "MYCCL_DEBUG=DETAIL: ranks called different collectives:";
  for (auto& [s, ranks] : distinct) {
    os << " ranks [";
    for (size_t k = 0; k < ranks.size(); ++k) os << (k ? "," : "") << ranks[k];
    os << "] called " << s << ";";
  }
  throw CommError(CommErrorKind::Protocol, os.str());
}

void CpuEngine::failGroup(const std::string& why, bool timeout) {
  std::deque<Op> dropped;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) {
      failure_ = why;
      timedOut_ = timeout;
    }
    dropped.swap(queue_);
  }
  // Closing stops all I/O (no late message can land in a buffer) and tells peers at once.
  if (shm_) shm_->abort(why);
  transport_->close(why, /*failure=*/true);
  for (auto& op : dropped) {
    recorder_->ended(op.record, nullptr, nullptr, 0, "not run: the group failed");
    op.work->markDone(makeDistError("myccl: " + op.work->info().describe() + ": not run, the group failed: " + why));
  }
}

void CpuEngine::abort(const std::string& why) {
  failGroup(why, false);
}

void CpuEngine::shutdown() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    idleCv_.wait(lk, [&] { return queue_.empty() && !running_; });
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  closeLinks("it shut down its process group");
  if (shm_) shm_->abort("process group shut down");
}

std::string CpuEngine::describeLinks() const {
  std::ostringstream os;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) os << "rank " << r << ": " << transport_->describePeer(r) << "\n";
  return os.str();
}

std::vector<int> CpuEngine::vanishedRanks() const {
  return transport_->vanishedPeers();
}

int CpuEngine::rejectedConnections() const {
  return transport_->rejectedConnections();
}

at::Tensor CpuEngine::sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  // Every rank calls this in the same order, so the counter names the same tensor everywhere.
  return cpu::sharedTensor(*store_, keyPrefix_, topo_, ++sharedCount_, shape, dtype);
}

at::Tensor CpuEngine::allocateTensor(int64_t numel, const at::TensorOptions& options) {
  const auto dtype = options.dtype();
  const size_t nbytes = static_cast<size_t>(std::max<int64_t>(numel, 0)) * dtype.itemsize();
  std::shared_ptr<ShmSegment> seg;
  if (shm_ && nbytes > 0) seg = shm_->allocate(nbytes);
  if (!seg) {
    if (shm_ && nbytes > 0)
      logOnce("shm-table-full", LogLevel::Warning,
              "allocate_tensor: the shared-memory table is full; returning ordinary memory (no zero copy)");
    return at::empty({numel}, options.device(at::kCPU));
  }
  std::weak_ptr<ShmGroup> group = shm_;
  // The tensor owns the mapping (it may outlive the group); freeing it unregisters the slot.
  auto deleter = [seg, group](void* p) {
    if (auto g = group.lock()) g->release(p);
  };
  return at::from_blob(seg->data(), {numel}, deleter, options.device(at::kCPU));
}

bool CpuEngine::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failure_.empty();
}

bool CpuEngine::timedOut() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timedOut_;
}

// ---- stats ---------------------------------------------------------------------------------

void Stats::add(const std::string& op, const std::string& algo, uint64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : entries_) {
    if (e.op == op && e.algo == algo) {
      ++e.count;
      e.bytes += bytes;
      e.seconds += seconds;
      return;
    }
  }
  entries_.push_back(Entry{op, algo, 1, bytes, seconds});
}

std::vector<Stats::Entry> Stats::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return entries_;
}

void Stats::reset() {
  std::lock_guard<std::mutex> lk(mu_);
  entries_.clear();
}

// ---- collectives ---------------------------------------------------------------------------

namespace {

std::vector<at::Tensor> flatList(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

}  // namespace

CpuEngine::WorkPtr CpuEngine::broadcast(OpInfo info, at::Tensor t, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  return enqueue(w, OpCode::Broadcast, [t, root](CollCtx& c) {
    auto s = Staged::of(t, c.rank == root);
    c.bytes = s.nbytes();
    cpu::broadcast(c, s.ptr(), s.nbytes(), root);
    s.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), tensors, tensors);
  return enqueue(w, OpCode::Allreduce, [tensors, red](CollCtx& c) {
    const ReduceSpec& spec = red.spec;
    if (tensors.size() == 1) {
      auto s = Staged::of(tensors[0], true);
      c.bytes = s.nbytes();
      if (red.premul) scaleInPlace(spec.dtype, s.ptr(), s.work.numel(), red.factor);
      cpu::allreduce(c, s.ptr(), s.work.numel(), spec);
      s.commit();
      return;
    }
    // Coalesced: one flat buffer, one collective, then back into each tensor.
    std::vector<at::Tensor> flat;
    flat.reserve(tensors.size());
    for (auto& t : tensors) flat.push_back(t.reshape({-1}));
    at::Tensor buf = at::cat(flat);
    c.bytes = buf.numel() * buf.element_size();
    if (red.premul) scaleInPlace(spec.dtype, buf.data_ptr(), buf.numel(), red.factor);
    cpu::allreduce(c, buf.data_ptr(), buf.numel(), spec);
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::reduce(OpInfo info, at::Tensor t, const Reduction& red, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  return enqueue(w, OpCode::Reduce, [t, red, root](CollCtx& c) {
    auto s = Staged::of(t, true);
    c.bytes = s.nbytes();
    const void* in = s.ptr();
    at::Tensor scaled;
    if (red.premul) {
      scaled = privateCopy(s.work);
      scaleInPlace(red.spec.dtype, scaled.data_ptr(), scaled.numel(), red.factor);
      in = scaled.data_ptr();
    }
    cpu::reduce(c, in, s.ptr(), s.work.numel(), red.spec, root);
    if (c.rank == root) s.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::allgather(OpInfo info, std::vector<at::Tensor> inputs,
                                        std::vector<std::vector<at::Tensor>> outputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), inputs, flatList(outputs));
  return enqueue(w, OpCode::Allgather, [inputs, outputs](CollCtx& c) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto in = Staged::of(inputs[i], true);
      std::vector<Staged> outs;
      std::vector<void*> ptrs;
      std::vector<size_t> sizes;
      for (auto& o : outputs[i]) {
        outs.push_back(Staged::of(o, false));
        ptrs.push_back(outs.back().ptr());
        sizes.push_back(outs.back().nbytes());
      }
      for (auto sz : sizes) c.bytes += sz;
      cpu::allgatherv(c, in.ptr(), ptrs.data(), sizes.data());
      for (auto& o : outs) o.commit();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{input}, outputs);
  return enqueue(w, OpCode::Gather, [input, outputs, root](CollCtx& c) {
    auto in = Staged::of(input, true);
    std::vector<Staged> outs;
    std::vector<void*> ptrs(c.size, nullptr);
    std::vector<size_t> sizes(c.size, in.nbytes());
    if (c.rank == root) {
      for (int r = 0; r < c.size; ++r) {
        outs.push_back(Staged::of(outputs[r], false));
        ptrs[r] = outs.back().ptr();
        sizes[r] = outs.back().nbytes();
      }
    }
    c.bytes = in.nbytes();
    cpu::gatherv(c, in.ptr(), ptrs.data(), sizes.data(), root);
    for (auto& o : outs) o.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), inputs, std::vector<at::Tensor>{output});
  return enqueue(w, OpCode::Scatter, [inputs, output, root](CollCtx& c) {
    auto out = Staged::of(output, false);
    std::vector<Staged> ins;
    std::vector<const void*> ptrs(c.size, nullptr);
    std::vector<size_t> sizes(c.size, out.nbytes());
    if (c.rank == root) {
      for (int r = 0; r < c.size; ++r) {
        ins.push_back(Staged::of(inputs[r], true));
        ptrs[r] = ins.back().ptr();
        sizes[r] = ins.back().nbytes();
      }
    }
    c.bytes = out.nbytes();
    cpu::scatterv(c, ptrs.data(), out.ptr(), sizes.data(), root);
    out.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                            std::vector<at::Tensor> outputs, const Reduction& red,
                                            std::vector<at::Tensor> userInputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), userInputs.empty() ? flatList(inputs) : userInputs, outputs);
  return enqueue(w, OpCode::ReduceScatter, [inputs, outputs, red](CollCtx& c) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      auto out = Staged::of(outputs[i], false);
      std::vector<at::Tensor> keep;
      std::vector<const void*> ptrs;
      std::vector<size_t> counts;
      for (auto& t : inputs[i]) {
        at::Tensor x = red.premul ? privateCopy(t) : t.contiguous();
        if (red.premul) scaleInPlace(red.spec.dtype, x.data_ptr(), x.numel(), red.factor);
        keep.push_back(x);
        ptrs.push_back(x.data_ptr());
        counts.push_back(x.numel());
      }
      for (auto& x : keep) c.bytes += x.numel() * x.element_size();
      cpu::reduceScatterv(c, ptrs.data(), out.ptr(), counts.data(), red.spec);
      out.commit();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> userInputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), userInputs.empty() ? inputs : userInputs, outputs);
  return enqueue(w, OpCode::Alltoall, [inputs, outputs](CollCtx& c) {
    std::vector<Staged> ins, outs;
    std::vector<const void*> sp;
    std::vector<void*> rp;
    std::vector<size_t> sb, rb;
    for (auto& t : inputs) {
      ins.push_back(Staged::of(t, true));
      sp.push_back(ins.back().ptr());
      sb.push_back(ins.back().nbytes());
    }
    for (auto& t : outputs) {
      outs.push_back(Staged::of(t, false));
      rp.push_back(outs.back().ptr());
      rb.push_back(outs.back().nbytes());
    }
    for (auto b : sb) c.bytes += b;
    cpu::alltoallv(c, sp.data(), sb.data(), rp.data(), rb.data());
    for (auto& o : outs) o.commit();
  });
}

void CpuEngine::agree(OpInfo info) {
  // The fingerprint names the op as the other engine will run it; the record says what ran here.
  info.asyncOp = false;
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  enqueue(w, OpCode::Fingerprint, [](CollCtx&) {})->wait();
}

CpuEngine::WorkPtr CpuEngine::barrier(OpInfo info, at::Device /*device*/) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  return enqueue(w, OpCode::Barrier, [](CollCtx& c) { cpu::barrier(c); });
}

// ---- point-to-point ------------------------------------------------------------------------

namespace {

// Runs inside the request's own completion (so `req` is alive); captures no RequestPtr, which
// would keep a withdrawn request alive forever through its own callback.
struct P2PDone {
  std::shared_ptr<Stats> stats;
  std::shared_ptr<Recorder> recorder;
  uint64_t record;
  const char* transport;
};

void finishP2P(const c10::intrusive_ptr<MycclWork>& w, const Request& req, const std::function<void()>& onOk,
               const P2PDone& d) {
  const char* via = req.via() ? req.via() : d.transport;
  try {
    req.rethrow();
    if (onOk) onOk();
    d.stats->add(w->info().name, via, req.nbytes(),
                 std::chrono::duration<double>(Clock::now() - w->startTime()).count());
    d.recorder->ended(d.record, "p2p", via, req.nbytes(), "");
    w->setSourceRank(req.source());
    w->markDone();
  } catch (const std::exception& e) {
    std::string msg = "myccl: " + w->info().describe() + " failed: " + e.what();
    d.recorder->ended(d.record, "p2p", via, req.nbytes(), msg);
    w->markDone(makeDistError(msg));
  }
}

// Lets a timed-out wait() withdraw the receive without keeping transport or request alive.
std::function<bool()> canceller(const std::shared_ptr<Transport>& tp, const RequestPtr& req) {
  std::weak_ptr<Transport> wt = tp;
  std::weak_ptr<Request> wr = req;
  return [wt, wr] {
    auto t = wt.lock();
    auto r = wr.lock();
    return t && r && t->cancel(r);
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
  auto req = transport_->isend(peer, p2pTag(tag), c.data_ptr(), c.numel() * c.element_size());
  P2PDone d{stats_, recorder_, recorder_->queued(w->info(), true), transport_->name()};
  req->onDone([w, r = req.get(), c, d] { finishP2P(w, *r, nullptr, d); });
  return w;
}

CpuEngine::WorkPtr CpuEngine::recv(OpInfo info, at::Tensor t, int peer, int tag) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  auto s = Staged::of(t, false);
  w->setSpinWait(p2pSpin_);
  w->markStarted();
  auto req = transport_->irecv(peer, p2pTag(tag), s.ptr(), s.nbytes());
  w->setCanceller(canceller(transport_, req));
  P2PDone d{stats_, recorder_, recorder_->queued(w->info(), true), transport_->name()};
  req->onDone([w, r = req.get(), s, d] { finishP2P(w, *r, [s] { s.commit(); }, d); });
  return w;
}

CpuEngine::WorkPtr CpuEngine::recvAny(OpInfo info, at::Tensor t, int tag) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  auto s = Staged::of(t, false);
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) peers.push_back(r);
  w->setSpinWait(p2pSpin_);
  w->markStarted();
  auto req = transport_->irecvAny(peers, p2pTag(tag), s.ptr(), s.nbytes());
  w->setCanceller(canceller(transport_, req));
  P2PDone d{stats_, recorder_, recorder_->queued(w->info(), true), transport_->name()};
  req->onDone([w, r = req.get(), s, d] { finishP2P(w, *r, [s] { s.commit(); }, d); });
  return w;
}

}  // namespace myccl::cpu
