// NcclComm: creating communicators (blocking or nonblocking), polling InProgress against
// deadlines, abort from any thread, graceful finalize. Every NCCL call on a communicator happens
// under its lock, so abort (which frees the handle) can never race with a call in another thread.
#include "myccl/cuda/NcclComm.hpp"

#include <future>
#include <sstream>
#include <thread>

#include "myccl/Errors.hpp"

namespace myccl::cuda {

namespace {

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

CommErrorKind kindOf(NcclResult r) {
  return (r == NcclResult::RemoteError || r == NcclResult::SystemError) ? CommErrorKind::PeerGone
                                                                        : CommErrorKind::Local;
}

}  // namespace

std::string ncclErrorText(Nccl& nccl, NcclResult r, NcclCommHandle comm) {
  std::ostringstream os;
  os << ncclResultName(r) << " (" << nccl.errorString(r) << ")";
  const char* last = nccl.lastError(comm);
  if (last != nullptr && *last != '\0') os << ": " << last;
  return os.str();
}

NcclComm::NcclComm(Runtime rt, int device, std::string name, bool blocking)
    : rt_(std::move(rt)), device_(device), name_(std::move(name)), blocking_(blocking) {}

NcclComm::~NcclComm() {
  std::lock_guard<std::timed_mutex> g(mu_);
  abortLocked();
}

void NcclComm::init(const NcclUniqueId& id, int rank, int size, Clock::time_point deadline, const Described& where) {
  DeviceGuard guard(*rt_.device, device_);
  NcclCommConfig config;
  config.blocking = blocking_;
  config.name = name_.c_str();
  auto lk = lock(where);
  NcclResult r = rt_.nccl->commInitRank(&comm_, size, id, rank, config);
  std::ostringstream what;
  what << "creating the NCCL communicator '" << name_ << "' for cuda:" << device_ << " (rank " << rank << " of "
       << size << ")";
  finishCreation(lk, r, deadline, where, what.str());
  if (!blocking_) return;
  // A blocking creation returns a ready communicator, unless this thread was inside an NCCL
  // group: then NCCL only queues the creation until the group's end (and every later NCCL call
  // of this thread with it, so that ops would "complete" without running). NCCL's group depth
  // is per thread and shared by every NCCL user of the process: an open group here is one that
  // another library opened and never closed.
  int count = -1;
  NcclResult c = rt_.nccl->commCount(comm_, &count);
  if (c != NcclResult::Success || count != size) {
    abortLocked();
    throwDistError(where + ": " + what.str() + ": NCCL did not make it (" +
                   (c != NcclResult::Success ? "ncclCommCount: " + ncclErrorText(*rt_.nccl, c)
                                             : std::to_string(count) + " ranks") +
                   "): this thread is inside an NCCL group that something else in this process opened "
                   "(ncclGroupStart without its ncclGroupEnd), so NCCL defers every NCCL call of this thread. "
                   "torch's \"nccl\" backend leaves one open when its scatter or gather raises inside it (a "
                   "dtype NCCL lacks, such as int16); run such calls on another thread or avoid them");
  }
}

bool NcclComm::split(NcclComm& parent, int color, int key, Clock::time_point deadline, const Described& where) {
  DeviceGuard guard(*rt_.device, device_);
  NcclCommConfig config;
  config.blocking = blocking_;
  config.name = name_.c_str();
  auto plk = parent.lock(where);
  auto lk = lock(where);
  NcclResult r = rt_.nccl->commSplit(parent.get(), color < 0 ? -1 : color, key, &comm_, config);
  plk.unlock();
  finishCreation(lk, r, deadline, where, "splitting communicator '" + parent.name() + "' into '" + name_ + "'");
  return comm_ != nullptr;
}

void NcclComm::finishCreation(Lock& lk, NcclResult r, Clock::time_point deadline, const Described& where,
                              const std::string& what) {
  if (r != NcclResult::Success && r != NcclResult::InProgress) {
    std::string text = ncclErrorText(*rt_.nccl, r, comm_);
    abortLocked();
    throwDistError(where + ": " + what + " failed: " + text);
  }
  try {
    settle(lk, r, deadline, where);
  } catch (const CommError& e) {
    abortLocked();
    std::ostringstream os;
    os << where << ": " << what << " failed: " << e.what();
    if (e.kind() == CommErrorKind::Timeout) {
      os << "; every rank of the communicator must reach its first operation on it within the timeout";
    }
    throwDistError(os.str());
  }
  ready_ = true;
}

NcclComm::Lock NcclComm::lock(const Described& where) {
  Lock lk(mu_);
  if (dead_) {
    throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator '" + name_ + "' for cuda:" +
                                               std::to_string(device_) + " has been aborted");
  }
  return lk;
}

void NcclComm::settle(Lock& lk, NcclResult r, Clock::time_point deadline, const Described& where) {
  Backoff backoff;
  while (r == NcclResult::InProgress) {
    // NCCL forbids any other call on the communicator (and kernels on its streams) until it
    // leaves InProgress; the lock is only dropped so that the watchdog can look or abort.
    if (Clock::now() > deadline) {
      throw CommError(CommErrorKind::Timeout, where + ": NCCL was still setting up (connecting to peers) when the "
                                                      "timeout expired; a peer has probably not reached this op");
    }
    lk.unlock();
    backoff.pause();
    lk.lock();
    if (dead_) throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator was aborted meanwhile");
    NcclResult st = NcclResult::Success;
    NcclResult q = rt_.nccl->commGetAsyncError(comm_, &st);
    r = (q != NcclResult::Success) ? q : st;
  }
  if (r != NcclResult::Success) {
    throw CommError(kindOf(r), where + ": NCCL error " + ncclErrorText(*rt_.nccl, r, comm_));
  }
}

NcclResult NcclComm::asyncError() {
  std::unique_lock<std::timed_mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock() || dead_ || comm_ == nullptr || !ready_) return NcclResult::Success;
  NcclResult st = NcclResult::Success;
  NcclResult q = rt_.nccl->commGetAsyncError(comm_, &st);
  return q != NcclResult::Success ? q : st;
}

void NcclComm::abort() {
  if (dead_) return;
  // A thread inside an NCCL call holds the lock; with blocking communicators that call may be
  // stuck on a peer (a launch behind a hung kernel, connection setup). NCCL allows aborting from
  // another thread precisely to unblock it, so after a short wait abort without the lock.
  std::unique_lock<std::timed_mutex> lk(mu_, std::defer_lock);
  (void)lk.try_lock_for(std::chrono::seconds(2));
  abortLocked();
}

void NcclComm::abortLocked() {
  if (dead_.exchange(true)) return;  // exactly one abort, even without the lock
  NcclCommHandle c = comm_;
  if (c == nullptr) return;
  try {
    DeviceGuard guard(*rt_.device, device_);
    (void)rt_.nccl->commAbort(c);
  } catch (...) {
    // CUDA already torn down (process exit): nothing left to release.
  }
}

bool NcclComm::finalize(Clock::time_point deadline) {
  Lock lk(mu_);
  if (dead_ || comm_ == nullptr) return false;
  DeviceGuard guard(*rt_.device, device_);
  if (blocking_) {
    // A blocking finalize returns when NCCL is done, which a peer that is gone can make never:
    // it runs aside, and past the deadline this thread aborts the communicator (which NCCL
    // allows from another thread to unblock it).
    auto done = std::make_shared<std::promise<NcclResult>>();
    auto result = done->get_future();
    std::thread aside([rt = rt_, c = comm_, d = device_, done] {
      rt.device->set(d);
      done->set_value(rt.nccl->commFinalize(c));
    });
    if (result.wait_until(deadline) == std::future_status::ready && result.get() == NcclResult::Success) {
      aside.join();
      dead_ = true;
      (void)rt_.nccl->commDestroy(comm_);
      return true;
    }
    abortLocked();
    aside.detach();  // returns once the abort has stopped it; nothing it touches goes away
    return false;
  }
  try {
    NcclResult r = rt_.nccl->commFinalize(comm_);
    if (r != NcclResult::Success && r != NcclResult::InProgress) {
      throw CommError(kindOf(r), ncclErrorText(*rt_.nccl, r, comm_));
    }
    settle(lk, r, deadline, std::string("finalize"));
  } catch (const CommError&) {
    abortLocked();
    return false;
  }
  dead_ = true;
  (void)rt_.nccl->commDestroy(comm_);
  return true;
}

}  // namespace myccl::cuda
