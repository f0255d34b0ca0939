// NcclWork: completion by device event. Stream-ordered wait by default, host-blocking wait
// with a deadline when asked (blockingWait, an explicit timeout, barrier) or when the caller is
// not stream-ordered (the double); never any event query or host synchronisation while the
// caller's stream is being captured into a CUDA graph.
#include "myccl/cuda/NcclWork.hpp"

#include <ATen/core/ivalue.h>

#include <thread>

#include "ErrorText.hpp"
#include "myccl/Errors.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/Watchdog.hpp"

namespace myccl::cuda {

NcclWork::NcclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, c10::Device device,
                   std::shared_ptr<Device> dev, std::weak_ptr<Watchdog> watchdog, bool blockingWait)
    // CUDA-aware where the device is stream-ordered: value() and then() callbacks wait for the op
    // on the consumer's current stream (through events the future records when completed), which
    // is what DDP comm hooks rely on.
    : MycclWork(std::move(info), std::move(inputs), std::move(outputs),
                dev->streamOrdered()
                    ? c10::make_intrusive<c10::ivalue::Future>(tensorListType(), std::vector<c10::Device>{device})
                    : c10::intrusive_ptr<c10::ivalue::Future>()),
      device_(device),
      dev_(std::move(dev)),
      watchdog_(std::move(watchdog)),
      blockingWait_(blockingWait),
      streamOrdered_(dev_->streamOrdered()) {
  setDeadline(std::chrono::steady_clock::now() + info_.timeout);
}

NcclWork::~NcclWork() = default;

void NcclWork::launched(std::shared_ptr<Event> start, std::shared_ptr<Event> end, const Stream& stream,
                        std::shared_ptr<NcclComm> comm, bool captured) {
  start_ = std::move(start);
  end_ = std::move(end);
  comm_ = std::move(comm);
  captured_ = captured;
  setDeadline(std::chrono::steady_clock::now() + info_.timeout);
  markStarted();
  if (recorder_) recorder_->started(record_);
  launched_.store(true, std::memory_order_release);
  if (streamOrdered_) {
    // Completed now, not when the device is done: the future's events are recorded on `stream`,
    // so whoever consumes the value is ordered after the op without blocking any host thread.
    const Stream prev = dev_->currentStream(device_.index());
    dev_->setCurrentStream(stream);
    try {
      future_->markCompleted(c10::IValue(outputs_));
    } catch (...) {
      dev_->setCurrentStream(prev);
      throw;
    }
    dev_->setCurrentStream(prev);
  }
}

void NcclWork::settleFuture(std::exception_ptr error) {
  if (recorder_) {
    std::string why;
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& e) {
        why = e.what_without_backtrace();
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    recorder_->ended(record_, "nccl", "nccl", 0, why);
  }
  if (!streamOrdered_) {
    MycclWork::settleFuture(error);
    return;
  }
  // Normally completed by launched(); only a Work that never launched (a coalesced op whose
  // batch failed to start) still has an open future.
  if (error && !future_->completed()) future_->setError(error);
}

bool NcclWork::gpuFinished() const {
  if (!isLaunched() || captured_) return false;
  return end_->query();
}

bool NcclWork::succeed() {
  if (isDone()) return true;
  // ncclCommAbort ends the communicator's kernels, so the end event of an op that never ran to
  // completion fires too, while the watchdog is still inside the abort and has not yet failed
  // the group's Works: a finished event is no success once the group failed or its
  // communicator was aborted (the watchdog fails this Work next).
  if (auto wd = watchdog_.lock(); wd && wd->failed()) return false;
  if (comm_ && comm_->aborted()) return false;
  if (comm_) {
    NcclResult r = comm_->asyncError();
    if (r != NcclResult::Success && r != NcclResult::InProgress) return false;  // the watchdog reports it
  }
  markDone();
  return true;
}

void NcclWork::fail(const std::string& msg) {
  markDone(makeDistError(msg));
}

void NcclWork::waitCompleted() {
  // done_ flips before finish() publishes the outcome; wait for the outcome.
  std::unique_lock<std::mutex> lk(mutex_);
  cv_.wait(lk, [&] { return completed_; });
}

void NcclWork::rethrowIfFailed() {
  if (!isDone()) return;
  waitCompleted();
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    e = exception_;
  }
  if (e) std::rethrow_exception(e);
}

void NcclWork::reportDeviceError(const std::exception& e) {
  std::string why = info_.describe() + ": device error while checking whether the op finished on " + device_.str() +
                    ": " + errorText(e);
  if (auto wd = watchdog_.lock()) {
    wd->fail(why, false, this);
  } else {
    fail("myccl: " + why);
  }
}

bool NcclWork::isCompleted() {
  if (!isDone() && isLaunched() && !captured_ && !dev_->isCapturing(dev_->currentStream(device_.index()))) {
    try {
      if (gpuFinished()) succeed();
    } catch (const std::exception& e) {
      reportDeviceError(e);
    }
  }
  return MycclWork::isCompleted();
}

void NcclWork::blockCurrentStreamOnEnd() {
  end_->block(dev_->currentStream(device_.index()));
}

void NcclWork::waitOnHost(std::chrono::steady_clock::time_point deadline, bool userLimit,
                          std::chrono::milliseconds limit) {
  auto wd = watchdog_.lock();
  // Who declares the op's own timeout: this waiter under blocking wait (torch's semantics: the
  // error surfaces here, in the caller's thread) or when no watchdog runs; otherwise the watchdog,
  // whose verdict (an error here, or the process taken down) this waits for.
  const bool ownTimeout = blockingWait_ || !wd || !wd->running();
  int spins = 0;
  while (!isDone()) {
    bool finished = false;
    try {
      finished = gpuFinished();
    } catch (const std::exception& e) {
      reportDeviceError(e);
      break;
    }
    // Finished with an NCCL error pending: not a success; the watchdog fails the group within a
    // tick (and the deadline below still bounds the wait).
    if (finished && succeed()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      if (userLimit) {
        throwDistError("myccl: " + info_.describe() + ": Timed out in wait() after " + std::to_string(limit.count()) +
                       " ms; the operation is still in progress");
      }
      if (ownTimeout) {
        std::string why = timeoutReason(info_, device_.index());
        if (wd) {
          wd->fail(why, true, this);
        } else {
          fail("myccl: " + why);
        }
        break;
      }
      // The watchdog is about to decide (it polls every few ms); keep waiting for it.
    }
    if (++spins < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 2000 ? 50 : 1000));
    }
  }
}

bool NcclWork::wait(std::chrono::milliseconds timeout) {
  rethrowIfFailed();
  const bool userTimeout = timeout != kNoTimeout;
  if (!isLaunched()) {
    // An op inside an open coalescing block is issued with the block: as with torch's NCCL
    // backend, waiting on it there returns at once, and the block's own Work is what covers it.
    if (inBlock_) return true;
    // Posted but waiting for its partner (a send to self): wait for both to have run.
    waitOnHost(userTimeout ? std::chrono::steady_clock::now() + timeout : deadline(), userTimeout, timeout);
    rethrowIfFailed();
  }
  // Host blocking is impossible inside a capture (and the event is a graph node, not a fact).
  const bool capturing = captured_ || dev_->isCapturing(dev_->currentStream(device_.index()));
  if (!capturing && (!streamOrdered_ || blockingWait_ || hostSync_ || userTimeout)) {
    const auto deadline = userTimeout ? std::chrono::steady_clock::now() + timeout : this->deadline();
    waitOnHost(deadline, userTimeout, timeout);
    rethrowIfFailed();
  }
  // Everything the caller enqueues from now on runs after the op.
  blockCurrentStreamOnEnd();
  return true;
}

void NcclWork::synchronize() {
  if (isLaunched()) blockCurrentStreamOnEnd();
}

void NcclWork::abort() {
  // The op's kernels may wait forever for peers: only aborting the communicator stops them.
  std::string why = info_.describe() + ": aborted by Work.abort()";
  if (auto wd = watchdog_.lock()) {
    wd->fail(why, false, this, /*userAbort=*/true);
  } else {
    fail("myccl: " + why);
  }
}

float NcclWork::getDuration() const {
  // With timing events (MYCCL_ENABLE_TIMING), the op's time on the device.
  if (start_ && end_ && isDone() && !captured_) return start_->elapsedMs(*end_);
  return MycclWork::getDuration();
}

}  // namespace myccl::cuda
