// The Work of a CUDA op: completion is an end event recorded on the stream that ran the op.
// On CUDA, wait() orders the caller's current stream after it (or, with blockingWait, blocks the
// host until it with a deadline) and the CUDA-aware Future is completed as soon as the op is
// enqueued, so comm hooks chain on the GPU. Where the device is not stream-ordered for the
// caller (the test double) wait() blocks the host and the Future completes when the op is done.
// The watchdog marks it done when the event has fired.
#pragma once

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <memory>

#include "myccl/Recorder.hpp"
#include "myccl/Work.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

class NcclComm;
class Watchdog;

class NcclWork final : public MycclWork {
 public:
  NcclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, c10::Device device,
           std::shared_ptr<Device> dev, std::weak_ptr<Watchdog> watchdog, bool blockingWait);
  ~NcclWork() override;

  // ---- engine side ----
  // Barrier semantics: wait() also blocks the host until the op finished on the device.
  void setHostSync() { hostSync_ = true; }
  // Its flight-recorder entry (queued now; started at launch, ended when done).
  void setRecord(std::shared_ptr<Recorder> recorder, uint64_t id) {
    recorder_ = std::move(recorder);
    record_ = id;
  }
  // Held back in an open coalescing block: issued (and covered) by the block's own Work.
  void setInBlock() { inBlock_ = true; }
  // The op (or the coalesced batch holding it) is on `stream`; `end` was recorded after it
  // (and `start`, when timing, before it). `captured`: issued during CUDA graph capture (the
  // event must never be queried, the watchdog never sees the Work).
  void launched(std::shared_ptr<Event> start, std::shared_ptr<Event> end, const Stream& stream,
                std::shared_ptr<NcclComm> comm, bool captured);
  bool isLaunched() const { return launched_.load(std::memory_order_acquire); }
  bool isDone() const { return done_.load(); }
  bool captured() const { return captured_; }
  const c10::Device& device() const { return device_; }
  // Its timeout counts from its launch, or from its posting while it waits for a partner.
  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(deadline_.load()));
  }
  // Non-blocking: true when the device has finished the op (false before launch or if
  // captured). Throws c10::Error on a device error. The calling thread must have selected a
  // device (the watchdog has; a user's thread has).
  bool gpuFinished() const;
  // Marks success, but only if the communicator has no pending asynchronous error (then the
  // results cannot be trusted; the watchdog reports that error). Returns whether it did.
  bool succeed();
  void fail(const std::string& msg);

  bool onDevice() const override { return true; }

  // ---- c10d::Work ----
  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  void abort() override;
  float getDuration() const override;

 protected:
  void settleFuture(std::exception_ptr error) override;

 private:
  void blockCurrentStreamOnEnd();
  // Polls the end event until it fires, the Work fails, or `deadline`. `ownTimeout`: past the
  // op's own deadline this waiter declares the timeout itself (blocking wait: the error is
  // raised here and nothing tears the process down); otherwise the watchdog decides and this
  // only waits for its verdict. Past a caller's `limit` wait() throws without failing the group.
  void waitOnHost(std::chrono::steady_clock::time_point deadline, bool userLimit, std::chrono::milliseconds limit);
  void setDeadline(std::chrono::steady_clock::time_point t) { deadline_ = t.time_since_epoch().count(); }
  void waitCompleted();
  void rethrowIfFailed();
  void reportDeviceError(const std::exception& e);
  bool streamOrdered() const { return streamOrdered_; }

  const c10::Device device_;
  const std::shared_ptr<Device> dev_;
  const std::weak_ptr<Watchdog> watchdog_;
  const bool blockingWait_;
  const bool streamOrdered_;
  bool hostSync_ = false;
  std::atomic<bool> inBlock_{false};
  // Written once before launched_ is released.
  std::shared_ptr<Event> start_, end_;
  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<Recorder> recorder_;
  uint64_t record_ = 0;
  bool captured_ = false;
  std::atomic<std::chrono::steady_clock::rep> deadline_{0};
  std::atomic<bool> launched_{false};
};

}  // namespace myccl::cuda
