// The CUDA engine of one group: NCCL communicators (one per device, created lazily or
// eagerly), a dedicated NCCL stream per device that waits on the caller's stream, CUDA-event
// Works, and a watchdog that turns a stuck op into an aborted communicator and an error.
// Compiled only when the build has NCCL (MYCCL_WITH_NCCL).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <string>
#include <vector>

#include "myccl/Engine.hpp"

namespace myccl::cuda {

class NcclEngine final : public Engine {
 public:
  // `timeout` bounds communicator creation by eagerConnect() and the graceful shutdown; zero
  // means the store's timeout. (Ops carry their own timeout in OpInfo.)
  NcclEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string group, const Config& cfg,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
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
  // wait() on a barrier's Work also blocks the host until every rank arrived (within the timeout).
  WorkPtr barrier(OpInfo info, at::Device device) override;
  // NCCL has no tags: messages between two ranks match in the order they were posted.
  WorkPtr send(OpInfo info, at::Tensor t, int peer, int tag) override;
  WorkPtr recv(OpInfo info, at::Tensor t, int peer, int tag) override;

  // Ops issued in between are held and issued at endCoalescing inside one ncclGroupStart/End
  // (batch_isend_irecv); they must all use one device. endCoalescing's Work covers all of them.
  void startCoalescing() override;
  WorkPtr endCoalescing(const OpInfo& info) override;

  void eagerConnect(at::Device device) override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort(const std::string& why) override;
  void shutdown() override;
  bool failed() const override;
  bool timedOut() const override;

  static std::string version();  // of the libnccl loaded in this process

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace myccl::cuda
