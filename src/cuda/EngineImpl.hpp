// The state of one group's CUDA engine and its launch path (private to src/cuda): communicator
// slots (the group's, one per device, and a two-rank one per peer pair for point-to-point, each
// with its own stream), Launch (one op's staging copies, NCCL calls and copies back on one
// stream), issuing and publishing Works, the coalescing block and sends to self. Everything
// device- or NCCL-specific goes through the Runtime seam (Runtime.hpp). Shared by NcclEngine.cpp
// (lifecycle), Comms.cpp (communicators) and NcclOps.cpp (what each op launches).
#pragma once

#include "myccl/cuda/NcclEngine.hpp"

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/SmallVector.h>

#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "myccl/Errors.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclTypes.hpp"
#include "myccl/cuda/NcclWork.hpp"
#include "myccl/cuda/Watchdog.hpp"

namespace myccl::cuda {

using NcclWorkPtr = c10::intrusive_ptr<NcclWork>;

inline size_t nbytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// "<op> (rank R)": the prefix of argument errors (MYCCL_CHECK_ARG adds "myccl: "), formatted
// only if one is raised.
inline Where argWhere(const OpInfo& info) {
  return Where{info.op.c_str(), info.rank};
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

inline void checkNccl(Nccl& nccl, NcclResult r, const char* call, const Described& where, NcclCommHandle comm) {
  if (r == NcclResult::Success || r == NcclResult::InProgress) return;
  auto kind = (r == NcclResult::RemoteError || r == NcclResult::SystemError) ? CommErrorKind::PeerGone
                                                                              : CommErrorKind::Local;
  throw CommError(kind, where + ": " + call + " failed: " + ncclErrorText(nccl, r, comm));
}

// A communicator with the stream its asynchronous ops run on.
struct CommSlot {
  std::string key;  // "group0", "p2p0-1"
  std::shared_ptr<NcclComm> comm;
  Stream stream{Stream::DEFAULT, c10::Device(c10::kCPU)};  // set when made
  std::unique_ptr<Event> ready;  // caller's stream -> this stream; reusable, block() copies its state
  int device = 0;
  int lowRank = -1;  // two-rank communicators: the group rank that is rank 0 in it (-1: the group's)

  // The rank `groupRank` has in this communicator.
  int peerIndex(int groupRank) const { return lowRank < 0 ? groupRank : (groupRank == lowRank ? 0 : 1); }
};

// One NCCL call of a launch, by value: what Launch::issue passes to NCCL inside the group.
// Ranks are group ranks (translated to the communicator's at the call).
struct NcclCall {
  enum Kind : uint8_t { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, Send, Recv } kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  NcclType type = NcclType::Uint8;
  int opSlot = -1;  // reductions: Launch::redOp's slot
  int peer = -1;    // root or peer
};

// One enqueue: an op, or a coalesced batch of ops, on one communicator and one stream. Ops
// describe themselves into it in three phases, so that no copy ever runs inside an open NCCL
// group (kernels launched there would run before the group's, not after). The common op (one
// contiguous tensor, one NCCL call) allocates nothing here: calls are plain records and the
// lists keep their first entries inline.
class Launch {
 public:
  Launch(Device& dev, CommSlot& slot, Stream stream) : dev_(dev), slot_(slot), stream_(stream) {}

  // ---- phase 1, on the stream before the NCCL calls: staging ----
  // Local work on the stream (copies between the caller's tensors and staging buffers).
  void stage(std::function<void()> f) { stages_.push_back(std::move(f)); }
  // A tensor of the given size and dtype for staging, allocated for this stream.
  at::Tensor scratch(at::IntArrayRef sizes, at::ScalarType type) { return dev_.empty(sizes, type, stream_); }
  // A contiguous tensor of dtype `type` standing in for `user`; `user` itself when it already
  // is one. copyIn: filled from `user` first; copyBack: copied into `user` after the NCCL calls.
  at::Tensor buffer(const at::Tensor& user, at::ScalarType type, bool copyIn, bool copyBack) {
    if (user.is_contiguous() && user.scalar_type() == type) return user;
    at::Tensor buf = scratch(user.sizes(), type);
    if (copyIn) stage([buf, user]() mutable { buf.copy_(user); });
    if (copyBack) after([user, buf]() mutable { user.copy_(buf); });
    return buf;
  }
  // A reduction operator for the calls; PREMUL_SUM operators are created per launch (before the
  // group opens) and destroyed once it is closed. A tensor factor is copied on the stream into a
  // device scalar that NCCL reads when the op runs: no host synchronisation. Returns a slot for op().
  int redOp(const NcclReduce& plan) {
    for (size_t i = 0; i < ops_.size(); ++i) {
      const auto& s = ops_[i].plan;
      if (s.type == plan.type && s.op == plan.op && s.premul == plan.premul && s.factor == plan.factor &&
          s.factorTensor.is_same(plan.factorTensor)) {
        return static_cast<int>(i);
      }
    }
    OpSlot s{plan, {}, kNcclSum};
    if (plan.premul && plan.factorTensor.defined()) {
      s.scalar = scratch({1}, scalarTypeOf(plan.type));
      stage([scalar = s.scalar, f = plan.factorTensor]() mutable { scalar.copy_(f.reshape({1})); });
    }
    ops_.push_back(std::move(s));
    return static_cast<int>(ops_.size() - 1);
  }
  // ---- phase 2, inside one group, under the communicator lock ----
  // Counts are in elements of `type` (bytes for the byte-wise ones). The tensors are held until
  // the group has ended (stream order keeps staging buffers safe after that).
  void allReduce(const at::Tensor& buf, size_t count, NcclType type, int opSlot) {
    call({NcclCall::AllReduce, buf.data_ptr(), buf.data_ptr(), count, type, opSlot, -1}, buf);
  }
  void broadcast(const at::Tensor& from, const at::Tensor& to, size_t bytes, int root) {
    call({NcclCall::Broadcast, from.data_ptr(), to.data_ptr(), bytes, NcclType::Uint8, -1, root}, from, to);
  }
  void reduce(const at::Tensor& from, const at::Tensor& to, size_t count, NcclType type, int opSlot, int root) {
    call({NcclCall::Reduce, from.data_ptr(), to.data_ptr(), count, type, opSlot, root}, from, to);
  }
  // `bytes` per rank, gathered into `to` at `dst`.
  void allGather(const at::Tensor& from, const at::Tensor& to, void* dst, size_t bytes) {
    call({NcclCall::AllGather, from.data_ptr(), dst, bytes, NcclType::Uint8, -1, -1}, from, to);
  }
  // `count` elements per rank, from `from` at `src`.
  void reduceScatter(const at::Tensor& from, const void* src, const at::Tensor& to, size_t count, NcclType type,
                     int opSlot) {
    call({NcclCall::ReduceScatter, src, to.data_ptr(), count, type, opSlot, -1}, from, to);
  }
  void send(const at::Tensor& from, size_t bytes, int peer) { send(from, from.data_ptr(), bytes, peer); }
  void recv(const at::Tensor& to, size_t bytes, int peer) { recv(to, to.data_ptr(), bytes, peer); }
  // From or into `at`, inside `owner` (which the call holds).
  void send(const at::Tensor& owner, const void* at, size_t bytes, int peer) {
    call({NcclCall::Send, at, nullptr, bytes, NcclType::Uint8, -1, peer}, owner);
  }
  void recv(const at::Tensor& owner, void* at, size_t bytes, int peer) {
    call({NcclCall::Recv, nullptr, at, bytes, NcclType::Uint8, -1, peer}, owner);
  }
  // ---- phase 3, after the group, on the stream ----
  void after(std::function<void()> f) { afters_.push_back(std::move(f)); }

  // Runner: phases 1 and 2. Throws CommError (the group must then be failed).
  void issue(Clock::time_point deadline, const Described& where) {
    if (!stages_.empty()) {
      dev_.enqueue(stream_, [fs = std::move(stages_)]() {
        for (const auto& f : fs) f();
      });
      stages_.clear();
    }
    if (calls_.empty()) return;  // e.g. a group of one rank gathering: only local copies
    NcclComm& comm = *slot_.comm;
    Nccl& api = comm.nccl();
    auto lk = comm.lock(where);
    const NcclCommHandle handle = comm.get();
    c10::SmallVector<NcclRedOp, 2> created;
    for (auto& s : ops_) {
      s.op = s.plan.op;
      if (!s.plan.premul) continue;
      alignas(8) unsigned char host[8] = {};
      NcclResult r;
      if (s.scalar.defined()) {
        r = api.redOpCreatePreMulSum(&s.op, s.scalar.data_ptr(), s.plan.type, ScalarResidence::Device, handle);
      } else {
        premulScalar(s.plan.type, s.plan.factor, host);
        r = api.redOpCreatePreMulSum(&s.op, host, s.plan.type, ScalarResidence::HostImmediate, handle);
      }
      checkNccl(api, r, "ncclRedOpCreatePreMulSum", where, handle);
      created.push_back(s.op);
    }
    checkNccl(api, api.groupStart(), "ncclGroupStart", where, handle);
    try {
      for (const auto& c : calls_) {
        // Aborted from another thread while this one was stuck inside NCCL: the handle is gone.
        if (comm.aborted()) throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator was aborted");
        checkNccl(api, make(api, c, handle), "an NCCL call", where, handle);
      }
    } catch (...) {
      (void)api.groupEnd();  // keep this thread's group depth right; the group is failed next
      throw;
    }
    NcclResult r = api.groupEnd();
    checkNccl(api, r, "ncclGroupEnd", where, handle);
    comm.settle(lk, r, deadline, where);
    // "An operator may be destroyed as soon as the last NCCL function given it returns": that is
    // the group end.
    for (auto op : created) (void)api.redOpDestroy(op, handle);
    calls_.clear();
    held_.clear();  // the staging buffers: stream order keeps them safe from here on
  }
  // Runner: phase 3.
  void finish() {
    if (afters_.empty()) return;
    dev_.enqueue(stream_, [fs = std::move(afters_)]() {
      for (const auto& f : fs) f();
    });
    afters_.clear();
  }

 private:
  struct OpSlot {
    NcclReduce plan;
    at::Tensor scalar;  // device premul factor
    NcclRedOp op;
  };
  template <class... T>
  void call(const NcclCall& c, const T&... hold) {
    calls_.push_back(c);
    (held_.push_back(hold), ...);
  }
  NcclResult make(Nccl& api, const NcclCall& c, NcclCommHandle h) const {
    const NcclRedOp op = c.opSlot >= 0 ? ops_[static_cast<size_t>(c.opSlot)].op : kNcclSum;
    switch (c.kind) {
      case NcclCall::AllReduce:
        return api.allReduce(c.send, c.recv, c.count, c.type, op, h, stream_);
      case NcclCall::Broadcast:
        return api.broadcast(c.send, c.recv, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
      case NcclCall::Reduce:
        return api.reduce(c.send, c.recv, c.count, c.type, op, slot_.peerIndex(c.peer), h, stream_);
      case NcclCall::AllGather:
        return api.allGather(c.send, c.recv, c.count, c.type, h, stream_);
      case NcclCall::ReduceScatter:
        return api.reduceScatter(c.send, c.recv, c.count, c.type, op, h, stream_);
      case NcclCall::Send:
        return api.send(c.send, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
      case NcclCall::Recv:
        return api.recv(c.recv, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
    }
    return NcclResult::InvalidArgument;
  }
  Device& dev_;
  CommSlot& slot_;
  Stream stream_;
  c10::SmallVector<std::function<void()>, 1> stages_;
  c10::SmallVector<NcclCall, 2> calls_;
  c10::SmallVector<at::Tensor, 4> held_;
  c10::SmallVector<std::function<void()>, 1> afters_;
  c10::SmallVector<OpSlot, 1> ops_;
};

// Which communicator an op runs on.
struct Target {
  enum Kind { Group, Pair } kind = Group;
  int peer = -1;  // Pair: the other group rank
};

// How an op stages and issues itself into a Launch, reading its tensors from its Work.
using PrepareRef = c10::function_ref<void(Launch&, const NcclWork&)>;
using Prepare = std::function<void(Launch&, const NcclWork&)>;

// One op held back in a coalescing block: its Work (which holds the caller's tensors the
// stream will touch) and how it launches.
struct Item {
  NcclWorkPtr work;
  Prepare prepare;
};

// Sends to and receives from this rank itself outside a batch, matched per tag in posting
// order: NCCL would need both in one group, so the pair becomes one device copy once both
// have been posted.
struct SelfPost {
  NcclWorkPtr work;
  at::Tensor tensor;
  std::shared_ptr<Event> ready;  // the caller's stream at posting time
  int device;
};

struct NcclEngine::Impl {
  Impl(c10::intrusive_ptr<c10d::Store> s, std::string keyPrefix, int r, int n, std::string g, const Config& c,
       std::chrono::milliseconds t, Runtime runtime, std::shared_ptr<AbortHooks> hooks,
       std::shared_ptr<Recorder> rec);

  c10::intrusive_ptr<c10d::Store> store;
  const std::string prefix;  // this incarnation's key space for NCCL ids
  const int rank;
  const int size;
  const std::string group;
  const Config cfg;
  Runtime rt;
  Device& dev;
  // Bounds eagerConnect and shutdown. Until given (constructor or setTimeout) it follows the
  // ops' timeouts, which are the group's timeout unless an op asked for its own.
  std::atomic<std::chrono::milliseconds> timeout;
  std::atomic<bool> timeoutFixed;
  std::shared_ptr<Watchdog> watchdog;
  std::shared_ptr<Recorder> recorder;
  std::function<void(const OpInfo&)> agree;  // MYCCL_DEBUG=DETAIL's cross-rank check (set once, at creation)

  // Serialises issuing: NCCL groups are per thread, and ops must reach NCCL in issue order.
  // Never taken by abort(), which must work while an issuing thread is stuck.
  std::mutex issueMu;
  std::map<std::string, std::unique_ptr<CommSlot>> slots;  // by key, see groupSlot/pairSlot
  std::vector<CommSlot*> groupSlotOf;  // by device: its group slot (null: none yet)
  std::vector<CommSlot*> pairSlotOf;   // by peer: the pair's slot (null: none yet)
  // by[i], grown as needed (a slot is never replaced: every key is made once).
  static CommSlot*& slotAt(std::vector<CommSlot*>& by, int i) {
    const auto k = static_cast<size_t>(i);
    if (by.size() <= k) by.resize(k + 1, nullptr);
    return by[k];
  }
  std::map<std::string, int> creations;                    // store-key attempts per slot key
  int groupComms = 0;
  int splits = 0;  // splitParts calls (names the communicators they make)
  std::atomic<int> lastDevice{-1};  // the device of the latest op (barrier's default)

  // Communicators being created, so that abort() reaches them too.
  std::mutex creatingMu;
  std::vector<std::shared_ptr<NcclComm>> creating;

  // Coalescing state (short critical sections only).
  std::mutex coalesceMu;
  bool coalescing = false;
  std::vector<Item> deferred;
  std::optional<c10::Device> deferredDevice;

  // Unmatched sends to / receives from self, per tag.
  std::mutex selfMu;
  std::map<int, std::deque<SelfPost>> selfSends, selfRecvs;
  std::optional<Stream> selfStream;

  std::atomic<bool> closed{false};

  bool isCoalescing() {
    std::lock_guard<std::mutex> lk(coalesceMu);
    return coalescing;
  }

  void checkOpen(const OpInfo& info) const {
    watchdog->throwIfFailed(info);
    if (closed) throwDistError("myccl: " + info.describe() + ": the group has been shut down");
  }

  NcclWorkPtr makeWork(OpInfo info, std::vector<at::Tensor>&& inputs, std::vector<at::Tensor>&& outputs,
                       c10::Device device) {
    auto w = c10::make_intrusive<NcclWork>(std::move(info), std::move(inputs), std::move(outputs), device, rt.device,
                                           watchdog, cfg.blockingWait);
    if (recorder) {
      const auto type = w->info().type;
      const bool p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV;
      w->setRecord(recorder, recorder->queued(w->info(), p2p));
    }
    return w;
  }

  // How NCCL reduces `red` for an op on `device` (float8: when this NCCL and GPU can).
  NcclReduce plan(const Reduction& red, const OpInfo& info, c10::Device device) {
    if (isFloat8(red.spec.dtype)) {
      const auto [version, capability] = float8Facts(device.index());
      checkFloat8(red.spec.dtype, argWhere(info), version, capability);
    }
    NcclReduce p = planReduce(red, argWhere(info));
    // The average of one rank is its value: a plain sum, which NCCL does for every type (its
    // one-rank path refuses ncclAvg of float8).
    if (size == 1 && p.op == kNcclAvg) p.op = kNcclSum;
    return p;
  }

  // The loaded NCCL's version and the device's compute capability, asked once (not per op).
  std::pair<int, int> float8Facts(int device) {
    std::lock_guard<std::mutex> lk(factsMu);
    if (ncclVersion < 0) ncclVersion = rt.nccl->version();
    auto it = capabilityOf.find(device);
    if (it == capabilityOf.end()) it = capabilityOf.emplace(device, dev.computeCapability(device)).first;
    return {ncclVersion, it->second};
  }
  std::mutex factsMu;
  int ncclVersion = -1;
  std::map<int, int> capabilityOf;

  // ---- communicators (Comms.cpp) ----
  // The group's communicator on `device` (made on first use: collective over the group).
  CommSlot& groupSlot(int device, Clock::time_point deadline, const Described& where);
  // The two-rank communicator with `peer` on `device` (made on first use by these two only).
  CommSlot& pairSlot(int peer, int device, Clock::time_point deadline, const Described& where);
  CommSlot& slotFor(const Target& target, int device, Clock::time_point deadline, const Described& where);
  // Makes the communicator of `members` (group ranks, in the communicator's rank order; the first
  // makes the id) under `key`, which every member derives alike; bounded by `deadline`,
  // interrupted by abort(). `pair`: a two-rank point-to-point communicator.
  CommSlot& create(const std::string& key, const std::vector<int>& members, bool pair, int device,
                   Clock::time_point deadline, const Described& where);
  // Registers a made communicator as the slot `key` (watchdog, stream, ready event).
  CommSlot& addSlot(const std::string& key, std::shared_ptr<NcclComm> comm, int device, int lowRank);
  // A new pair communicator's connections, both directions at once, the same on both sides.
  void connectPair(CommSlot& slot, Clock::time_point deadline, const Described& where);
  // Waits for keys other ranks publish, in short slices so that abort() is noticed.
  void awaitKeys(const std::vector<std::string>& keys, const std::vector<int>& ranks, Clock::time_point deadline,
                 const std::string& what, const Described& where);

  // ---- issuing (NcclEngine.cpp) ----
  struct Issued {
    std::shared_ptr<Event> start, end;
    Stream stream;
    std::shared_ptr<NcclComm> comm;
    bool captured;
  };
  // Issues one op, or a coalesced batch (`prepare` stages and issues them all), as one group on
  // one stream. `works` complete with it: the ops' Works (whose tensors the stream touches) and a
  // block's own Work. Any failure here fails the group: peers may already be inside this op, and
  // skipping it would misalign every later op.
  Issued run(c10::function_ref<void(Launch&)> prepare, c10::ArrayRef<NcclWorkPtr> works, c10::Device device,
             const Target& target, bool asyncOp, const OpInfo& info);
  // Completes the Works' futures and hands them to the watchdog. Outside issueMu: future
  // callbacks run inline here and may well issue the next op.
  void publish(c10::ArrayRef<NcclWorkPtr> works, const Issued& where);
  void failGroup(c10::ArrayRef<NcclWorkPtr> works, const std::string& why, bool timedOut);
  // Every op goes through here. `prepare` is called before submit returns, and never copied,
  // unless a coalescing block is open: the block keeps it for its end.
  // The Work takes `info` over.
  template <class F>
  NcclEngine::WorkPtr submit(OpInfo&& info, c10::Device device, bool asyncOp, std::vector<at::Tensor>&& inputs,
                             std::vector<at::Tensor>&& outputs, F&& prepare, Target target = {},
                             bool hostSync = false) {
    NcclWorkPtr work = admit(std::move(info), device, std::move(inputs), std::move(outputs), hostSync,
                             target.kind == Target::Group);
    if (isCoalescing()) {
      Prepare kept(std::forward<F>(prepare));
      if (!defer(work, kept, device)) issueOne(work, kept, device, target, asyncOp);
      return work;
    }
    issueOne(work, prepare, device, target, asyncOp);
    return work;
  }
  // The Work of a new op, once the group is known to be usable (and, under MYCCL_DEBUG=DETAIL, the
  // ranks agree on an op of the group's communicator).
  NcclWorkPtr admit(OpInfo&& info, c10::Device device, std::vector<at::Tensor>&& inputs,
                    std::vector<at::Tensor>&& outputs, bool hostSync, bool groupOp);
  // Holds the op back in the open coalescing block; false when none is open.
  bool defer(const NcclWorkPtr& work, Prepare& prepare, c10::Device device);
  void issueOne(const NcclWorkPtr& work, PrepareRef prepare, c10::Device device, const Target& target, bool asyncOp);
  // An event for an op's end (or start, `timing`), reused once no Work holds it: making a CUDA
  // event per op costs the host (torch keeps a cache of them too). Not for captured ops.
  std::shared_ptr<Event> pooledEvent(bool timing);
  std::mutex eventMu;
  std::vector<std::shared_ptr<Event>> eventPool[2];  // [timing]
  size_t eventNext[2] = {0, 0};
  void dropDeferred(const std::string& why);
  // A send to / receive from this rank itself (outside a batch).
  NcclEngine::WorkPtr postSelf(const OpInfo& info, at::Tensor t, int tag, bool isSend);
  void abortComms();
};

}  // namespace myccl::cuda
