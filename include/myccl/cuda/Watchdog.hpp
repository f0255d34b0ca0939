// The watchdog of one CUDA engine: a thread that polls the outstanding Works and the
// communicators. A finished Work is marked done (so isCompleted/exception are right for users
// who never wait); a Work past its timeout, or an asynchronous NCCL error, fails the whole
// group: every outstanding Work fails with an error naming the op and every later call raises.
// What else a failure does follows torch's async error handling (TORCH_NCCL_ASYNC_ERROR_HANDLING
// semantics, MYCCL_ASYNC_ERROR_HANDLING): by default the process is taken down, because results
// the device never wrote would otherwise flow into the optimizer and checkpoints.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "myccl/AbortHooks.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/Work.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

class NcclComm;
class NcclWork;

// The one description of a timed-out op, whether the watchdog or a blocking wait() saw it.
std::string timeoutReason(const OpInfo& info, int device);

// torch's ErrorHandlingMode, same numbers and meaning.
enum class ErrorHandling : int {
  NoHandling = 0,   // fail the Works, leave the communicators alone
  TearDown = 1,     // abort the communicators, then take the process down
  CleanUpOnly = 2,  // abort the communicators, fail the Works, keep the process
  SkipCleanUp = 3,  // take the process down without aborting (an abort can itself hang)
};

struct WatchdogPolicy {
  ErrorHandling handling = ErrorHandling::SkipCleanUp;
  bool blockingWait = false;  // errors surface in wait(); nothing is taken down (torch's rule)
  std::shared_ptr<AbortHooks> hooks;
  // Bounds the communicators' abort when the process is taken down after it.
  std::chrono::milliseconds abortBound{10000};
  // The group's flight recorder, dumped into `dumpDir` on the first failure.
  std::shared_ptr<Recorder> recorder;
  std::string dumpDir;
};

class Watchdog {
 public:
  Watchdog(int rank, std::string group, std::shared_ptr<Device> device, WatchdogPolicy policy);
  ~Watchdog();  // stops the thread

  // Starts the thread (once): it selects `device` before any other device call, so it never
  // makes a context on a device the engine does not use.
  void start(int device);
  void stop();  // joins; outstanding Works stay as they are
  bool running() const { return running_.load(); }

  void addComm(std::shared_ptr<NcclComm> comm);
  // Works issued during CUDA graph capture are never tracked: their events belong to a graph.
  void track(c10::intrusive_ptr<NcclWork> work);

  // First failure wins and is what later calls report: runs the abort hooks, aborts every
  // communicator (unless the policy says not to), then fails `culprit` with "myccl: <why>" and
  // every other outstanding Work with a message naming itself and the failure. Safe from any
  // thread, also from inside a Work's wait(). `userAbort`: the user asked (Work.abort), so no
  // hooks and nothing is taken down.
  void fail(const std::string& why, bool timedOut, NcclWork* culprit = nullptr, bool userAbort = false);

  // Raises DistBackendError "myccl: <op>: the group is unusable after an earlier failure: ...".
  void throwIfFailed(const OpInfo& info) const;
  bool failed() const;
  bool timedOut() const;
  std::string failure() const;
  // Tracked Works not completed yet (a reconfigure refuses to swap engines under them).
  size_t outstanding() const;

  // Waits until no tracked Work is outstanding (each is bounded by its own timeout, which the
  // watchdog enforces) or the group failed. Used by a graceful shutdown.
  void drain();
  // Fails whatever is still tracked with `why` (after an abort or a failed shutdown).
  void failOutstanding(const std::string& why);

 private:
  void loop(int device);
  void poll();
  // A failure the watchdog itself found (timeout, asynchronous error, device error).
  void failFromWatchdog(const std::string& why, bool timedOut, NcclWork* culprit);
  [[noreturn]] void takeDown(const std::string& why);
  // Dumps the flight recorder; returns " [flight recorder: <path>]" or "".
  std::string dump(const std::string& why) const;

  const int rank_;
  const std::string group_;
  const std::shared_ptr<Device> device_;
  const WatchdogPolicy policy_;

  mutable std::mutex mu_;
  std::condition_variable cv_;      // wakes the thread (stop)
  std::condition_variable idleCv_;  // drain(): tracked_ became empty or the group failed
  std::vector<c10::intrusive_ptr<NcclWork>> tracked_;
  std::vector<std::shared_ptr<NcclComm>> comms_;
  std::string failure_;
  std::atomic<bool> failed_{false};  // !failure_.empty(), readable without the lock
  bool timedOut_ = false;
  bool stop_ = false;
  std::atomic<bool> running_{false};
  std::thread thread_;
};

}  // namespace myccl::cuda
