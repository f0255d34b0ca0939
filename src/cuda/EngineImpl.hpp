// The state of one group's CUDA engine and its launch path (private to src/cuda): the
// communicator and NCCL stream of each device, Launch (one op's staging copies, NCCL calls and
// copies back on one stream), issuing and publishing Works, and the coalescing block. Shared by
// NcclEngine.cpp (lifecycle) and NcclOps.cpp (what each op launches).
#pragma once

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


using NcclWorkPtr = c10::intrusive_ptr<NcclWork>;

inline size_t nbytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// "<op> (rank R)": the prefix of argument errors (MYCCL_CHECK_ARG adds "myccl: ").
inline std::string argWhere(const OpInfo& info) {
  return info.op + " (rank " + std::to_string(info.rank) + ")";
}

inline std::string errorText(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

// Do [p, p+n) and [q, q+m) share a byte?
inline bool overlaps(const void* p, size_t n, const void* q, size_t m) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return n != 0 && m != 0 && a < b + m && b < a + n;
}

// True when ts[r] is the r-th block of `each` bytes of one contiguous buffer starting at ts[0].
inline bool consecutiveBlocks(const std::vector<at::Tensor>& ts, size_t each) {
  if (ts.empty() || each == 0) return false;
  auto* base = static_cast<const char*>(ts[0].data_ptr());
  for (size_t r = 0; r < ts.size(); ++r) {
    if (!ts[r].is_contiguous() || nbytesOf(ts[r]) != each) return false;
    if (static_cast<const char*>(ts[r].data_ptr()) != base + r * each) return false;
  }
  return true;
}

inline void checkNccl(ncclResult_t r, const char* call, const std::string& where, ncclComm_t comm) {
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

inline std::vector<at::Tensor> concat(std::vector<at::Tensor> a, const std::vector<at::Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}


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

}  // namespace myccl::cuda
