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

#include "myccl/Config.hpp"
#include "myccl/Reduction.hpp"
#include "myccl/Work.hpp"

namespace myccl::cuda {

class NcclEngine {
 public:
  using WorkPtr = c10::intrusive_ptr<MycclWork>;

  NcclEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string group, const Config& cfg);
  ~NcclEngine();

  // Every op: tensors are CUDA tensors on one device, already validated by the backend.
  // asyncOp=false runs on the caller's current stream (no extra stream hop).
  WorkPtr broadcast(OpInfo info, at::Tensor t, int root, bool asyncOp);
  WorkPtr allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red, bool asyncOp);
  WorkPtr reduce(OpInfo info, at::Tensor t, const Reduction& red, int root, bool asyncOp);
  WorkPtr allgather(OpInfo info, std::vector<at::Tensor> inputs, std::vector<std::vector<at::Tensor>> outputs,
                    bool asyncOp);
  WorkPtr gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root, bool asyncOp);
  WorkPtr scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root, bool asyncOp);
  WorkPtr reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs, std::vector<at::Tensor> outputs,
                        const Reduction& red, bool asyncOp);
  WorkPtr alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, bool asyncOp);
  WorkPtr barrier(OpInfo info, at::Device device);
  WorkPtr send(OpInfo info, at::Tensor t, int peer);
  WorkPtr recv(OpInfo info, at::Tensor t, int peer);

  // ncclGroupStart/End around everything issued in between (batch_isend_irecv).
  void startCoalescing();
  WorkPtr endCoalescing(OpInfo info);

  void eagerConnect(at::Device device);
  void setTimeout(std::chrono::milliseconds timeout);
  void abort(const std::string& why);
  void shutdown();
  bool failed() const;
  bool timedOut() const;

  static std::string version();  // of the libnccl loaded in this process

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace myccl::cuda
