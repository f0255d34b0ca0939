// The gradient Reducer behind c10d_ext.DistributedDataParallel: flat bucket buffers, autograd
// hooks that mark gradients ready, one asynchronous allreduce (or comm hook) per full bucket in
// bucket order, and at the end of backward: wait, unflatten, write the averaged gradients.
// It talks to any c10d::ProcessGroup through its public API, so it runs on myccl, gloo and nccl.
// When myccl carries CPU parameters on its CPU engine the gradient average rides on the sum
// (ReduceOp.PREMUL_SUM, which that engine folds into its reduction); other backends get a plain
// allreduce of pre-scaled buckets. Buckets the backend sends
// to a device engine (MycclBackend::onDevice; CUDA tensors elsewhere) take the device path:
// scaled on the way in, plain allreduce or comm hook, stream-ordered, no host synchronisation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "myccl/TorchCompat.hpp"
#include "myccl/cuda/Runtime.hpp"
#include "myccl/reducer/Buckets.hpp"
#include "myccl/reducer/CommHook.hpp"

namespace myccl {
class MycclBackend;
}

namespace myccl::reducer {

class DeviceStreams;

struct ReducerOptions {
  BucketCaps caps;
  bool findUnusedParameters = false;
  bool gradientAsBucketView = false;
  bool staticGraph = false;
  size_t statsIterations = 10;  // how many synced iterations bucketStats() keeps
};

// Times are CLOCK_REALTIME microseconds (Recorder::nowUs), the timeline's clock.
struct BucketTimes {
  size_t index = 0;
  int64_t nbytes = 0;
  size_t numParams = 0;
  bool sparse = false;
  bool backendMemory = false;  // the buffer came from Backend::allocateTensor
  bool fusedAverage = false;   // averaged inside the reduction (PREMUL_SUM on myccl's CPU engine)
  bool onDevice = false;       // reduced by a device engine (stream-ordered; no CPU-only path)
  size_t streamWaits = 0;      // device: other streams that copied into it and the launch waited for
  size_t gradCopies = 0;       // gradients copied into the bucket this iteration (the rest already lived there)
  int64_t readyUs = 0;         // its last gradient arrived
  int64_t launchUs = 0;        // its allreduce / comm hook was started
  // Gradients of later buckets still to arrive when it was launched (-1: launched at the end of
  // backward, for unused parameters): above 0, its reduction overlapped backward.
  int64_t gradsPending = -1;
  // Written by the future's callback, which may run after the waiter has woken up.
  std::shared_ptr<std::atomic<int64_t>> doneUs;
};

struct IterationStats {
  uint64_t iteration = 0;        // 1-based count of synchronised backwards
  int64_t backwardStartUs = 0;   // first gradient hook (or DDP's output sink)
  int64_t backwardEndUs = 0;     // autograd finished; the Reducer starts waiting
  int64_t finishedUs = 0;        // every gradient written back
  std::vector<BucketTimes> buckets;
};

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  // `params`: the parameters to synchronise, in registration order; `names` name them in errors.
  // Installs a post hook on each parameter's gradient accumulator.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<bool> expectSparse,
          c10::intrusive_ptr<c10d::ProcessGroup> pg, ReducerOptions opts);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // ---- per iteration, from DDP's forward (only when gradients are synchronised) ----
  // Raises if the previous synchronised backward marked gradients ready but never finished.
  void prepareForForward();
  // Collective (one broadcast from rank 0) once, after the first synchronised backward:
  // re-buckets in the order gradients became ready. True if the buckets changed.
  bool rebuildBucketsIfDue();
  // Arms the hooks. `outputs`: the forward's outputs (walked for unused parameters when
  // find_unused_parameters and not static_graph). `sinkAttached`: DDP routed the outputs
  // through its sink, whose backward calls backwardStarted().
  void prepareForBackward(const std::vector<at::Tensor>& outputs, bool sinkAttached);
  // From the sink's backward, i.e. on the outermost graph task of this backward: queues the
  // end-of-backward callback there (reentrant checkpointing runs nested graph tasks whose
  // end is not the end of backward).
  void backwardStarted();
  // join(): the allreduce counting the ranks still training this iteration. Unless
  // `divideByInitialWorldSize`, gradients are averaged over that count.
  void setJoinFuture(c10::intrusive_ptr<c10::ivalue::Future> activeRanks, bool divideByInitialWorldSize);

  // ---- a rank that has joined (ran out of inputs) mirrors the others' collectives ----
  // Runs every bucket's reduction (hook included) on zeros, then the unused-parameter
  // allreduce if the others run one; counts as a synchronised iteration.
  void shadowBackward();
  // Benchmarks: turn the fused average (fusedAverage) off to measure what it saves. Every rank
  // must set the same (ranks that differ get an error from the reduction, not wrong sums).
  void setFusedAverage(bool on);
  // Benchmarks and tests: without gradient_as_bucket_view, keep .grad tensors in memory of
  // their own (torch's layout: a copy into the bucket and back every iteration) instead of
  // slot aliases (gradInSlot). Turning it off gives every aliased gradient its own copy.
  void setGradAlias(bool on);

  // Before the first backward only; once.
  void registerCommHook(std::shared_ptr<CommHook> hook);
  // Called after each synchronised backward while the timeline is recording (Recorder::tracing).
  void setIterationObserver(std::function<void(const IterationStats&)> observer);

  std::vector<IterationStats> stats() const;
  BucketPlan plan() const;
  std::vector<at::Tensor> bucketBuffers() const;  // dense buckets' flat buffers (undefined for sparse)
  uint64_t syncedIterations() const;

 private:
  struct Bucket {
    std::vector<int64_t> vars;  // parameter indices
    std::vector<int64_t> offsets, lengths;
    bool sparse = false;
    at::Tensor buffer;                  // flat, dense buckets only
    std::vector<at::Tensor> views;      // per parameter, into `buffer`, laid out like the parameter
    at::Tensor sparseGrad;              // sparse bucket: this iteration's gradient
    size_t pending = 0;                 // gradients not yet ready this iteration
    c10::intrusive_ptr<c10::ivalue::Future> future;
    BucketTimes times;
    // Device path: the streams gradients were copied in on this iteration, the first one first,
    // each other one with an event recorded after its latest copy (events are kept for reuse).
    bool onDevice = false;
    struct StreamMark {
      cuda::Stream stream;
      std::unique_ptr<cuda::Event> event;
    };
    std::vector<StreamMark> marks;
    size_t marksUsed = 0;
  };
  struct Locator {
    size_t bucket = 0, slot = 0;
  };

  void autogradHook(size_t index, bool gotGradient);
  void finalizeBackward();
  void queueFinalize();

  void initializeBuckets(const BucketPlan& plan);
  at::Tensor allocateBuffer(int64_t numel, const at::TensorOptions& options, bool onDevice, bool& fromBackend);
  // As the backend routes `t`: to a device engine (no CPU-only path may touch it) or the CPU.
  bool routedToDevice(const at::Tensor& t) const;
  // Device path: the current stream just copied a gradient into `bucket` (noteStream); before
  // its launch, the launch's stream waits for every other stream that did (orderLaunch, which
  // returns how many).
  void noteStream(Bucket& bucket);
  size_t orderLaunch(Bucket& bucket);
  std::vector<at::Tensor> viewsInto(const at::Tensor& flat, const Bucket& bucket) const;
  void markReady(size_t index);
  void markDense(Bucket& bucket, size_t slot, size_t index);
  void markSparse(Bucket& bucket, size_t index);
  void markUnusedOnce();
  void launchReadyBuckets();
  c10::intrusive_ptr<c10::ivalue::Future> runReduction(size_t index, const at::Tensor& buffer);
  void launchUsedMap(const std::vector<int32_t>& used);
  void writeBack(Bucket& bucket);
  bool globallyUnused(size_t index);
  int64_t divFactor();
  bool fusedAverage(const Bucket& bucket);
  bool gradInSlot(const Bucket& bucket) const;
  // A slot alias as .grad of parameter `index` gets memory of its own (same value).
  void unalias(size_t index);
  void waitAllQuietly();
  void endIteration();
  std::string describe(const std::vector<size_t>& indices) const;
  std::string where() const;

  bool dynamicFindUnused() const { return opts_.findUnusedParameters && !opts_.staticGraph; }
  bool staticFirstIteration() const { return opts_.staticGraph && synced_ == 0; }
  bool usedMapNeeded() const { return dynamicFindUnused() || staticFirstIteration(); }

  const std::vector<at::Tensor> params_;
  const std::vector<std::string> names_;
  const std::vector<bool> sparse_;
  const c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  const ReducerOptions opts_;
  const int rank_, worldSize_;
  // The group's backend for the parameters' device type when it is myccl: it says which engine
  // a bucket goes to, and CPU-engine buckets are averaged inside the reduction.
  c10::intrusive_ptr<MycclBackend> myccl_;
  // Streams and events of the parameters' device; null when no bucket takes the device path.
  std::unique_ptr<DeviceStreams> streams_;

  // The accumulators hold our hooks; the parameters only reference them weakly.
  std::vector<compat::NodePtr> accumulators_;  // the parameters' gradient accumulators
  std::vector<uintptr_t> hookKeys_;

  mutable std::mutex mu_;
  std::vector<Bucket> buckets_;
  std::vector<Locator> where_;
  std::shared_ptr<CommHook> hook_;
  std::function<void(const IterationStats&)> observer_;

  // ---- this iteration ----
  bool expectHooks_ = false;     // armed by prepareForBackward, disarmed at the end of backward
  bool finalizeQueued_ = false;
  bool sinkAttached_ = false;
  bool unusedMarked_ = false;
  bool anyReady_ = false;
  size_t nextBucket_ = 0;        // buckets are launched strictly in order
  std::vector<char> ready_, gotGradient_;
  std::vector<int64_t> unused_;  // marked ready without a hook (graph walk / static graph)
  int64_t divFactor_ = 0;        // 0: not yet decided this iteration
  c10::intrusive_ptr<c10::ivalue::Future> joinFuture_;
  bool joinStaticWorld_ = true;
  bool shadowing_ = false;       // a joined rank mirroring the others' reductions (with zeros)
  bool allowFused_ = true;       // setFusedAverage
  bool allowAlias_ = true;       // setGradAlias
  IterationStats current_;

  // ---- unused-parameter bookkeeping ----
  std::vector<int32_t> localUsed_;         // set by hooks that saw a defined .grad
  at::Tensor usedDev_;                     // the allreduced copy
  c10::intrusive_ptr<c10d::Work> usedWork_;
  bool usedReduced_ = false;
  std::vector<int32_t> reducedUsed_;
  std::vector<char> globalUsed_;           // static graph: fixed after the first iteration

  // ---- static graph: hook firings per parameter in the first iteration ----
  std::vector<int> hookCount_, remaining_;

  // ---- rebuild ----
  bool recordingOrder_ = true;
  bool rebuilt_ = false;
  std::vector<int64_t> readyOrder_;

  uint64_t synced_ = 0;
  std::deque<IterationStats> history_;
};

// Construction-time check: every rank has the same number of parameters with the same
// shapes, strides, dtypes and layouts. Collective; raises on every rank, naming the first
// parameter that differs and what each rank has.
void verifyParamsAcrossRanks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::vector<at::Tensor>& params,
                             const std::vector<std::string>& names);

// Broadcasts `tensors` from `root` in flat chunks of at most `chunkBytes` per dtype and device
// (model states at construction, buffers before each forward, the final model after join).
void broadcastCoalesced(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::vector<at::Tensor>& tensors,
                        int64_t chunkBytes, int root);

}  // namespace myccl::reducer
