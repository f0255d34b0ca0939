// The watchdog of one NCCL engine: a thread that polls the outstanding Works and the
// communicators. A finished Work is marked done (so isCompleted/exception are right for users
// who never wait); a Work past its timeout, or an asynchronous NCCL error, fails the whole
// group: every communicator is aborted, every outstanding Work fails with an error naming the
// op, and every later call raises. It also holds that failure state for the engine.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "myccl/Work.hpp"

namespace myccl::cuda {

class NcclComm;
class NcclWork;

// The one description of a timed-out op, whether the watchdog or a blocking wait() saw it.
std::string timeoutReason(const OpInfo& info, int device);

class Watchdog {
 public:
  Watchdog(int rank, std::string group);
  ~Watchdog();  // stops the thread

  void start();
  void stop();  // joins; outstanding Works stay as they are

  void addComm(std::shared_ptr<NcclComm> comm);
  // Works issued during CUDA graph capture are never tracked: their events belong to a graph.
  void track(c10::intrusive_ptr<NcclWork> work);

  // First failure wins and is what later calls report: aborts every communicator, then fails
  // `culprit` with "myccl: <why>" and every other outstanding Work with a message naming
  // itself and the failure. Safe from any thread, also from inside a Work's wait().
  void fail(const std::string& why, bool timedOut, NcclWork* culprit = nullptr);

  // Raises DistBackendError "myccl: <op>: the group is unusable after an earlier failure: ...".
  void throwIfFailed(const OpInfo& info) const;
  bool failed() const;
  bool timedOut() const;
  std::string failure() const;

  // Waits until no tracked Work is outstanding (each is bounded by its own timeout, which the
  // watchdog enforces) or the group failed. Used by a graceful shutdown.
  void drain();
  // Fails whatever is still tracked with `why` (after an abort or a failed shutdown).
  void failOutstanding(const std::string& why);

 private:
  void loop();
  void poll();

  const int rank_;
  const std::string group_;

  mutable std::mutex mu_;
  std::condition_variable cv_;      // wakes the thread (stop)
  std::condition_variable idleCv_;  // drain(): tracked_ became empty or the group failed
  std::vector<c10::intrusive_ptr<NcclWork>> tracked_;
  std::vector<std::shared_ptr<NcclComm>> comms_;
  std::string failure_;
  bool timedOut_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace myccl::cuda
