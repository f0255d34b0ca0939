// CPU engine: the op queue, the progress thread and failure handling: an op either runs inline
// (a synchronous op on an idle group) or on the group's thread, one at a time in issue order; the
// first that fails closes the links and fails everything queued. What each op does with its
// tensors is in Collectives.cpp and PointToPoint.cpp.
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

#include <c10/util/Exception.h>

#include <algorithm>

namespace myccl::cpu {

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
      cfg_(cfg), scratch_(std::make_unique<Scratch>()), recorder_(std::move(recorder)),
      levels_(cfg.hierarchical, static_cast<double>(cfg.linkMbit) * 1e6 / 8, stats_,
              "group '" + group_ + "' rank " + std::to_string(rank_)) {
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
  if (!shared_ || !cfg_.splitLinks) return {};
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

CpuEngine::WorkPtr CpuEngine::enqueue(WorkPtr w, OpCode code, std::function<void(CollCtx&)> body,
                                      bool fingerprinted) {
  checkUsable(w->info());
  Op op{w, code, std::move(body), recorder_->queued(w->info(), false), fingerprinted};
  bool inlineRun = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // A synchronous op on an idle engine runs right here: the caller is about to wait anyway,
    // and two thread hand-offs would cost more than a small collective itself.
    if (!w->info().asyncOp && queue_.empty() && !running_ && failure_.empty() && !stop_) {
      running_ = true;
      runningWork_ = w;
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
  WorkPtr finished;  // released below, outside mu_ (see loop())
  {
    std::lock_guard<std::mutex> lk(mu_);
    running_ = false;
    finished = std::move(runningWork_);
    queued = !queue_.empty();
  }
  // Waking the engine thread for nothing costs a futex call here and, worse, a context switch
  // on a core a peer rank may be using: only ops queued meanwhile need it.
  if (queued) cv_.notify_one();
  idleCv_.notify_all();
  return w;
}

CpuEngine::WorkPtr CpuEngine::runExtension(OpInfo info, std::vector<at::Tensor> inputs,
                                           std::vector<at::Tensor> outputs, ExtensionOp op) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::move(inputs), std::move(outputs));
  return enqueue(w, OpCode::Extension, std::move(op.body), op.fingerprinted);
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
      runningWork_ = op.work;
    }
    runOp(op);
    // Tensors, callbacks and the Work are dropped before reporting idle, and never under mu_:
    // releasing a tensor may take the GIL (torch frees its Python object with it), and a caller
    // may hold the GIL while it waits for mu_ (a ProcessGroup subclassed in Python, such as whole
    // memory's communicators, calls the backend with the GIL held).
    WorkPtr finished;
    {
      std::lock_guard<std::mutex> lk(mu_);
      finished = std::move(runningWork_);  // (done: inFlight() no longer counts it)
    }
    op = Op{};
    finished.reset();
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
  ctx.levels = &levels_;
  const auto t0 = Clock::now();
  try {
    if (cfg_.debug && size_ > 1 && op.fingerprinted) checkFingerprint(ctx, op);
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

LinkModel CpuEngine::linkModel() const {
  return levels_.model();
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

bool CpuEngine::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failure_.empty();
}

bool CpuEngine::timedOut() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timedOut_;
}

size_t CpuEngine::inFlight() const {
  std::lock_guard<std::mutex> lk(mu_);
  // A Work marked done counts no more, though its runner may not have said so yet.
  const bool running = running_ && runningWork_ && !runningWork_->isCompleted();
  return queue_.size() + (running ? 1 : 0) + static_cast<size_t>(std::max<int64_t>(0, p2pInFlight_->load()));
}

}  // namespace myccl::cpu
