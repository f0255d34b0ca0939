// CPU engine: the op queue, the progress thread, tensor staging (non-contiguous tensors are
// copied into contiguous buffers and written back after a successful op) and failure
// handling. Algorithms below this file see only raw buffers; the backend above it sees only
// tensors and Work objects.
#include "myccl/cpu/Engine.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <sstream>

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

const char* opCodeName(uint8_t code) {
  switch (static_cast<OpCode>(code)) {
    case OpCode::Broadcast: return "broadcast";
    case OpCode::Allreduce: return "all_reduce";
    case OpCode::Reduce: return "reduce";
    case OpCode::Allgather: return "all_gather";
    case OpCode::Gather: return "gather";
    case OpCode::Scatter: return "scatter";
    case OpCode::ReduceScatter: return "reduce_scatter";
    case OpCode::Alltoall: return "all_to_all";
    case OpCode::Barrier: return "barrier";
  }
  return "?";
}

std::string describeTag(uint64_t tag) {
  std::ostringstream os;
  if (tag >> 63) {
    os << opCodeName((tag >> 56) & 0x7f) << " #" << ((tag >> 16) & 0xffffffffffull);
  } else {
    os << "send with tag " << static_cast<int32_t>(tag & 0xffffffffu);
  }
  return os.str();
}

}  // namespace

CpuEngine::CpuEngine(std::shared_ptr<Transport> transport, int rank, int size, std::string group, const Config& cfg)
    : transport_(std::move(transport)), rank_(rank), size_(size), group_(std::move(group)), cfg_(cfg) {
  thread_ = std::thread([this] { loop(); });
}

CpuEngine::~CpuEngine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  transport_->close("process group destroyed");
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
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(Op{w, code, std::move(body)});
  }
  cv_.notify_one();
  return w;
}

void CpuEngine::loop() {
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;
      op = std::move(queue_.front());
      queue_.pop_front();
      running_ = true;
    }
    std::string earlier;
    {
      std::lock_guard<std::mutex> lk(mu_);
      earlier = failure_;
    }
    if (!earlier.empty()) {
      op.work->markDone(makeDistError("myccl: " + op.work->info().describe() +
                                      ": not run, the group failed earlier: " + earlier));
    } else {
      op.work->markStarted();
      const auto& info = op.work->info();
      CollCtx ctx{*transport_, rank_, size_, collectiveTagBase(static_cast<uint8_t>(op.code), info.seq),
                  Clock::now() + info.timeout, scratch_, static_cast<size_t>(std::max<int64_t>(4096, cfg_.tcpChunkBytes))};
      try {
        op.body(ctx);
        op.work->markDone();
      } catch (const std::exception& e) {
        bool timeout = false;
        std::string msg = describeFailure(op, e, timeout);
        failGroup(msg, timeout);
        op.work->markDone(makeDistError("myccl: " + msg));
      }
    }
    op = Op{};  // drop tensors and callbacks before reporting idle
    {
      std::lock_guard<std::mutex> lk(mu_);
      running_ = false;
    }
    idleCv_.notify_all();
  }
}

std::string CpuEngine::describeFailure(const Op& op, const std::exception& e, bool& timeout) const {
  const auto& info = op.work->info();
  std::ostringstream os;
  os << info.describe() << " failed: ";
  auto* ce = dynamic_cast<const CommError*>(&e);
  if (ce && ce->kind() == CommErrorKind::Timeout) {
    timeout = true;
    os << "timed out after " << info.timeout.count() << " ms";
    if (ce->peer() >= 0) os << " waiting for rank " << ce->peer() << " (" << transport_->describePeer(ce->peer()) << ")";
    os << "; that rank has not reached this op (it may be stuck, dead, or calling something else)";
    auto stray = transport_->unmatched();
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
    if (ce && ce->kind() == CommErrorKind::Protocol) {
      os << " (ranks disagree about this op's sizes or order; set MYCCL_DEBUG=DETAIL to check every op)";
    }
  }
  return os.str();
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
  transport_->close("rank " + std::to_string(rank_) + " closed its connections after: " + why);
  for (auto& op : dropped) {
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
  transport_->close("process group shut down");
}

bool CpuEngine::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failure_.empty();
}

bool CpuEngine::timedOut() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timedOut_;
}

std::string CpuEngine::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
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
    cpu::scatterv(c, ptrs.data(), out.ptr(), sizes.data(), root);
    out.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                            std::vector<at::Tensor> outputs, const Reduction& red) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), flatList(inputs), outputs);
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
      cpu::reduceScatterv(c, ptrs.data(), out.ptr(), counts.data(), red.spec);
      out.commit();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), inputs, outputs);
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
    cpu::alltoallv(c, sp.data(), sb.data(), rp.data(), rb.data());
    for (auto& o : outs) o.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::barrier(OpInfo info) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  return enqueue(w, OpCode::Barrier, [](CollCtx& c) { cpu::barrier(c); });
}

// ---- point-to-point ------------------------------------------------------------------------

namespace {

// Runs inside the request's own completion (so `req` is alive); captures no RequestPtr, which
// would keep a withdrawn request alive forever through its own callback.
void finishP2P(const c10::intrusive_ptr<MycclWork>& w, const Request& req, const std::function<void()>& onOk) {
  try {
    req.rethrow();
    if (onOk) onOk();
    w->setSourceRank(req.source());
    w->markDone();
  } catch (const std::exception& e) {
    w->markDone(makeDistError("myccl: " + w->info().describe() + " failed: " + e.what()));
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
  w->markStarted();
  auto req = transport_->isend(peer, p2pTag(tag), c.data_ptr(), c.numel() * c.element_size());
  req->onDone([w, r = req.get(), c] { finishP2P(w, *r, nullptr); });
  return w;
}

CpuEngine::WorkPtr CpuEngine::recv(OpInfo info, at::Tensor t, int peer, int tag) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  auto s = Staged::of(t, false);
  w->markStarted();
  auto req = transport_->irecv(peer, p2pTag(tag), s.ptr(), s.nbytes());
  w->setCanceller(canceller(transport_, req));
  req->onDone([w, r = req.get(), s] { finishP2P(w, *r, [s] { s.commit(); }); });
  return w;
}

CpuEngine::WorkPtr CpuEngine::recvAny(OpInfo info, at::Tensor t, int tag) {
  checkUsable(info);
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  auto s = Staged::of(t, false);
  std::vector<int> peers;
  for (int r = 0; r < size_; ++r)
    if (r != rank_) peers.push_back(r);
  w->markStarted();
  auto req = transport_->irecvAny(peers, p2pTag(tag), s.ptr(), s.nbytes());
  w->setCanceller(canceller(transport_, req));
  req->onDone([w, r = req.get(), s] { finishP2P(w, *r, [s] { s.commit(); }); });
  return w;
}

}  // namespace myccl::cpu
