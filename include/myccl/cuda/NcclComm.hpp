// One NCCL communicator (one group, one device). Communicators are nonblocking: no NCCL call
// can hang a thread, every wait for NCCL (creation, connection setup inside a collective,
// finalize) is a poll with a deadline, and the watchdog can abort from another thread.
// Compiled only with NCCL (MYCCL_WITH_NCCL).
#pragma once

#include <c10/core/Device.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

namespace myccl::cuda {

using Clock = std::chrono::steady_clock;

// "ncclRemoteError (remote process exited or there was a network error): <last error>"
std::string ncclErrorText(ncclResult_t r, ncclComm_t comm = nullptr);

class NcclComm {
 public:
  // Collective over the group: every rank calls it with the same id. Returns once the
  // communicator is ready; at `deadline` it aborts the half-made communicator and throws a
  // DistBackendError that starts with `where`.
  static std::shared_ptr<NcclComm> create(const ncclUniqueId& id, int rank, int size, c10::DeviceIndex device,
                                          const std::string& name, Clock::time_point deadline,
                                          const std::string& where);
  ~NcclComm();  // aborts a communicator that was neither finalized nor aborted (never waits on peers)

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  // Calls on the communicator hold this lock, so an abort from the watchdog never frees the
  // handle under a thread that is using it. The calls themselves never block (nonblocking comm).
  using Lock = std::unique_lock<std::timed_mutex>;
  // Throws a DistBackendError (starting with `where`) once the communicator is aborted.
  Lock lock(const std::string& where);
  ncclComm_t get() const { return comm_; }  // only with the lock held

  // Turns the result of a call into success or an exception. ncclInProgress (connection setup,
  // a group launching) is polled until done, releasing the lock in between; past `deadline`
  // it throws CommError(Timeout). Other results throw CommError(Local/PeerGone).
  void settle(Lock& lk, ncclResult_t r, Clock::time_point deadline, const std::string& where);

  // Asynchronous error state for the watchdog: ncclSuccess, ncclInProgress, or an error.
  // Skips (returns ncclSuccess) when another thread holds the communicator right now.
  ncclResult_t asyncError();
  std::string lastError();

  // Idempotent; safe from any thread. Running kernels of this communicator stop.
  void abort();
  // Graceful end: flush, wait for global quiescence until `deadline`, destroy. Falls back to
  // abort (and returns false) on error or timeout.
  bool finalize(Clock::time_point deadline);

  bool aborted() const { return dead_.load(); }
  c10::DeviceIndex device() const { return device_; }

 private:
  NcclComm(c10::DeviceIndex device, std::string name) : device_(device), name_(std::move(name)) {}
  void abortLocked();

  const c10::DeviceIndex device_;
  const std::string name_;  // NCCL keeps a pointer to the communicator name while it lives
  std::timed_mutex mu_;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> dead_{false};  // aborted or destroyed: the handle must not be used
};

}  // namespace myccl::cuda
