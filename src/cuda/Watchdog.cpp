// Watchdog: polls outstanding CUDA Works and communicators every few milliseconds, completes
// finished Works, and turns a timeout or an asynchronous NCCL error into a failed group, and
// by default (torch's async error handling) into a process that is taken down.
#include "myccl/cuda/Watchdog.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <sstream>

#include "ErrorText.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/Threads.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclWork.hpp"

namespace myccl::cuda {

namespace {
// Short enough that a finished op is seen promptly by isCompleted-less users, long enough to
// cost nothing measurable (one event query per outstanding op per tick).
constexpr auto kPollInterval = std::chrono::milliseconds(10);
}  // namespace

std::string timeoutReason(const OpInfo& info, int device) {
  std::ostringstream os;
  os << info.describe() << ": Timed out after " << info.timeout.count() << " ms: the op did not finish on cuda:"
     << device << ". A peer has probably not reached this op (it may be stuck, dead, or calling a different op)";
  return os.str();
}

Watchdog::Watchdog(int rank, std::string group, std::shared_ptr<Device> device, WatchdogPolicy policy)
    : rank_(rank), group_(std::move(group)), device_(std::move(device)), policy_(std::move(policy)) {}

Watchdog::~Watchdog() {
  stop();
}

void Watchdog::start(int device) {
  std::lock_guard<std::mutex> lk(mu_);
  if (thread_.joinable() || stop_) return;
  running_ = true;
  thread_ = std::thread([this, device] { loop(device); });
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  joinOrDetach(thread_);
  running_ = false;
}

void Watchdog::addComm(std::shared_ptr<NcclComm> comm) {
  std::lock_guard<std::mutex> lk(mu_);
  comms_.push_back(std::move(comm));
}

void Watchdog::track(c10::intrusive_ptr<NcclWork> work) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) {
      tracked_.push_back(std::move(work));
      return;
    }
    failure = failure_;
  }
  // The group failed while this op was being issued: its kernels were aborted with the rest.
  work->fail("myccl: " + work->info().describe() + ": not completed: the group failed: " + failure);
}

void Watchdog::loop(int device) {
  // The device first: any device call on a thread that selected none makes a context on device
  // 0 (half a GiB there for every rank) and fails on GPUs in exclusive-process mode.
  device_->set(device);
  // A global-mode CUDA graph capture in another thread forbids "unsafe" calls such as event
  // queries process-wide, and one such call invalidates the capture. Relaxed mode exempts this
  // thread; it never touches captured work anyway.
  device_->relaxCaptureMode();
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, kPollInterval, [&] { return stop_; });
    if (stop_) break;
    lk.unlock();
    try {
      poll();
    } catch (const std::exception& e) {
      failFromWatchdog("watchdog error on rank " + std::to_string(rank_) + ", group '" + group_ + "': " + errorText(e),
                       false, nullptr);
    }
    lk.lock();
  }
}

void Watchdog::poll() {
  std::vector<std::shared_ptr<NcclComm>> comms;
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.empty()) return;
    comms = comms_;
    works = tracked_;
  }
  for (auto& c : comms) {
    NcclResult r = c->asyncError();
    if (r != NcclResult::Success && r != NcclResult::InProgress) {
      std::ostringstream os;
      os << "NCCL reported an asynchronous error on communicator '" << c->name() << "' (cuda:" << c->device()
         << ", rank " << rank_ << ", group '" << group_ << "'): " << ncclErrorText(c->nccl(), r)
         << "; outstanding ops cannot complete";
      failFromWatchdog(os.str(), false, nullptr);
      return;
    }
  }
  const auto now = std::chrono::steady_clock::now();
  std::vector<NcclWork*> finished;
  for (auto& w : works) {
    if (w->isDone()) {
      finished.push_back(w.get());
      continue;
    }
    bool gpuDone = false;
    try {
      DeviceGuard guard(*device_, w->device().index());
      gpuDone = w->gpuFinished();
    } catch (const std::exception& e) {
      failFromWatchdog(w->info().describe() + ": device error while checking whether the op finished: " + errorText(e),
                       false, w.get());
      return;
    }
    if (gpuDone) {
      if (w->succeed()) finished.push_back(w.get());
      // else: the communicator has an error; the next tick reports it for the whole group.
    } else if (now > w->deadline()) {
      failFromWatchdog(timeoutReason(w->info(), w->device().index()), true, w.get());
      return;
    }
  }
  if (finished.empty()) return;
  std::sort(finished.begin(), finished.end());  // many ops in flight: no quadratic pass under the lock
  std::lock_guard<std::mutex> lk(mu_);
  tracked_.erase(std::remove_if(tracked_.begin(), tracked_.end(),
                                [&](const c10::intrusive_ptr<NcclWork>& w) {
                                  return std::binary_search(finished.begin(), finished.end(), w.get());
                                }),
                 tracked_.end());
  if (tracked_.empty()) idleCv_.notify_all();
}

std::string Watchdog::dump(const std::string& why) const {
  if (!policy_.recorder) return {};
  const std::string path = policy_.recorder->dumpTo(policy_.dumpDir, why);
  return path.empty() ? std::string() : " [flight recorder: " + path + "]";
}

void Watchdog::failFromWatchdog(const std::string& why, bool timedOut, NcclWork* culprit) {
  const bool takeDownProcess = !policy_.blockingWait && (policy_.handling == ErrorHandling::TearDown ||
                                                         policy_.handling == ErrorHandling::SkipCleanUp);
  if (!takeDownProcess) {
    fail(why, timedOut, culprit);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.empty()) return;  // someone else failed the group first, and reported it
    failure_ = why;
    timedOut_ = timedOut;
    failed_.store(true, std::memory_order_release);
  }
  if (policy_.hooks) policy_.hooks->run(why);
  takeDown(why + dump(why));
}

void Watchdog::takeDown(const std::string& why) {
  std::ostringstream os;
  os << "myccl: [Rank " << rank_ << "] watchdog of group '" << group_ << "': " << why
     << ". To avoid data inconsistency, we are taking the entire process down (MYCCL_ASYNC_ERROR_HANDLING="
     << static_cast<int>(policy_.handling)
     << "; 2 keeps the process and raises the error from the group's ops instead).\n";
  const std::string msg = os.str();
  // Straight to stderr: the process ends in a moment, and the Python logger may need the GIL.
  std::fputs(msg.c_str(), stderr);
  std::fflush(stderr);
  if (policy_.handling == ErrorHandling::TearDown) {
    std::vector<std::shared_ptr<NcclComm>> comms;
    {
      std::lock_guard<std::mutex> lk(mu_);
      comms = comms_;
    }
    // An abort can itself hang (a driver stuck on a dead peer): bounded, on a thread of its own.
    auto done = std::make_shared<std::promise<void>>();
    auto fut = done->get_future();
    auto dev = device_;
    int index = comms.empty() ? 0 : comms.front()->device();
    std::thread([comms, done, dev, index] {
      dev->set(index);
      for (auto& c : comms) c->abort();
      done->set_value();
    }).detach();
    if (fut.wait_for(policy_.abortBound) != std::future_status::ready) {
      std::fputs("myccl: aborting the NCCL communicators did not finish in time; exiting without it\n", stderr);
    }
  }
  std::abort();
}

void Watchdog::fail(const std::string& whyGiven, bool timedOut, NcclWork* culprit, bool userAbort) {
  std::string why = whyGiven;
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  std::vector<std::shared_ptr<NcclComm>> comms;
  std::string first;
  bool firstFailure = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) {
      failure_ = why;
      timedOut_ = timedOut;
      failed_.store(true, std::memory_order_release);
      firstFailure = true;
      if (userAbort || policy_.handling != ErrorHandling::NoHandling) comms = comms_;
    }
    first = failure_;
    works.swap(tracked_);
  }
  idleCv_.notify_all();
  if (firstFailure && !userAbort) {
    const std::string where = dump(why);
    if (!where.empty()) {
      why += where;
      std::lock_guard<std::mutex> lk(mu_);
      failure_ = why;
      first = why;
    }
  }
  // Hooks before the abort: they may want to look at the state of the communicators.
  if (firstFailure && !userAbort && policy_.hooks) policy_.hooks->run(why);
  // Abort before reporting: once a caller sees the error, no kernel of this group still
  // writes into its tensors.
  for (auto& c : comms) c->abort();
  bool culpritSeen = false;
  for (auto& w : works) {
    if (w.get() == culprit) {
      culpritSeen = true;
      w->fail("myccl: " + why);
    } else {
      w->fail("myccl: " + w->info().describe() + ": not completed: the group failed: " + first);
    }
  }
  if (culprit != nullptr && !culpritSeen) culprit->fail("myccl: " + why);
}

void Watchdog::throwIfFailed(const OpInfo& info) const {
  if (!failed_.load(std::memory_order_acquire)) return;  // every op asks: no lock until a failure
  std::string f = failure();
  if (!f.empty()) {
    throwDistError("myccl: " + info.describe() + ": the group is unusable after an earlier failure: " + f +
                   " (destroy the process group and create a new one)");
  }
}

size_t Watchdog::outstanding() const {
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  {
    std::lock_guard<std::mutex> lk(mu_);
    works = tracked_;
  }
  size_t n = 0;
  for (auto& w : works) n += w->isCompleted() ? 0 : 1;
  return n;
}

bool Watchdog::failed() const {
  return failed_.load(std::memory_order_acquire);
}

bool Watchdog::timedOut() const {
  std::lock_guard<std::mutex> lk(mu_);
  return timedOut_;
}

std::string Watchdog::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return failure_;
}

void Watchdog::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  // Bounded: the thread fails any Work past its deadline, which empties tracked_.
  while (!tracked_.empty() && failure_.empty()) {
    if (stop_ || !thread_.joinable()) {
      // No thread to make progress: poll here (the calling thread has selected its device).
      lk.unlock();
      poll();
      std::this_thread::sleep_for(kPollInterval);
      lk.lock();
      continue;
    }
    idleCv_.wait_for(lk, kPollInterval * 5);
  }
}

void Watchdog::failOutstanding(const std::string& why) {
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  {
    std::lock_guard<std::mutex> lk(mu_);
    works.swap(tracked_);
  }
  idleCv_.notify_all();
  for (auto& w : works) w->fail("myccl: " + w->info().describe() + ": not completed: " + why);
}

}  // namespace myccl::cuda
