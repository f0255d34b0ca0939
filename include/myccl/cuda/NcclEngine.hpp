// The CUDA engine of one group: NCCL communicators (the group's, one per device, created lazily
// or eagerly, and a two-rank one per peer pair for point-to-point), a stream per communicator
// that waits on the caller's stream, event-completed Works, and a watchdog that turns a stuck op
// into an error (and by default, as torch does, into a process taken down). It reaches CUDA and
// NCCL only through its Runtime (Runtime.hpp), so it builds everywhere and runs under the test
// double; the real Runtime exists when the build has NCCL.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "myccl/AbortHooks.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

class NcclEngine final : public Engine {
 public:
  // `keyPrefix`: the group incarnation's key space in the store (every rank of this incarnation
  // has the same, whatever earlier incarnations left behind). `timeout` bounds communicator
  // creation by eagerConnect() and the graceful shutdown; zero means the store's timeout. (Ops
  // carry their own timeout in OpInfo.) `hooks` run before the group aborts on a failure.
  NcclEngine(c10::intrusive_ptr<c10d::Store> store, std::string keyPrefix, int rank, int size, std::string group,
             const Config& cfg, std::chrono::milliseconds timeout, Runtime runtime,
             std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder);
  ~NcclEngine() override;

  // Every op: tensors are CUDA tensors on one device, already validated by the backend.
  // info.asyncOp=false runs on the caller's current stream (no extra stream hop).
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
  // Straight on the flat tensors when they are contiguous (the lists otherwise).
  WorkPtr alltoallBase(OpInfo info, at::Tensor input, at::Tensor output, std::vector<int64_t> inRows,
                       std::vector<int64_t> outRows) override;
  WorkPtr allgatherBase(OpInfo info, at::Tensor input, at::Tensor output) override;
  WorkPtr reduceScatterBase(OpInfo info, at::Tensor input, at::Tensor output, const Reduction& red) override;
  // wait() on a barrier's Work also blocks the host until every rank arrived (within the timeout).
  WorkPtr barrier(OpInfo info, at::Device device) override;
  // On the two-rank communicator of the pair, with its own stream, so that unbatched rings and
  // exchanges between some of the ranks never wait for the others. NCCL has no tags: messages
  // between two ranks match in the order they were posted. To self: a device copy once both
  // the send and the receive (same tag) are posted.
  WorkPtr send(OpInfo info, at::Tensor t, int peer, int tag) override;
  WorkPtr recv(OpInfo info, at::Tensor t, int peer, int tag) override;

  // Ops issued in between are held and issued at endCoalescing inside one ncclGroupStart/End
  // (batch_isend_irecv); they must all use one device. endCoalescing's Work covers all of them.
  void startCoalescing() override;
  WorkPtr endCoalescing(const OpInfo& info) override;

  void eagerConnect(at::Device device) override;
  // ncclCommSplit of every group communicator, in the order they were made (the same on every rank).
  std::shared_ptr<SplitParts> splitParts(int color, int key, std::chrono::milliseconds timeout) override;
  void adoptSplit(std::shared_ptr<SplitParts> parts) override;
  int lastDevice() const override;
  // MYCCL_DEBUG=DETAIL: called with every collective before it is issued (or held in a block);
  // raises when the ranks disagree about the op, so a desync is an error, not a hung kernel.
  void setAgreement(std::function<void(const OpInfo&)> agree) override;
  std::shared_ptr<Device> deviceSeam() const override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort(const std::string& why) override;
  void shutdown() override;
  bool failed() const override;
  bool timedOut() const override;
  size_t inFlight() const override;

  const Runtime& runtime() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace myccl::cuda
