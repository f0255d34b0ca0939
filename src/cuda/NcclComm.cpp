// NcclComm: creation of nonblocking communicators, polling ncclInProgress against deadlines,
// abort from any thread, graceful finalize. Every NCCL call on a communicator happens under its
// lock, so abort (which frees the handle) can never race with a call in another thread.
#include "myccl/cuda/NcclComm.hpp"

#include <c10/cuda/CUDAGuard.h>

#include <sstream>
#include <thread>

#include "myccl/Errors.hpp"

namespace myccl::cuda {

namespace {

const char* resultName(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult";
  }
}

// Polls fast at first (connection setup usually takes micro- to milliseconds), then backs off
// so a long wait does not burn a core.
class Backoff {
 public:
  void pause() {
    if (n_ < 64) {
      ++n_;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(n_ < 1000 ? 50 : 1000));
      ++n_;
    }
  }

 private:
  int n_ = 0;
};

CommErrorKind kindOf(ncclResult_t r) {
  return (r == ncclRemoteError || r == ncclSystemError) ? CommErrorKind::PeerGone : CommErrorKind::Local;
}

}  // namespace

std::string ncclErrorText(ncclResult_t r, ncclComm_t comm) {
  std::ostringstream os;
  os << resultName(r) << " (" << ncclGetErrorString(r) << ")";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') os << ": " << last;
  return os.str();
}

std::shared_ptr<NcclComm> NcclComm::create(const ncclUniqueId& id, int rank, int size, c10::DeviceIndex device,
                                           const std::string& name, Clock::time_point deadline,
                                           const std::string& where) {
  std::shared_ptr<NcclComm> c(new NcclComm(device, name));
  c10::cuda::CUDAGuard guard(device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Nonblocking: creation returns at once and is polled below, so a rank that never arrives
  // turns into a timeout error instead of a thread stuck inside NCCL forever.
  config.blocking = 0;
  config.commName = c->name_.c_str();
  auto lk = c->lock(where);
  ncclResult_t r = ncclCommInitRankConfig(&c->comm_, size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    // Nothing usable was created (or a half-made communicator that abort cleans up).
    std::string text = ncclErrorText(r, c->comm_);
    c->abortLocked();
    throwDistError(where + ": creating the NCCL communicator for cuda:" + std::to_string(device) + " failed: " + text);
  }
  try {
    c->settle(lk, r, deadline, where);
  } catch (const CommError& e) {
    c->abortLocked();
    std::ostringstream os;
    os << where << ": creating the NCCL communicator for cuda:" << device << " (rank " << rank << " of " << size
       << ") failed: " << e.what();
    if (e.kind() == CommErrorKind::Timeout) {
      os << "; every rank of the group must reach its first CUDA operation on this group (or eager_connect) "
            "within the timeout";
    }
    throwDistError(os.str());
  }
  return c;
}

NcclComm::~NcclComm() {
  std::lock_guard<std::timed_mutex> g(mu_);
  abortLocked();
}

NcclComm::Lock NcclComm::lock(const std::string& where) {
  Lock lk(mu_);
  if (dead_) {
    throw CommError(CommErrorKind::Aborted,
                    where + ": the NCCL communicator for cuda:" + std::to_string(device_) + " has been aborted");
  }
  return lk;
}

void NcclComm::settle(Lock& lk, ncclResult_t r, Clock::time_point deadline, const std::string& where) {
  Backoff backoff;
  while (r == ncclInProgress) {
    // NCCL forbids any other call on the communicator (and kernels on its streams) until it
    // leaves ncclInProgress; the lock is only dropped so the watchdog can look or abort.
    if (Clock::now() > deadline) {
      throw CommError(CommErrorKind::Timeout, where + ": NCCL was still setting up (connecting to peers) when the "
                                                      "timeout expired; a peer has probably not reached this op");
    }
    lk.unlock();
    backoff.pause();
    lk.lock();
    if (dead_) throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator was aborted meanwhile");
    ncclResult_t st = ncclSuccess;
    ncclResult_t q = ncclCommGetAsyncError(comm_, &st);
    r = (q != ncclSuccess) ? q : st;
  }
  if (r != ncclSuccess) throw CommError(kindOf(r), where + ": NCCL error " + ncclErrorText(r, comm_));
}

ncclResult_t NcclComm::asyncError() {
  std::unique_lock<std::timed_mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || dead_ || comm_ == nullptr) return ncclSuccess;
  ncclResult_t st = ncclSuccess;
  ncclResult_t q = ncclCommGetAsyncError(comm_, &st);
  return q != ncclSuccess ? q : st;
}

std::string NcclComm::lastError() {
  std::unique_lock<std::timed_mutex> lk(mu_, std::try_to_lock);
  const char* s = ncclGetLastError(lk.owns_lock() && !dead_ ? comm_ : nullptr);
  return s ? std::string(s) : std::string();
}

void NcclComm::abort() {
  if (dead_) return;
  // A thread inside a (nonblocking, hence short) NCCL call holds the lock only briefly; one
  // stuck anyway (e.g. a kernel launch on a full queue behind a hung kernel) must not keep the
  // watchdog from aborting: NCCL allows ncclCommAbort from another thread to unblock it.
  std::unique_lock<std::timed_mutex> lk(mu_, std::defer_lock);
  (void)lk.try_lock_for(std::chrono::seconds(10));
  abortLocked();
}

void NcclComm::abortLocked() {
  if (dead_.exchange(true)) return;  // exactly one abort, even without the lock
  ncclComm_t c = comm_;
  comm_ = nullptr;
  if (c == nullptr) return;
  try {
    c10::cuda::CUDAGuard guard(device_);
    (void)ncclCommAbort(c);
  } catch (...) {
    // CUDA already torn down (process exit): nothing left to release.
  }
}

bool NcclComm::finalize(Clock::time_point deadline) {
  Lock lk(mu_);
  if (dead_ || comm_ == nullptr) return false;
  c10::cuda::CUDAGuard guard(device_);
  try {
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r != ncclSuccess && r != ncclInProgress) throw CommError(kindOf(r), ncclErrorText(r, comm_));
    settle(lk, r, deadline, "finalize");
  } catch (const CommError&) {
    abortLocked();
    return false;
  }
  dead_ = true;
  ncclComm_t c = comm_;
  comm_ = nullptr;
  (void)ncclCommDestroy(c);
  return true;
}

}  // namespace myccl::cuda
