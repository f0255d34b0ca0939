// NcclWork: completion by CUDA event. Stream-ordered wait by default, host-blocking wait with
// a deadline when asked (blockingWait, an explicit timeout, barrier); never any event query or
// host synchronisation while the caller's stream is being captured into a CUDA graph.
#include "myccl/cuda/NcclWork.hpp"

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <thread>

#include "myccl/Errors.hpp"
#include "myccl/cuda/CudaEvent.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/Watchdog.hpp"

namespace myccl::cuda {

namespace {

bool currentStreamCapturing(c10::DeviceIndex device) {
  return isCapturing(c10::cuda::getCurrentCUDAStream(device));
}

}  // namespace

NcclWork::NcclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, c10::Device device,
                   std::weak_ptr<Watchdog> watchdog, bool blockingWait)
    : MycclWork(std::move(info), std::move(inputs), std::move(outputs)),
      device_(device),
      watchdog_(std::move(watchdog)),
      blockingWait_(blockingWait) {
  // CUDA-aware: value() and then() callbacks wait for the op on the consumer's current stream
  // (through events the future records when completed), which is what DDP comm hooks rely on.
  future_ = c10::make_intrusive<c10::ivalue::Future>(tensorListType(),
                                                     std::vector<c10::Device>{device});
}

NcclWork::~NcclWork() = default;

void NcclWork::launched(std::shared_ptr<c10::cuda::CUDAEvent> end, const c10::cuda::CUDAStream& stream,
                        std::shared_ptr<NcclComm> comm, bool captured) {
  end_ = std::move(end);
  comm_ = std::move(comm);
  captured_ = captured;
  deadline_ = std::chrono::steady_clock::now() + info_.timeout;
  markStarted();
  launched_.store(true, std::memory_order_release);
  // Completed now, not when the GPU is done: the future's events are recorded on `stream`, so
  // whoever consumes the value is ordered after the op without blocking any host thread.
  c10::cuda::CUDAStreamGuard guard(stream);
  future_->markCompleted(c10::IValue(outputs_));
}

void NcclWork::settleFuture(std::exception_ptr error) {
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
  if (comm_) {
    ncclResult_t r = comm_->asyncError();
    if (r != ncclSuccess && r != ncclInProgress) return false;  // results unreliable; the watchdog reports it
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

void NcclWork::reportCudaError(const std::exception& e) {
  auto* ce = dynamic_cast<const c10::Error*>(&e);
  std::string why = info_.describe() + ": CUDA error while checking whether the op finished on " + device_.str() +
                    ": " + (ce ? ce->what_without_backtrace() : e.what());
  if (auto wd = watchdog_.lock()) {
    wd->fail(why, false, this);
  } else {
    fail("myccl: " + why);
  }
}

bool NcclWork::isCompleted() {
  if (!isDone() && isLaunched() && !captured_ && !currentStreamCapturing(device_.index())) {
    try {
      if (gpuFinished()) succeed();
    } catch (const std::exception& e) {
      reportCudaError(e);
    }
  }
  return MycclWork::isCompleted();
}

void NcclWork::blockCurrentStreamOnEnd() {
  end_->block(c10::cuda::getCurrentCUDAStream(device_.index()));
}

void NcclWork::waitOnHost(std::chrono::steady_clock::time_point deadline, bool opDeadline,
                          std::chrono::milliseconds limit) {
  int spins = 0;
  while (!isDone()) {
    bool finished = false;
    try {
      finished = gpuFinished();
    } catch (const std::exception& e) {
      reportCudaError(e);
      break;
    }
    // Finished with an NCCL error pending: not a success; the watchdog fails the group within a
    // tick (and the deadline below still bounds the wait).
    if (finished && succeed()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      if (!opDeadline) {
        throwDistError("myccl: " + info_.describe() + ": Timed out in wait() after " + std::to_string(limit.count()) +
                       " ms; the operation is still in progress");
      }
      // The op's own timeout: the same verdict the watchdog would reach, reached here first.
      std::string why = timeoutReason(info_, device_.index());
      if (auto wd = watchdog_.lock()) {
        wd->fail(why, true, this);
      } else {
        fail("myccl: " + why);
      }
      break;
    }
    if (++spins < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 2000 ? 50 : 1000));
    }
  }
}

bool NcclWork::wait(std::chrono::milliseconds timeout) {
  if (!isLaunched()) {
    rethrowIfFailed();
    MYCCL_CHECK(false, info_.describe(),
                ": wait() on an op that is not issued yet: it belongs to a coalescing block that has not ended; wait "
                "on the Work that end_coalescing returns");
  }
  rethrowIfFailed();
  const bool userTimeout = timeout != kNoTimeout;
  // Host blocking is impossible inside a capture (and the event is a graph node, not a fact).
  const bool capturing = captured_ || currentStreamCapturing(device_.index());
  if (!capturing && (blockingWait_ || hostSync_ || userTimeout)) {
    const auto deadline = userTimeout ? std::chrono::steady_clock::now() + timeout : deadline_;
    waitOnHost(deadline, !userTimeout, timeout);
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
    wd->fail(why, false, this);
  } else {
    fail("myccl: " + why);
  }
}

}  // namespace myccl::cuda
