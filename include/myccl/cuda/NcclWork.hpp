// The Work of a CUDA op: completion is an end event recorded on the stream that ran the op.
// wait() orders the caller's current stream after it (or, with blockingWait, blocks the host
// until it with a deadline); the CUDA-aware Future is completed as soon as the op is enqueued,
// so comm hooks chain on the GPU; the watchdog marks it done when the event has fired.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <memory>

#include "myccl/Work.hpp"

namespace c10::cuda {
struct CUDAEvent;
class CUDAStream;
}  // namespace c10::cuda

namespace myccl::cuda {

class NcclComm;
class Watchdog;

class NcclWork final : public MycclWork {
 public:
  NcclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, c10::Device device,
           std::weak_ptr<Watchdog> watchdog, bool blockingWait);
  ~NcclWork() override;

  // ---- engine side ----
  // Barrier semantics: wait() also blocks the host until the op finished on the GPU.
  void setHostSync() { hostSync_ = true; }
  // The op (or the coalesced batch holding it) is on `stream` and `end` was recorded after it.
  // Completes the Future, stream-ordered on `stream`. `captured`: issued during CUDA graph
  // capture (the event must never be queried, the watchdog never sees the Work).
  void launched(std::shared_ptr<c10::cuda::CUDAEvent> end, const c10::cuda::CUDAStream& stream,
                std::shared_ptr<NcclComm> comm, bool captured);
  bool isLaunched() const { return launched_.load(std::memory_order_acquire); }
  bool isDone() const { return done_.load(); }
  bool captured() const { return captured_; }
  const c10::Device& device() const { return device_; }
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  // Non-blocking: true when the GPU has finished the op (false before launch or if captured).
  // Throws c10::Error on a CUDA error.
  bool gpuFinished() const;
  // Marks success, but only if the communicator has no pending asynchronous error (then the
  // results cannot be trusted; the watchdog reports that error). Returns whether it did.
  bool succeed();
  void fail(const std::string& msg);

  // ---- c10d::Work ----
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  void abort() override;

 protected:
  void settleFuture(std::exception_ptr error) override;

 private:
  void blockCurrentStreamOnEnd();
  // Polls the end event until it fires, the Work fails, or `deadline`: past the op's own
  // deadline the group fails (as the watchdog would), past a caller's `limit` wait() throws.
  void waitOnHost(std::chrono::steady_clock::time_point deadline, bool opDeadline, std::chrono::milliseconds limit);
  void waitCompleted();
  void rethrowIfFailed();
  void reportCudaError(const std::exception& e);

  const c10::Device device_;
  const std::weak_ptr<Watchdog> watchdog_;
  const bool blockingWait_;
  bool hostSync_ = false;
  // Written once before launched_ is released.
  std::shared_ptr<c10::cuda::CUDAEvent> end_;
  std::shared_ptr<NcclComm> comm_;
  bool captured_ = false;
  std::chrono::steady_clock::time_point deadline_{};
  std::atomic<bool> launched_{false};
};

}  // namespace myccl::cuda
