// The CPU engine of one group: an op queue and a progress thread that runs collectives in
// issue order, turning tensors into contiguous buffers and calling the algorithms. Point-to-
// point ops bypass the queue (they are posted to the transport at once and never block a
// collective). The first failed collective closes the transport, so peers fail fast too,
// and every later op on the group raises the original error instead of hanging.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "myccl/Config.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/Topology.hpp"
#include "myccl/Work.hpp"
#include "myccl/cpu/Parallel.hpp"
#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/transport/Shm.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

// Operation codes carried in collective tags (7 bits); distinct per collective so that ranks
// that disagree on which op they are in never match each other's messages.
enum class OpCode : uint8_t {
  Broadcast = 1, Allreduce, Reduce, Allgather, Gather, Scatter, ReduceScatter, Alltoall, Barrier,
  Fingerprint = 0x7e,  // MYCCL_DEBUG=DETAIL's cross-rank check before an op
};

// Counts, bytes and time per (op, algorithm). Shared with p2p completion callbacks, which
// may run after the engine is gone.
class Stats {
 public:
  struct Entry {
    std::string op, algo;
    uint64_t count = 0;
    uint64_t bytes = 0;
    double seconds = 0;
  };
  void add(const std::string& op, const std::string& algo, uint64_t bytes, double seconds);
  std::vector<Entry> snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

class CpuEngine {
 public:
  // `shm` is set when every rank of the group shares this host: collectives then go through
  // shared memory, point-to-point and liveness through `transport`.
  CpuEngine(std::shared_ptr<Transport> transport, std::shared_ptr<ShmGroup> shm, const Topology& topo,
            std::string group, const Config& cfg, std::shared_ptr<Recorder> recorder);
  ~CpuEngine();

  using WorkPtr = c10::intrusive_ptr<MycclWork>;

  // Every op returns at once with a Work the progress thread completes. Tensors are views
  // the caller has validated; non-contiguous ones are staged and written back.
  WorkPtr broadcast(OpInfo info, at::Tensor t, int root);
  WorkPtr allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red);
  WorkPtr reduce(OpInfo info, at::Tensor t, const Reduction& red, int root);
  // outputs[i][r] receives rank r's inputs[i]; block sizes may differ per rank.
  WorkPtr allgather(OpInfo info, std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs);
  WorkPtr gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root);
  WorkPtr scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root);
  // inputs[i][r] is this rank's contribution to rank r's outputs[i].
  // `userInputs`: the tensors the caller passed when `inputs` are views cut out of them (what
  // the profiler reports as the op's input shapes).
  WorkPtr reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs, std::vector<at::Tensor> outputs,
                        const Reduction& red, std::vector<at::Tensor> userInputs = {});
  // inputs[r] goes to rank r, outputs[r] comes from rank r.
  WorkPtr alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                   std::vector<at::Tensor> userInputs = {});
  WorkPtr barrier(OpInfo info);

  // Point-to-point: posted to the transport now, completed by it; never queued behind
  // collectives. wait() on them is bounded by the op timeout.
  WorkPtr send(OpInfo info, at::Tensor t, int peer, int tag);
  WorkPtr recv(OpInfo info, at::Tensor t, int peer, int tag);
  WorkPtr recvAny(OpInfo info, at::Tensor t, int tag);

  // Fails queued ops and closes the transport now.
  void abort(const std::string& why);
  // Lets queued ops finish (each within its own timeout), then closes.
  void shutdown();

  bool failed() const;
  bool timedOut() const;
  Transport& transport() { return *transport_; }
  bool usesSharedMemory() const { return shm_ != nullptr; }
  Stats& stats() { return *stats_; }
  // A CPU tensor of `numel` elements in registered shared memory (collectives on it skip the
  // staging copies); an ordinary tensor when shared memory is not in use or is exhausted.
  at::Tensor allocateTensor(int64_t numel, const at::TensorOptions& options);

 private:
  struct Op {
    WorkPtr work;
    OpCode code;
    std::function<void(CollCtx&)> body;
    uint64_t record = 0;  // flight recorder id
  };
  WorkPtr enqueue(WorkPtr w, OpCode code, std::function<void(CollCtx&)> body);
  void loop();
  void runOp(Op& op);
  const char* transportName() const;
  void checkFingerprint(CollCtx& ctx, const Op& op);
  void checkStrays(uint64_t seq);
  void failGroup(const std::string& why, bool timeout);
  std::string describeFailure(const Op& op, const std::exception& e, bool& timeout) const;
  void checkUsable(const OpInfo& info) const;

  std::shared_ptr<Transport> transport_;
  std::shared_ptr<ShmGroup> shm_;
  std::unique_ptr<Parallel> par_;
  size_t streamMinBytes_ = SIZE_MAX;  // MYCCL_STREAM_STORE_BYTES resolved (SIZE_MAX: never)
  std::chrono::nanoseconds p2pSpin_{0};  // MYCCL_SPIN_US resolved for point-to-point waits
  const Topology topo_;
  const int rank_;
  const int size_;
  const std::string group_;
  const Config cfg_;
  Scratch scratch_;
  std::shared_ptr<Stats> stats_ = std::make_shared<Stats>();
  std::shared_ptr<Recorder> recorder_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idleCv_;
  std::deque<Op> queue_;
  bool running_ = false;
  bool stop_ = false;
  std::string failure_;
  bool timedOut_ = false;
  std::thread thread_;
};

}  // namespace myccl::cpu
