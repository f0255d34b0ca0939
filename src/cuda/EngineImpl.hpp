// The state of one group's CUDA engine (private to src/cuda): its communicator slots (the
// group's, one per device, and a two-rank one per peer pair for point-to-point, each with its own
// stream), the coalescing block, sends to self, and the issue path every op takes (submit).
// Defined across NcclEngine.cpp (lifecycle, issuing, publishing), Comms.cpp (communicators) and
// NcclOps.cpp (what each op launches, through Launch.hpp).
#pragma once

#include "myccl/cuda/NcclEngine.hpp"

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "ErrorText.hpp"
#include "Launch.hpp"
#include "myccl/Errors.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclTypes.hpp"
#include "myccl/cuda/NcclWork.hpp"
#include "myccl/cuda/Watchdog.hpp"

namespace myccl::cuda {

using NcclWorkPtr = c10::intrusive_ptr<NcclWork>;

// "<op> (rank R)": the prefix of argument errors (MYCCL_CHECK_ARG adds "myccl: "), formatted
// only if one is raised.
inline Where argWhere(const OpInfo& info) {
  return Where{info.op.c_str(), info.rank};
}

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

  // A coalescing block is open (its ops are held for its end).
  bool isCoalescing();
  // Raises the watchdog's error of a failed group, or that the group was shut down.
  void checkOpen(const OpInfo& info) const;
  // An op's Work, queued in the flight recorder when there is one.
  NcclWorkPtr makeWork(OpInfo info, std::vector<at::Tensor>&& inputs, std::vector<at::Tensor>&& outputs,
                       c10::Device device);

  // How NCCL reduces `red` for an op on `device` (float8: when this NCCL and GPU can).
  NcclReduce plan(const Reduction& red, const OpInfo& info, c10::Device device);

  // The loaded NCCL's version and the device's compute capability, asked once (not per op).
  std::pair<int, int> float8Facts(int device);
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
