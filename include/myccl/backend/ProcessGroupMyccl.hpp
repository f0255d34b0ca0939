// MycclBackend: the c10d::Backend subclass registered as "myccl". It checks arguments, numbers
// each op and routes it to the CPU engine or, for CUDA tensors, to the NCCL engine; it never
// touches bytes. Which file holds which part: docs/DESIGN.md ("Layout").
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include "myccl/AbortHooks.hpp"
#include "myccl/Config.hpp"
#include "myccl/TorchCompat.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/Reduction.hpp"
#include "myccl/Topology.hpp"
#include "myccl/Work.hpp"
#include "myccl/backend/Engines.hpp"
#include "myccl/cpu/Extension.hpp"

namespace myccl {

class Engine;
namespace cpu {
class CpuEngine;
}
namespace cuda {
class Device;
}

class MycclBackend final : public c10d::Backend {
 public:
  // `keyPrefix`: where in the store the group meets (empty: a fresh incarnation's key space; a
  // shrunk group passes the one its members derive from their parent). `reconfigurable`: torch's
  // enable_reconfigure, the group holds no links until reconfigure() names its members.
  // `makeCpu`: builds the CPU engine instead (a split on its parent's links), given the recorder.
  using CpuMaker = std::function<std::shared_ptr<cpu::CpuEngine>(std::shared_ptr<Recorder>)>;
  MycclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
               std::string groupName, std::vector<int64_t> globalRanks, Config cfg, const std::string& keyPrefix = "",
               bool reconfigurable = false, const CpuMaker& makeCpu = nullptr);
  ~MycclBackend() override;

  const std::string getBackendName() const override { return "myccl"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  // The CPU engine's extension point (cpu/Extension.hpp), for layers above: runs `op` on this
  // group's CPU engine as one of its ops (numbered, recorded, with a Work); `inputs` and
  // `outputs` are its tensors for the Work and the record. The caller has checked its arguments.
  c10::intrusive_ptr<c10d::Work> runExtension(cpu::ExtensionOp op, std::vector<at::Tensor> inputs,
                                              std::vector<at::Tensor> outputs);
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits, std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // gloo's semantics and words; blocking (cpu::CpuEngine::monitoredBarrier).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks = false) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  // Collective: a CPU tensor whose storage every rank of this group on this host maps (one
  // copy per host). Zero-filled; writes are visible to the host's other ranks after a barrier.
  at::Tensor sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype, int owner = 0);
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override;

  void eagerConnectSingleDevice(at::Device device) override;
#if MYCCL_TORCH_AT_LEAST(2, 14)
  // init_process_group(device_id=...) binds the group to a device when it registers the backend
  // (torch 2.14 made this virtual): the NCCL communicator is made there, eagerly, as torch's
  // nccl does (it asks only backends that support splitting to connect eagerly).
  void setBoundDeviceId(std::optional<at::Device> device) override;
#endif
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void setSequenceNumberForGroup() override {}  // sequence numbers start at 0 on every rank
  uint64_t getSequenceNumberForGroup() override { return collSeq_.load(); }
  void setTimeout(std::chrono::milliseconds timeout) override;
  c10d::ErrorType getError() override;
#if MYCCL_HAS_ABORT_HOOKS
  // torch's semantics: `timeout` is added to the timeout of every op created after this call
  // until the first of them completes; extensions accumulate and expire independently.
  void addEphemeralTimeout(const std::chrono::milliseconds& timeout) override;
  // Run before the group aborts on a failed op (a timeout or an error), on the thread that saw it.
  void registerAbortHook(int64_t hookId, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t hookId) override;
#endif
#if MYCCL_HAS_SUPPORTS_ABORT_HOOKS
  bool supportsAbortHooks() const override { return true; }
#endif
#if MYCCL_HAS_COMPLETION_HOOKS
  // torch's semantics: once per Work that completes successfully (not for failed or timed-out
  // ones), from the thread that completes it (an engine's, the watchdog's, or the caller's for an
  // op run inline), with the Work's completion key and its duration. torch's flight recorder hook
  // uses it to mark myccl's ops completed instead of only issued.
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t hookId) override;
#endif
  void abort() override;
  void shutdown() override;

  // torch's split_group: called on every rank of this group with the ranks (of this group, in the
  // new group's order) of the caller's new group; null for a rank not in it. The group's NCCL
  // communicators are split with ncclCommSplit (collective over this group); the CPU side meets
  // in `store`, torch's key space for the new group. merge: a group of `size` ranks of several
  // groups through `store`. Both declared without `override` (see shrink).
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts);
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts, const int& rank, const int& size);

  // torch's shrink_group: a new group of this group's ranks but `ranksToExclude`, made by those
  // ranks alone (the excluded ones may be dead, and must not call it) over this group's store, in
  // a key space every member derives from this group's and the excluded ranks; no new store, no
  // relaunch. SHRINK_ABORT (1) aborts this group's pending work first. `optsOverride`: its timeout
  // replaces this group's. Declared without `override` (TorchCompat.hpp: torch releases without
  // shrink get a plain method).
  bool supportsShrinking() const { return true; }
  // After a failure, among the ranks still running: the group ranks that called this within
  // `timeout` (zero: the group's), the same list on every rank that gets one; ranks this rank's
  // links saw die are not waited for. A rank that arrives after the others settled raises.
  // Meets through the store (cpu/Survivors.cpp), so it works on a group whose links are closed.
  std::vector<int> survivors(std::chrono::milliseconds timeout);
  // The group ranks whose process this rank's links saw die.
  std::vector<int> vanishedRanks() const;

#if MYCCL_HAS_WINDOW
  // torch's one-sided windows on CPU tensors (src/cpu/Window.cpp): put, signal, wait_signal;
  // UNIFIED (map_remote_tensor is a view of the peer's tensor) between ranks of one host whose
  // windows are in registered shared memory (allocate_tensor), SEPARATE otherwise.
  bool supportsWindow() const override { return true; }
  c10::intrusive_ptr<c10d::Window> new_window(const std::optional<at::Tensor>& tensor = std::nullopt) override;
#endif

#if MYCCL_HAS_RECONFIGURE
  // torch's reconfigure regime (gloo's semantics): a handle that tells this process's instance of
  // the group from any other ("myccl:<rank in the default group>:<last uuid>:<nonce>"); and
  // reconfigure(), collective over the processes whose handles it names (a list: ranks by
  // position; a set: sorted), which makes the group theirs with a fresh uuid, through this
  // group's store, within the timeout or with an error naming who did not arrive. Members that
  // left or died are simply not named; new processes join with a group of their own made in the
  // same regime on the same store. Ops wait while it runs; it raises if one is still in flight
  // (Engines::replace). Sequence numbers restart.
  bool supportsReconfigure() const override { return true; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags = 0,
                                           const c10::intrusive_ptr<Options>& optsOverride = nullptr);
  // The engine an op sends a (valid) tensor, or tensors on `d`, to, by the one rule every op
  // routes with: true for the CUDA engine (the tensors the CUDA platform claims, Engine.hpp).
  // For callers that must choose between CPU-only and device paths as the backend does (the
  // Reducer, the Horovod layer's agreed all_reduce).
  bool onDevice(const at::Tensor& t) const { return engines_.onDevice(t); }
  bool onDevice(const at::Device& d) const { return engines_.onDevice(d); }
  // The CUDA engine's device seam (the CUDA platform's), the engine made on first use: the DDP
  // Reducer orders its gradient copies with streams and events through it.
  // Raises, as a CUDA op would, when this build has no CUDA engine.
  std::shared_ptr<cuda::Device> cudaDevice();

  // For c10d_ext: topology, build and transport details.
  Topology topology() const;
  const std::string& groupName() const { return group_; }
  std::chrono::milliseconds timeout() const { return timeout_.load(); }
  std::string describeLinks() const;
  bool usesSharedMemory() const;
  int rejectedConnections() const;
  // (op, algorithm, count, bytes, seconds) for every op run so far on CPU.
  std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> stats() const;
  void resetStats();
  // MYCCL_HIERARCHICAL=auto's figures and choice for CPU ops, by name (c10d_ext.link_model); empty
  // until measured.
  std::map<std::string, double> linkModel() const;
  std::shared_ptr<Recorder> recorder() const { return engines_.recorder(); }
  // A coalescing block that torch will never end (its body raised) or that a new block replaced:
  // its held ops fail with `why` and the group leaves coalescing mode. No-op outside a block.
  void abandonCoalescing(const std::string& why);

 private:
  // `op` is torch's name of the op, a string literal (it becomes OpInfo::name). Sequence.cpp.
  OpInfo info(c10d::OpType type, const char* op, std::chrono::milliseconds timeout, bool asyncOp = true,
              bool p2p = false);
  // What every Work gets on its way out: completion hooks, ephemeral timeouts, the coalescing
  // block it belongs to.
  c10::intrusive_ptr<c10d::Work> record(c10::intrusive_ptr<c10d::Work> w);
  Where where(const char* op) const { return Where{op, rank_}; }
  std::shared_ptr<Recorder> makeRecorder(int rank, int size) const;
  void setRanks(std::vector<int64_t> globalRanks);
  Engines::CudaMaker cudaMaker();
  friend class CoalescingGuard;

  const std::string group_;
  std::vector<int64_t> globalRanks_;    // changed only by reconfigure (setRanks)
  int rankStart_ = 0, rankStride_ = 1;  // globalRanks_ as torch's profiler metadata puts them
  std::string nonce_;                    // random: this process's instance of the group (handles)
  int64_t reconfigureUuid_ = -1;
  const Config cfg_;
  std::atomic<std::chrono::milliseconds> timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<AbortHooks> abortHooks_ = std::make_shared<AbortHooks>();
  std::shared_ptr<CompletionHooks> completionHooks_ = std::make_shared<CompletionHooks>();
  Engines engines_;
  std::atomic<uint64_t> collSeq_{0};
  std::atomic<uint64_t> p2pSeq_{0};
  std::atomic<uint64_t> monitoredSeq_{0};  // numbers monitored barriers, apart from the ops
  // Ephemeral timeout extensions: each lasts until the first Work created after it completes.
  struct Extension {
    std::chrono::milliseconds extra;
    c10::intrusive_ptr<c10d::Work> first;  // null until the next op is created
  };
  std::mutex extensionsMu_;
  std::vector<Extension> extensions_;
  std::atomic<bool> anyExtensions_{false};  // extensions_ is not empty (checked without the lock)

  std::mutex coalesceMu_;
  std::atomic<bool> coalescing_{false};  // written under coalesceMu_; read without it on every op
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
  std::atomic<bool> shutdown_{false};
  std::atomic<int> shrinks_{0};  // groups shrunk from this one (numbers their key spaces)
  std::atomic<int> survivorRounds_{0};  // survivors() calls (numbers their key spaces)
  uint64_t windows_ = 0;                 // new_window calls (number the windows' tags)
};

// On every op: an op that raises inside a coalescing block leaves the block with it. torch's
// coalescing manager never calls end_coalescing when its body raises, and a block left open
// would hold every later op of the group back for good (backend/Coalescing.cpp).
class CoalescingGuard {
 public:
  explicit CoalescingGuard(MycclBackend* b);
  ~CoalescingGuard();

 private:
  MycclBackend* b_;
  int unwinding_;
};

}  // namespace myccl
