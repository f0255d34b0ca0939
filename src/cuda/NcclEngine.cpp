// NcclEngine: communicators per device (ids through the store), the NCCL stream per device,
// and every op expressed as three phases on one stream: staging copies into contiguous
// buffers, the NCCL calls inside one ncclGroupStart/End, copies back into the caller's
// tensors. Works complete by CUDA event; the watchdog enforces timeouts.
#include "myccl/cuda/NcclEngine.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include "myccl/Errors.hpp"
#include "myccl/cuda/CudaEvent.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclTypes.hpp"
#include "myccl/cuda/NcclWork.hpp"
#include "myccl/cuda/Watchdog.hpp"

namespace myccl::cuda {

namespace {

using NcclWorkPtr = c10::intrusive_ptr<NcclWork>;

size_t nbytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// "<op> (rank R)": the prefix of argument errors (MYCCL_CHECK_ARG adds "myccl: ").
std::string argWhere(const OpInfo& info) {
  return info.op + " (rank " + std::to_string(info.rank) + ")";
}

std::string errorText(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// Do [p, p+n) and [q, q+m) share a byte?
bool overlaps(const void* p, size_t n, const void* q, size_t m) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return n != 0 && m != 0 && a < b + m && b < a + n;
}

// True when ts[r] is the r-th block of `each` bytes of one contiguous buffer starting at ts[0].
bool consecutiveBlocks(const std::vector<at::Tensor>& ts, size_t each) {
  if (ts.empty() || each == 0) return false;
  auto* base = static_cast<const char*>(ts[0].data_ptr());
  for (size_t r = 0; r < ts.size(); ++r) {
    if (!ts[r].is_contiguous() || nbytesOf(ts[r]) != each) return false;
    if (static_cast<const char*>(ts[r].data_ptr()) != base + r * each) return false;
  }
  return true;
}

void checkNccl(ncclResult_t r, const char* call, const std::string& where, ncclComm_t comm) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  auto kind = (r == ncclRemoteError || r == ncclSystemError) ? CommErrorKind::PeerGone : CommErrorKind::Local;
  throw CommError(kind, where + ": " + call + " failed: " + ncclErrorText(r, comm));
}

// One enqueue: an op, or a coalesced batch of ops, on one communicator and one stream. Ops
// describe themselves into it in three phases, so that no copy ever runs inside an open NCCL
// group (kernels launched there would run before the group's, not after).
class Launch {
 public:
  using Call = std::function<ncclResult_t(const Launch&)>;

  Launch(NcclComm& comm, c10::cuda::CUDAStream stream) : comm_(comm), stream_(stream) {}

  // ---- phase 1, now, on the stream: staging ----
  // A contiguous tensor of dtype `type` standing in for `user`; `user` itself when it already
  // is one. copyIn: filled from `user` now; copyBack: copied into `user` after the NCCL calls.
  at::Tensor buffer(const at::Tensor& user, at::ScalarType type, bool copyIn, bool copyBack) {
    if (user.is_contiguous() && user.scalar_type() == type) return user;
    at::Tensor buf = at::empty(user.sizes(), user.options().dtype(type).memory_format(at::MemoryFormat::Contiguous));
    if (copyIn) buf.copy_(user);
    if (copyBack) after([user, buf]() mutable { user.copy_(buf); });
    return buf;
  }
  // A reduction operator for the calls; PREMUL_SUM operators are created per launch (before the
  // group opens) and destroyed once it is closed. Returns a slot for op().
  int redOp(const NcclReduce& plan) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      const auto& s = slots_[i];
      if (s.type == plan.type && s.op == plan.op && s.premul == plan.premul && s.factor == plan.factor) {
        return static_cast<int>(i);
      }
    }
    slots_.push_back(plan);
    return static_cast<int>(slots_.size() - 1);
  }
  // ---- phase 2, inside one group, under the communicator lock ----
  void nccl(Call c) { calls_.push_back(std::move(c)); }
  // ---- phase 3, after the group, on the stream ----
  void after(std::function<void()> f) { afters_.push_back(std::move(f)); }

  // For calls:
  ncclComm_t comm() const { return handle_; }
  cudaStream_t stream() const { return stream_.stream(); }
  ncclRedOp_t op(int slot) const { return ops_.at(static_cast<size_t>(slot)); }

  // Runner: phase 2. Throws CommError (the group must then be failed).
  void issue(Clock::time_point deadline, const std::string& where) {
    if (calls_.empty()) return;  // e.g. a group of one rank gathering: only local copies
    auto lk = comm_.lock(where);
    handle_ = comm_.get();
    ops_.clear();
    for (const auto& s : slots_) {
      if (!s.premul) {
        ops_.push_back(s.op);
        continue;
      }
      alignas(8) unsigned char scalar[8] = {};
      premulScalar(s.type, s.factor, scalar);
      ncclRedOp_t op{};
      checkNccl(ncclRedOpCreatePreMulSum(&op, scalar, s.type, ncclScalarHostImmediate, handle_),
                "ncclRedOpCreatePreMulSum", where, handle_);
      created_.push_back(op);
      ops_.push_back(op);
    }
    checkNccl(ncclGroupStart(), "ncclGroupStart", where, handle_);
    try {
      for (const auto& c : calls_) {
        // Aborted from another thread while this one was stuck inside NCCL: the handle is gone.
        if (comm_.aborted()) throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator was aborted");
        checkNccl(c(*this), "an NCCL call", where, handle_);
      }
    } catch (...) {
      (void)ncclGroupEnd();  // keep this thread's group depth right; the group is failed next
      throw;
    }
    ncclResult_t r = ncclGroupEnd();
    checkNccl(r, "ncclGroupEnd", where, handle_);
    comm_.settle(lk, r, deadline, where);
    // "An operator may be destroyed as soon as the last NCCL function given it returns": that is
    // the group end.
    for (auto op : created_) (void)ncclRedOpDestroy(op, handle_);
    created_.clear();
    calls_.clear();  // drops the staging buffers the calls captured: stream order keeps them safe
  }
  // Runner: phase 3.
  void finish() {
    for (auto& f : afters_) f();
    afters_.clear();
  }

 private:
  NcclComm& comm_;
  c10::cuda::CUDAStream stream_;
  ncclComm_t handle_ = nullptr;
  std::vector<Call> calls_;
  std::vector<std::function<void()>> afters_;
  std::vector<NcclReduce> slots_;
  std::vector<ncclRedOp_t> ops_;
  std::vector<ncclRedOp_t> created_;
};

// One op waiting to be issued: its Work, the caller's tensors the NCCL stream will touch, and
// how it stages and issues itself.
struct Item {
  NcclWorkPtr work;
  std::vector<at::Tensor> keep;
  std::function<void(Launch&)> prepare;
};

struct DeviceState {
  DeviceState(std::shared_ptr<NcclComm> c, c10::cuda::CUDAStream s) : comm(std::move(c)), stream(s) {}
  std::shared_ptr<NcclComm> comm;
  c10::cuda::CUDAStream stream;  // async ops run here
  c10::cuda::CUDAEvent ready;    // caller's stream -> NCCL stream; reusable, the wait copies its state
};

std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

struct NcclEngine::Impl {
  Impl(c10::intrusive_ptr<c10d::Store> s, int r, int n, std::string g, const Config& c, std::chrono::milliseconds t)
      : store(std::move(s)), rank(r), size(n), group(std::move(g)), cfg(c), timeout(t), timeoutFixed(t.count() > 0) {
    if (!timeoutFixed) timeout = store->getTimeout();
    // A fresh key space per incarnation of the group: a store reused across destroy and
    // re-init must never hand out a previous incarnation's NCCL id. Every rank creates its
    // engine at its first CUDA op, which needs all ranks, so tickets of one incarnation are
    // taken before any of the next.
    const int64_t ticket = store->add("myccl/nccl/incarnation", 1);
    prefix = "myccl/nccl/" + std::to_string((ticket - 1) / size) + "/";
    watchdog = std::make_shared<Watchdog>(rank, group);
    watchdog->start();
  }

  c10::intrusive_ptr<c10d::Store> store;
  const int rank;
  const int size;
  const std::string group;
  const Config cfg;
  // Bounds eagerConnect and shutdown. Until given (constructor or setTimeout) it follows the
  // ops' timeouts, which are the group's timeout unless an op asked for its own.
  std::atomic<std::chrono::milliseconds> timeout;
  std::atomic<bool> timeoutFixed;
  std::string prefix;
  std::shared_ptr<Watchdog> watchdog;

  // Serialises issuing: NCCL groups are per thread, and ops must reach NCCL in issue order.
  // Never taken by abort(), which must work while an issuing thread is stuck.
  std::mutex issueMu;
  std::map<c10::DeviceIndex, std::unique_ptr<DeviceState>> devices;
  int created = 0;  // communicators created (attempted) so far

  // Coalescing state (short critical sections only).
  std::mutex coalesceMu;
  bool coalescing = false;
  std::vector<Item> deferred;
  std::optional<c10::Device> deferredDevice;

  std::atomic<bool> closed{false};

  void checkOpen(const OpInfo& info) const {
    watchdog->throwIfFailed(info);
    if (closed) throwDistError("myccl: " + info.describe() + ": the group has been shut down");
  }

  NcclWorkPtr makeWork(const OpInfo& info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                       c10::Device dev) {
    return c10::make_intrusive<NcclWork>(info, std::move(inputs), std::move(outputs), dev, watchdog,
                                         cfg.blockingWait);
  }

  // Lazily, collectively: rank 0 makes the id, the others read it from the store.
  DeviceState& deviceState(c10::Device dev, std::chrono::milliseconds limit, const std::string& where) {
    const c10::DeviceIndex idx = dev.index();
    auto it = devices.find(idx);
    if (it != devices.end()) return *it->second;
    MYCCL_CHECK(!isCapturing(c10::cuda::getCurrentCUDAStream(idx)), where, ": the first CUDA op on ", dev,
                " of this group is being captured into a CUDA graph, and NCCL communicators cannot be created "
                "during capture; run one op (or eager_connect) on this device before capturing");
    // Keyed by the engine's creation count, not by the device index: rank r usually drives
    // cuda:r, so the index differs across ranks, while every rank creates its n-th
    // communicator at the same op.
    const int attempt = created++;
    const std::string key = prefix + "comm" + std::to_string(attempt) + "/id";
    ncclUniqueId id;
    if (rank == 0) {
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) throwDistError(where + ": ncclGetUniqueId failed: " + ncclErrorText(r));
      const auto* p = reinterpret_cast<const uint8_t*>(&id);
      store->set(key, std::vector<uint8_t>(p, p + sizeof id));
    } else {
      try {
        store->wait({key}, limit);
      } catch (const c10::Error& e) {
        std::ostringstream os;
        os << where << ": timed out after " << limit.count() << " ms waiting for rank 0 to publish the NCCL id for "
           << dev << " (store key '" << key << "'); has rank 0 reached its first CUDA op on this group? ("
           << e.what_without_backtrace() << ")";
        throwDistError(os.str());
      }
      auto v = store->get(key);
      MYCCL_CHECK(v.size() == sizeof id, where, ": the NCCL id under store key '", key, "' has ", v.size(),
                  " bytes, expected ", sizeof id);
      std::memcpy(&id, v.data(), sizeof id);
    }
    auto comm = NcclComm::create(id, rank, size, idx, "myccl:" + group, Clock::now() + limit, where);
    auto stream = c10::cuda::getStreamFromPool(cfg.highPriorityStream, idx);
    watchdog->addComm(comm);
    auto& slot = devices[idx];
    slot = std::make_unique<DeviceState>(std::move(comm), stream);
    return *slot;
  }

  // Where an issued op went: what its Works complete on.
  struct Issued {
    std::shared_ptr<c10::cuda::CUDAEvent> end;
    c10::cuda::CUDAStream stream;
    std::shared_ptr<NcclComm> comm;
    bool captured;
  };

  // Issues `items` (one op, or a coalesced batch) as one group on one stream; `extra` are Works
  // that complete with them (the coalesced batch's own Work). Any failure here fails the group:
  // peers may already be inside this op, and skipping it would misalign every later op.
  Issued run(std::vector<Item>& items, c10::Device dev, bool asyncOp, const OpInfo& info,
             const std::vector<NcclWorkPtr>& extra) {
    const std::string where = info.describe();
    try {
      c10::cuda::CUDAGuard deviceGuard(dev.index());
      DeviceState& ds = deviceState(dev, info.timeout, where);
      const auto current = c10::cuda::getCurrentCUDAStream(dev.index());
      const bool captured = isCapturing(current);
      const c10::cuda::CUDAStream stream = asyncOp ? ds.stream : current;
      if (asyncOp) {
        // The NCCL stream starts after everything the caller enqueued so far (inputs are ready).
        ds.ready.record(current);
        ds.ready.block(stream);
      }
      // Staging buffers are allocated for, and copies run on, the op's stream.
      c10::cuda::CUDAStreamGuard streamGuard(stream);
      Launch launch(*ds.comm, stream);
      for (auto& it : items) it.prepare(launch);
      launch.issue(Clock::now() + info.timeout, where);
      launch.finish();
      auto end = std::make_shared<c10::cuda::CUDAEvent>();
      end->record(stream);
      if (asyncOp && !cfg.avoidRecordStreams) {
        // The caller may drop its tensors at once; the allocator must not hand their memory to
        // the caller's stream before the NCCL stream is done with it.
        for (auto& it : items) {
          for (auto& t : it.keep) {
            if (t.defined() && t.storage().nbytes() > 0) {
              c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
            }
          }
        }
      }
      // (avoidRecordStreams: each Work holds its tensors until the watchdog sees it finished.)
      return Issued{std::move(end), stream, ds.comm, captured};
    } catch (const CommError& e) {
      failGroup(items, extra, e.what(), e.kind() == CommErrorKind::Timeout);
      throwDistError(std::string("myccl: ") + e.what());
    } catch (const std::exception& e) {
      // Keep the exception's type (OutOfMemoryError, DistBackendError, ...) for the caller.
      failGroup(items, extra, where + ": could not be issued: " + errorText(e), false);
      throw;
    }
  }

  // Completes the Works' futures and hands them to the watchdog. Outside issueMu: future
  // callbacks run inline here and may well issue the next op.
  void publish(const std::vector<Item>& items, const std::vector<NcclWorkPtr>& extra, const Issued& where) {
    std::exception_ptr callbackError;
    auto one = [&](const NcclWorkPtr& w) {
      try {
        w->launched(where.end, where.stream, where.comm, where.captured);
      } catch (...) {
        if (!callbackError) callbackError = std::current_exception();  // a callback threw; the op is issued
      }
      if (!where.captured) watchdog->track(w);
    };
    for (const auto& it : items) one(it.work);
    for (const auto& w : extra) one(w);
    if (callbackError) std::rethrow_exception(callbackError);
  }

  void failGroup(std::vector<Item>& items, const std::vector<NcclWorkPtr>& extra, const std::string& why,
                 bool timedOut) {
    watchdog->fail(why, timedOut);
    for (auto& it : items) {
      if (!it.work->isLaunched()) it.work->fail("myccl: " + why);
    }
    for (auto& w : extra) {
      if (!w->isLaunched()) w->fail("myccl: " + why);
    }
  }

  // Every op goes through here.
  NcclEngine::WorkPtr submit(const OpInfo& info, c10::Device dev, bool asyncOp, std::vector<at::Tensor> inputs,
                             std::vector<at::Tensor> outputs, std::function<void(Launch&)> prepare,
                             bool hostSync = false) {
    checkOpen(info);
    if (!timeoutFixed) timeout = info.timeout;
    auto work = makeWork(info, inputs, outputs, dev);
    if (hostSync) work->setHostSync();
    Item item{work, concat(std::move(inputs), outputs), std::move(prepare)};
    {
      std::lock_guard<std::mutex> lk(coalesceMu);
      if (coalescing) {
        MYCCL_CHECK(!deferredDevice || *deferredDevice == dev, info.describe(),
                    ": all CUDA ops of one coalescing block must use one device; this one uses ", dev,
                    ", earlier ones ", *deferredDevice);
        deferredDevice = dev;
        deferred.push_back(std::move(item));
        return work;
      }
    }
    std::vector<Item> items;
    items.push_back(std::move(item));
    std::optional<Issued> issued;
    {
      std::lock_guard<std::mutex> lk(issueMu);
      checkOpen(info);
      issued.emplace(run(items, dev, asyncOp, info, {}));
    }
    publish(items, {}, *issued);
    return work;
  }

  void dropDeferred(const std::string& why) {
    std::vector<Item> items;
    {
      std::lock_guard<std::mutex> lk(coalesceMu);
      items.swap(deferred);
      deferredDevice.reset();
      coalescing = false;
    }
    for (auto& it : items) it.work->fail("myccl: " + it.work->info().describe() + ": not issued: " + why);
  }
};

NcclEngine::NcclEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string group,
                       const Config& cfg, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(std::move(store), rank, size, std::move(group), cfg, timeout)) {}

NcclEngine::~NcclEngine() {
  if (!impl_->closed) abort("the process group was destroyed without shutdown()");
  impl_->watchdog->stop();
}

// ---- collectives ---------------------------------------------------------------------------

NcclEngine::WorkPtr NcclEngine::broadcast(OpInfo info, at::Tensor t, int root, bool asyncOp) {
  const bool isRoot = info.rank == root;
  return impl_->submit(info, t.device(), asyncOp, {t}, {t}, [t, root, isRoot](Launch& L) {
    if (t.numel() == 0) return;
    at::Tensor buf = L.buffer(t, t.scalar_type(), /*copyIn=*/isRoot, /*copyBack=*/!isRoot);
    const size_t n = nbytesOf(buf);
    L.nccl([buf, n, root](const Launch& l) {
      return ncclBroadcast(buf.data_ptr(), buf.data_ptr(), n, ncclUint8, root, l.comm(), l.stream());
    });
  });
}

NcclEngine::WorkPtr NcclEngine::allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red,
                                          bool asyncOp) {
  const NcclReduce plan = planReduce(red, argWhere(info));
  const auto dev = tensors.at(0).device();
  // A list is coalesced: one allreduce per tensor, all in one group.
  return impl_->submit(info, dev, asyncOp, tensors, tensors, [tensors, plan](Launch& L) {
    for (const auto& t : tensors) {
      if (t.numel() == 0) continue;
      at::Tensor buf = L.buffer(t, plan.stage, true, true);
      const int slot = L.redOp(plan);
      const size_t count = static_cast<size_t>(buf.numel() * plan.perElement);
      L.nccl([buf, count, plan, slot](const Launch& l) {
        return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), count, plan.type, l.op(slot), l.comm(), l.stream());
      });
    }
  });
}

NcclEngine::WorkPtr NcclEngine::reduce(OpInfo info, at::Tensor t, const Reduction& red, int root, bool asyncOp) {
  const NcclReduce plan = planReduce(red, argWhere(info));
  const bool isRoot = info.rank == root;
  return impl_->submit(info, t.device(), asyncOp, {t}, {t}, [t, plan, root, isRoot](Launch& L) {
    if (t.numel() == 0) return;
    // Only the root's buffer receives; the others' stay as they were.
    at::Tensor buf = L.buffer(t, plan.stage, true, /*copyBack=*/isRoot);
    const int slot = L.redOp(plan);
    const size_t count = static_cast<size_t>(buf.numel() * plan.perElement);
    L.nccl([buf, count, plan, slot, root](const Launch& l) {
      return ncclReduce(buf.data_ptr(), buf.data_ptr(), count, plan.type, l.op(slot), root, l.comm(), l.stream());
    });
  });
}

NcclEngine::WorkPtr NcclEngine::allgather(OpInfo info, std::vector<at::Tensor> inputs,
                                          std::vector<std::vector<at::Tensor>> outputs, bool asyncOp) {
  std::vector<at::Tensor> flatOut;
  for (auto& list : outputs) flatOut.insert(flatOut.end(), list.begin(), list.end());
  const int rank = info.rank;
  const auto dev = inputs.at(0).device();
  return impl_->submit(info, dev, asyncOp, inputs, flatOut, [inputs, outputs, rank](Launch& L) {
    for (size_t k = 0; k < inputs.size(); ++k) {
      const at::Tensor& in = inputs[k];
      const auto& outs = outputs[k];
      const size_t size = outs.size();
      const size_t each = nbytesOf(in);
      // Which algorithm depends only on the block sizes, which every rank agrees on; where the
      // bytes land (straight into the caller's buffer or through a scratch one) is local.
      bool even = true;
      for (const auto& o : outs) even = even && nbytesOf(o) == each;
      if (even) {
        if (each == 0) continue;
        const int64_t n = in.numel();
        const bool direct = consecutiveBlocks(outs, each);
        at::Tensor dst = direct ? outs[0] : at::empty({static_cast<int64_t>(size) * n}, in.options());
        void* dstPtr = dst.data_ptr();
        at::Tensor src = L.buffer(in, in.scalar_type(), true, false);
        // In place (the input is this rank's block) is fine for NCCL; any other overlap is not.
        if (src.data_ptr() != static_cast<char*>(dstPtr) + rank * each &&
            overlaps(src.data_ptr(), each, dstPtr, size * each)) {
          src = src.clone(at::MemoryFormat::Contiguous);
        }
        L.nccl([src, dst, dstPtr, each](const Launch& l) {
          return ncclAllGather(src.data_ptr(), dstPtr, each, ncclUint8, l.comm(), l.stream());
        });
        if (!direct) {
          L.after([dst, outs, n]() {
            for (size_t r = 0; r < outs.size(); ++r) {
              outs[r].copy_(dst.narrow(0, static_cast<int64_t>(r) * n, n).view(outs[r].sizes()));
            }
          });
        }
      } else {
        // Uneven blocks: rank r broadcasts its input into everyone's outs[r].
        at::Tensor src = L.buffer(in, in.scalar_type(), true, false);
        for (size_t r = 0; r < size; ++r) {
          const size_t n = nbytesOf(outs[r]);
          if (n == 0) continue;
          at::Tensor dst = L.buffer(outs[r], outs[r].scalar_type(), false, true);
          at::Tensor from = static_cast<int>(r) == rank ? src : dst;  // sendbuff is only read on the root
          const int root = static_cast<int>(r);
          L.nccl([from, dst, n, root](const Launch& l) {
            return ncclBroadcast(from.data_ptr(), dst.data_ptr(), n, ncclUint8, root, l.comm(), l.stream());
          });
        }
      }
    }
  });
}

NcclEngine::WorkPtr NcclEngine::gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root,
                                       bool asyncOp) {
  const int rank = info.rank;
  return impl_->submit(info, input.device(), asyncOp, {input}, outputs, [input, outputs, root, rank](Launch& L) {
    if (rank != root) {
      const size_t n = nbytesOf(input);
      if (n == 0) return;
      at::Tensor src = L.buffer(input, input.scalar_type(), true, false);
      L.nccl([src, n, root](const Launch& l) { return ncclSend(src.data_ptr(), n, ncclUint8, root, l.comm(), l.stream()); });
      return;
    }
    for (size_t r = 0; r < outputs.size(); ++r) {
      const size_t n = nbytesOf(outputs[r]);
      if (static_cast<int>(r) == root || n == 0) continue;
      at::Tensor dst = L.buffer(outputs[r], outputs[r].scalar_type(), false, true);
      const int peer = static_cast<int>(r);
      L.nccl([dst, n, peer](const Launch& l) { return ncclRecv(dst.data_ptr(), n, ncclUint8, peer, l.comm(), l.stream()); });
    }
    if (input.numel() > 0) outputs[root].copy_(input);  // own block: a local copy on the stream
  });
}

NcclEngine::WorkPtr NcclEngine::scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root,
                                        bool asyncOp) {
  const int rank = info.rank;
  return impl_->submit(info, output.device(), asyncOp, inputs, {output}, [inputs, output, root, rank](Launch& L) {
    if (rank != root) {
      const size_t n = nbytesOf(output);
      if (n == 0) return;
      at::Tensor dst = L.buffer(output, output.scalar_type(), false, true);
      L.nccl([dst, n, root](const Launch& l) { return ncclRecv(dst.data_ptr(), n, ncclUint8, root, l.comm(), l.stream()); });
      return;
    }
    for (size_t r = 0; r < inputs.size(); ++r) {
      const size_t n = nbytesOf(inputs[r]);
      if (static_cast<int>(r) == root || n == 0) continue;
      at::Tensor src = L.buffer(inputs[r], inputs[r].scalar_type(), true, false);
      const int peer = static_cast<int>(r);
      L.nccl([src, n, peer](const Launch& l) { return ncclSend(src.data_ptr(), n, ncclUint8, peer, l.comm(), l.stream()); });
    }
    if (output.numel() > 0) output.copy_(inputs[root]);
  });
}

NcclEngine::WorkPtr NcclEngine::reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                              std::vector<at::Tensor> outputs, const Reduction& red, bool asyncOp) {
  const NcclReduce plan = planReduce(red, argWhere(info));
  std::vector<at::Tensor> flatIn;
  for (auto& list : inputs) flatIn.insert(flatIn.end(), list.begin(), list.end());
  const int rank = info.rank;
  const auto dev = outputs.at(0).device();
  return impl_->submit(info, dev, asyncOp, flatIn, outputs, [inputs, outputs, plan, rank](Launch& L) {
    for (size_t k = 0; k < outputs.size(); ++k) {
      const auto& ins = inputs[k];
      const at::Tensor& out = outputs[k];
      const int64_t n = out.numel();
      bool even = true;
      for (const auto& b : ins) even = even && b.numel() == n;
      const int slot = L.redOp(plan);
      if (even) {
        if (n == 0) continue;
        const size_t each = static_cast<size_t>(n) * c10::elementSize(plan.stage);
        at::Tensor src;
        if (ins.at(0).scalar_type() == plan.stage && consecutiveBlocks(ins, each)) {
          src = ins[0];  // the blocks already form one flat input
        } else {
          src = at::empty({static_cast<int64_t>(ins.size()) * n}, out.options().dtype(plan.stage));
          for (size_t r = 0; r < ins.size(); ++r) {
            src.narrow(0, static_cast<int64_t>(r) * n, n).view(ins[r].sizes()).copy_(ins[r]);
          }
        }
        void* srcPtr = src.data_ptr();
        at::Tensor dst = L.buffer(out, plan.stage, false, true);
        // In place (the output is this rank's block of the input) is fine; other overlap is not.
        if (dst.data_ptr() != static_cast<char*>(srcPtr) + rank * each &&
            overlaps(dst.data_ptr(), each, srcPtr, ins.size() * each)) {
          at::Tensor fresh = at::empty(out.sizes(), out.options().dtype(plan.stage).memory_format(at::MemoryFormat::Contiguous));
          L.after([out, fresh]() mutable { out.copy_(fresh); });
          dst = fresh;
        }
        const size_t count = static_cast<size_t>(n * plan.perElement);
        L.nccl([src, srcPtr, dst, count, plan, slot](const Launch& l) {
          return ncclReduceScatter(srcPtr, dst.data_ptr(), count, plan.type, l.op(slot), l.comm(), l.stream());
        });
      } else {
        // Uneven blocks: one reduce per rank, rooted at the rank that keeps that block.
        for (size_t r = 0; r < ins.size(); ++r) {
          const int64_t m = ins[r].numel();
          if (m == 0) continue;
          at::Tensor src = L.buffer(ins[r], plan.stage, true, false);
          at::Tensor dst = static_cast<int>(r) == rank ? L.buffer(out, plan.stage, false, true) : src;
          const size_t count = static_cast<size_t>(m * plan.perElement);
          const int root = static_cast<int>(r);
          L.nccl([src, dst, count, plan, slot, root](const Launch& l) {
            return ncclReduce(src.data_ptr(), dst.data_ptr(), count, plan.type, l.op(slot), root, l.comm(), l.stream());
          });
        }
      }
    }
  });
}

NcclEngine::WorkPtr NcclEngine::alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                         bool asyncOp) {
  const int rank = info.rank;
  const auto dev = inputs.at(0).device();
  return impl_->submit(info, dev, asyncOp, inputs, outputs, [inputs, outputs, rank](Launch& L) {
    for (size_t r = 0; r < inputs.size(); ++r) {
      const int peer = static_cast<int>(r);
      if (peer == rank) {
        if (inputs[r].numel() > 0) outputs[r].copy_(inputs[r].reshape(outputs[r].sizes()));
        continue;
      }
      // Sizes may differ per peer; each pair agrees on its own (what I send is what it expects).
      const size_t sendBytes = nbytesOf(inputs[r]), recvBytes = nbytesOf(outputs[r]);
      if (sendBytes > 0) {
        at::Tensor src = L.buffer(inputs[r], inputs[r].scalar_type(), true, false);
        L.nccl([src, sendBytes, peer](const Launch& l) {
          return ncclSend(src.data_ptr(), sendBytes, ncclUint8, peer, l.comm(), l.stream());
        });
      }
      if (recvBytes > 0) {
        at::Tensor dst = L.buffer(outputs[r], outputs[r].scalar_type(), false, true);
        L.nccl([dst, recvBytes, peer](const Launch& l) {
          return ncclRecv(dst.data_ptr(), recvBytes, ncclUint8, peer, l.comm(), l.stream());
        });
      }
    }
  });
}

NcclEngine::WorkPtr NcclEngine::barrier(OpInfo info, at::Device device) {
  if (!device.has_index()) device = at::Device(at::kCUDA, c10::cuda::current_device());
  // One element through the communicator: every rank's kernel must meet every other's.
  at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  Reduction sum;
  NcclReduce plan = planReduce(sum, argWhere(info));
  return impl_->submit(
      info, device, /*asyncOp=*/true, {}, {token},
      [token, plan](Launch& L) {
        const int slot = L.redOp(plan);
        L.nccl([token, plan, slot](const Launch& l) {
          return ncclAllReduce(token.data_ptr(), token.data_ptr(), 1, plan.type, l.op(slot), l.comm(), l.stream());
        });
      },
      /*hostSync=*/true);
}

// ---- point-to-point ------------------------------------------------------------------------

NcclEngine::WorkPtr NcclEngine::send(OpInfo info, at::Tensor t, int peer) {
  // Point-to-point always runs on the NCCL stream: a send must not serialise the caller's stream.
  return impl_->submit(info, t.device(), /*asyncOp=*/true, {t}, {t}, [t, peer](Launch& L) {
    const size_t n = nbytesOf(t);
    if (n == 0) return;
    at::Tensor src = L.buffer(t, t.scalar_type(), true, false);
    L.nccl([src, n, peer](const Launch& l) { return ncclSend(src.data_ptr(), n, ncclUint8, peer, l.comm(), l.stream()); });
  });
}

NcclEngine::WorkPtr NcclEngine::recv(OpInfo info, at::Tensor t, int peer) {
  return impl_->submit(info, t.device(), /*asyncOp=*/true, {}, {t}, [t, peer](Launch& L) {
    const size_t n = nbytesOf(t);
    if (n == 0) return;
    at::Tensor dst = L.buffer(t, t.scalar_type(), false, true);
    L.nccl([dst, n, peer](const Launch& l) { return ncclRecv(dst.data_ptr(), n, ncclUint8, peer, l.comm(), l.stream()); });
  });
}

// ---- coalescing ----------------------------------------------------------------------------

void NcclEngine::startCoalescing() {
  // A block left open by an exception never reached endCoalescing: its ops were never issued.
  impl_->dropDeferred("its coalescing block was abandoned (a new one started before end_coalescing)");
  std::lock_guard<std::mutex> lk(impl_->coalesceMu);
  impl_->coalescing = true;
}

NcclEngine::WorkPtr NcclEngine::endCoalescing(OpInfo info) {
  std::vector<Item> items;
  std::optional<c10::Device> dev;
  {
    std::lock_guard<std::mutex> lk(impl_->coalesceMu);
    impl_->coalescing = false;
    items.swap(impl_->deferred);
    dev.swap(impl_->deferredDevice);
  }
  if (items.empty()) {
    // No CUDA op in the block (or the engine was created inside it, after the start): nothing to cover.
    auto w = c10::make_intrusive<MycclWork>(info, std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
    w->markDone();
    return w;
  }
  std::vector<at::Tensor> outs;
  for (auto& it : items) {
    for (auto& t : it.work->result()) outs.push_back(t);
  }
  auto batch = impl_->makeWork(info, {}, outs, *dev);
  try {
    impl_->checkOpen(info);
  } catch (const std::exception& e) {
    for (auto& it : items) it.work->fail("myccl: " + it.work->info().describe() + ": not issued: " + errorText(e));
    throw;
  }
  std::optional<Impl::Issued> issued;
  {
    std::lock_guard<std::mutex> lk(impl_->issueMu);
    issued.emplace(impl_->run(items, *dev, /*asyncOp=*/true, info, {batch}));
  }
  impl_->publish(items, {batch}, *issued);
  return batch;
}

// ---- lifecycle -----------------------------------------------------------------------------

void NcclEngine::eagerConnect(at::Device device) {
  if (!device.has_index()) device = at::Device(at::kCUDA, c10::cuda::current_device());
  OpInfo info;
  info.op = info.name = "eager_connect";
  info.rank = impl_->rank;
  info.group = impl_->group;
  info.timeout = impl_->timeout.load();
  std::lock_guard<std::mutex> lk(impl_->issueMu);
  impl_->checkOpen(info);
  c10::cuda::CUDAGuard guard(device.index());
  try {
    impl_->deviceState(device, info.timeout, info.describe());
  } catch (const std::exception& e) {
    impl_->watchdog->fail(info.describe() + ": " + errorText(e), false);
    throw;
  }
}

void NcclEngine::setTimeout(std::chrono::milliseconds timeout) {
  impl_->timeout = timeout;
  impl_->timeoutFixed = true;
}

void NcclEngine::abort(const std::string& why) {
  // Deliberately without issueMu: an issuing thread may be the one that is stuck.
  impl_->closed = true;
  impl_->dropDeferred("the group was aborted");
  impl_->watchdog->fail("rank " + std::to_string(impl_->rank) + ", group '" + impl_->group + "': " + why, false);
  impl_->watchdog->stop();
}

void NcclEngine::shutdown() {
  std::lock_guard<std::mutex> lk(impl_->issueMu);
  if (impl_->closed.exchange(true)) return;
  impl_->dropDeferred("the group was shut down");
  auto& wd = *impl_->watchdog;
  if (!wd.failed()) {
    // Outstanding ops finish or hit their own timeout (the watchdog enforces it), then each
    // communicator is finalized (flushed, globally quiescent) and destroyed.
    wd.drain();
    const auto deadline = Clock::now() + impl_->timeout.load();
    for (auto& [idx, ds] : impl_->devices) {
      // false: an error or the deadline (a peer gone or aborted); the communicator was aborted instead.
      (void)ds->comm->finalize(deadline);
    }
  }
  wd.stop();
  wd.failOutstanding("the group was shut down before the op finished");
}

bool NcclEngine::failed() const {
  return impl_->watchdog->failed();
}

bool NcclEngine::timedOut() const {
  return impl_->watchdog->timedOut();
}

std::string NcclEngine::version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
  int major, minor, patch;
  if (v >= 10000) {
    major = v / 10000;
    minor = (v % 10000) / 100;
  } else {
    major = v / 1000;
    minor = (v % 1000) / 100;
  }
  patch = v % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace myccl::cuda
