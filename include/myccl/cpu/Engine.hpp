// The CPU engine of one group: an op queue and a progress thread that runs collectives in
// issue order, turning tensors into contiguous buffers and calling the algorithms. Point-to-
// point ops bypass the queue (they are posted to the transport at once and never block a
// collective). The first failed collective closes the transport, so peers fail fast too,
// and every later op on the group raises the original error instead of hanging.
// Its parts: Engine.cpp (queue, thread, failure), Collectives.cpp and PointToPoint.cpp (tensors
// to buffers, per op), Diagnostics.cpp (desync checks, failure text), Memory.cpp (registered and
// shared tensors), Bootstrap.cpp and Survivors.cpp (meeting through the store).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "myccl/AbortHooks.hpp"
#include "myccl/Config.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/Topology.hpp"
#include "myccl/Work.hpp"
#include "myccl/cpu/Bootstrap.hpp"
#include "myccl/cpu/Extension.hpp"
#include "myccl/cpu/Stats.hpp"
#include "myccl/cpu/algorithms/LinkModel.hpp"
#include "myccl/cpu/algorithms/Tags.hpp"

namespace myccl::cpu {

class Transport;
class ShmGroup;
class Parallel;
class Scratch;
struct CollCtx;

class CpuEngine final : public Engine {
 public:
  // Collective over the group: bootstraps its links (Bootstrap.hpp) in `keyPrefix` (empty: a fresh
  // incarnation's), then starts the op thread.
  CpuEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::chrono::milliseconds timeout,
            std::string group, const Config& cfg, std::shared_ptr<Recorder> recorder,
            const std::string& keyPrefix = "");
  // Collective over the group, on links made beforehand (splitGroupLinks: a group split from another).
  CpuEngine(c10::intrusive_ptr<c10d::Store> store, GroupLinks links, std::string group, const Config& cfg,
            std::shared_ptr<Recorder> recorder);
  ~CpuEngine() override;

  // What a split of this group reuses: its links, which it lends on a fresh channel, and its
  // topology. Empty (no links) when the group uses another group's links or has lent every channel
  // (or MYCCL_SPLIT_LINKS=0); the split then makes links of its own. Collective over the group (it
  // counts channels).
  SplitSource splitSource();

  WorkPtr broadcast(OpInfo info, at::Tensor t, int root) override;
  WorkPtr allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red) override;
  WorkPtr reduce(OpInfo info, at::Tensor t, const Reduction& red, int root) override;
  WorkPtr allgather(OpInfo info, std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs) override;
  WorkPtr gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root) override;
  WorkPtr scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root) override;
  WorkPtr reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs, std::vector<at::Tensor> outputs,
                        const Reduction& red, std::vector<at::Tensor> userInputs = {}) override;
  WorkPtr alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                   std::vector<at::Tensor> userInputs = {}) override;
  WorkPtr barrier(OpInfo info, at::Device device = at::kCPU) override;
  // Sum of sparse COO tensors: every rank's (indices, values) gathered, then coalesced into `t`
  // (the same op on every rank; an engine op like any other, async when asked).
  WorkPtr allreduceSparse(OpInfo info, at::Tensor t);
  // The extension point (Extension.hpp): `op` runs as one of this group's ops; `inputs` and
  // `outputs` are the op's tensors for its Work and record, kept alive until it finished.
  WorkPtr runExtension(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, ExtensionOp op);

  WorkPtr send(OpInfo info, at::Tensor t, int peer, int tag) override;
  WorkPtr recv(OpInfo info, at::Tensor t, int peer, int tag) override;
  WorkPtr recvAny(OpInfo info, at::Tensor t, int tag);
  // Blocking, on the caller's thread, with gloo's semantics and words: every rank reports to
  // rank 0, which names the ranks that did not arrive within info.timeout (the first one, or all
  // of them with waitAllRanks), then releases them. `serial` numbers the calls (MonitoredBarrier.cpp).
  void monitoredBarrier(const OpInfo& info, uint64_t serial, bool waitAllRanks);
  // MYCCL_DEBUG=DETAIL for ops another engine runs (CUDA): the same cross-rank fingerprint
  // check, over this group's links, before that engine issues the op. Blocks; raises (and fails
  // this group, as a CPU op's mismatch does) when the ranks called different ops.
  void agree(OpInfo info);
  // Run before the group aborts after a failed op (Backend::registerAbortHook).
  void setAbortHooks(std::shared_ptr<AbortHooks> hooks) { abortHooks_ = std::move(hooks); }

  void abort(const std::string& why) override;
  void shutdown() override;
  bool failed() const override;
  bool timedOut() const override;
  size_t inFlight() const override;

  const Topology& topology() const { return topo_; }
  // This incarnation of the group's key space in the store (the same on every rank).
  const std::string& keyPrefix() const { return keyPrefix_; }
  Transport& transport() { return *transport_; }
  // "rank 1: tcp 127.0.0.1:4242" per peer, one a line.
  std::string describeLinks() const;
  // Connections refused during setup because they did not present the group's secret.
  int rejectedConnections() const;
  // Ranks whose process this rank saw die (Transport::vanishedPeers).
  std::vector<int> vanishedRanks() const;
  bool usesSharedMemory() const { return shm_ != nullptr; }
  // This host's ranks' shared memory (null: none), for windows that map peers' registered memory.
  ShmGroup* sharedMemory() const { return shm_.get(); }
  Stats& stats() { return *stats_; }
  // MYCCL_HIERARCHICAL=auto's figures and choice (measured = false until the group's first op
  // with a two-level version).
  LinkModel linkModel() const;
  at::Tensor allocateTensor(int64_t numel, const at::TensorOptions& options);
  // Collective: see cpu::sharedTensor (Bootstrap.hpp).
  at::Tensor sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype, int owner,
                          std::chrono::milliseconds timeout, const std::string& where);

 private:
  // Closes this group's links, orderly: links lent to split groups close with the last of them.
  void closeLinks(const std::string& reason);

  struct Op {
    WorkPtr work;
    OpCode code;
    std::function<void(CollCtx&)> body;
    uint64_t record = 0;        // flight recorder id
    bool fingerprinted = true;  // MYCCL_DEBUG=DETAIL checks it (ExtensionOp::fingerprinted)
  };
  WorkPtr enqueue(WorkPtr w, OpCode code, std::function<void(CollCtx&)> body, bool fingerprinted = true);
  template <class Post>
  WorkPtr receive(OpInfo info, const at::Tensor& t, Post&& post);  // recv and recvAny (PointToPoint.cpp)
  void loop();
  void runOp(Op& op);
  const char* transportName() const;
  void checkFingerprint(CollCtx& ctx, const Op& op);
  std::vector<std::pair<int, uint64_t>> unmatched() const;
  void checkStrays(uint64_t seq);
  void failGroup(const std::string& why, bool timeout);
  std::string describeFailure(const Op& op, const std::exception& e, bool& timeout) const;
  void checkUsable(const OpInfo& info) const;
  // Point-to-point requests posted and not yet complete (inFlight()).
  std::shared_ptr<std::atomic<int64_t>> p2pInFlight_ = std::make_shared<std::atomic<int64_t>>(0);

  c10::intrusive_ptr<c10d::Store> store_;
  const std::string keyPrefix_;
  // One byte per rank for monitored barriers' messages; declared before transport_ so that it
  // outlives every request posted into it.
  std::vector<char> barrierBytes_;
  std::atomic<uint64_t> sharedCount_{0};
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<SharedLinks> shared_;  // transport_ lent to split groups; null on a channel
  std::shared_ptr<ShmGroup> shm_;
  std::unique_ptr<Parallel> par_;
  size_t streamMinBytes_ = SIZE_MAX;  // MYCCL_STREAM_STORE_BYTES resolved (SIZE_MAX: never)
  std::chrono::nanoseconds p2pSpin_{0};  // MYCCL_SPIN_US resolved for point-to-point waits
  const Topology topo_;
  const int rank_;
  const int size_;
  const std::string group_;
  const Config cfg_;
  std::unique_ptr<Scratch> scratch_;
  std::shared_ptr<Stats> stats_ = std::make_shared<Stats>();
  std::shared_ptr<Recorder> recorder_;
  std::shared_ptr<AbortHooks> abortHooks_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idleCv_;
  std::deque<Op> queue_;
  bool running_ = false;
  WorkPtr runningWork_;  // the op running_ says runs, until the runner is done with it
  bool stop_ = false;
  std::string failure_;
  bool timedOut_ = false;
  LevelChoice levels_;  // asked by the algorithms as they choose (Select.cpp)
  std::thread thread_;
};

}  // namespace myccl::cpu
