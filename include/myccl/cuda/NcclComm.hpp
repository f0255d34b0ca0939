// One NCCL communicator: its creation (from an id or by splitting a parent), polling NCCL's
// in-progress state against deadlines, abort from any thread, graceful finalize. Blocking
// communicators by default (no host polling per op); nonblocking ones when asked, so that a
// creation or a launch stuck on a peer can always be abandoned.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "myccl/Work.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

using Clock = std::chrono::steady_clock;

// "ncclRemoteError (remote process exited or there was a network error): <last error>"
std::string ncclErrorText(Nccl& nccl, NcclResult r, NcclCommHandle comm = nullptr);

// Sets the calling thread's device for a scope. Restoring goes through Device::restore, which,
// like torch's guards, never makes a context on a device the thread did not use.
class DeviceGuard {
 public:
  DeviceGuard(Device& d, int index) : d_(d), prev_(d.current()), index_(index) {
    if (prev_ != index_) d_.set(index_);
  }
  ~DeviceGuard() {
    if (prev_ != index_) d_.restore(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  Device& d_;
  const int prev_, index_;
};

class NcclComm {
 public:
  // Made empty; init() or split() makes it a communicator. Registered with the engine before
  // either starts, so abort() reaches a communicator still being created.
  NcclComm(Runtime rt, int device, std::string name, bool blocking);
  ~NcclComm();  // aborts a communicator that was neither finalized nor aborted (never waits on peers)

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Collective over `size` ranks passing the same id. Returns once the communicator is ready;
  // at `deadline` (nonblocking only: a blocking init cannot be interrupted) or on abort it gives
  // up and throws a DistBackendError that starts with `where`.
  void init(const NcclUniqueId& id, int rank, int size, Clock::time_point deadline, const Described& where);
  // Collective over the parent's ranks (ncclCommSplit). Returns false for color < 0 (no
  // communicator; this one stays empty).
  bool split(NcclComm& parent, int color, int key, Clock::time_point deadline, const Described& where);

  // Calls on the communicator hold this lock, so an abort from the watchdog never frees the
  // handle under a thread that is using it, and no two threads ever use it at once.
  using Lock = std::unique_lock<std::timed_mutex>;
  // Throws CommError(Aborted) once the communicator is aborted.
  Lock lock(const Described& where);
  NcclCommHandle get() const { return comm_; }  // only with the lock held
  Nccl& nccl() { return *rt_.nccl; }

  // Turns the result of a call into success or an exception. InProgress (nonblocking: connection
  // setup, a group launching) is polled until done, releasing the lock in between; past
  // `deadline` it throws CommError(Timeout). Other results throw CommError(Local/PeerGone).
  void settle(Lock& lk, NcclResult r, Clock::time_point deadline, const Described& where);

  // Asynchronous error state for the watchdog: Success, InProgress, or an error. Skips (returns
  // Success) when another thread holds the communicator right now.
  NcclResult asyncError();

  // Idempotent; safe from any thread. Running kernels of this communicator stop. The calling
  // thread must have selected a device (any: the call switches to the communicator's).
  void abort();
  // Graceful end: flush, wait for global quiescence until `deadline`, destroy. Falls back to
  // abort (and returns false) on error or timeout.
  bool finalize(Clock::time_point deadline);

  bool aborted() const { return dead_.load(); }
  bool ready() const { return ready_.load(); }
  bool blocking() const { return blocking_; }
  int device() const { return device_; }
  const std::string& name() const { return name_; }

 private:
  void abortLocked();
  void finishCreation(Lock& lk, NcclResult r, Clock::time_point deadline, const Described& where,
                      const std::string& what);

  Runtime rt_;
  const int device_;
  const std::string name_;  // NCCL keeps a pointer to the communicator name while it lives
  const bool blocking_;
  std::timed_mutex mu_;
  NcclCommHandle comm_ = nullptr;
  std::atomic<bool> ready_{false};
  std::atomic<bool> dead_{false};  // aborted or destroyed: the handle must not be used
};

}  // namespace myccl::cuda
