// Watchdog: polls outstanding NCCL Works and communicators every few milliseconds, completes
// finished Works, and turns a timeout or an asynchronous NCCL error into an aborted group
// whose every outstanding and later op raises a DistBackendError naming the op.
#include "myccl/cuda/Watchdog.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <sstream>

#include "myccl/Errors.hpp"
#include "myccl/Threads.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclWork.hpp"

namespace myccl::cuda {

namespace {
// Short enough that a finished op is seen promptly by isCompleted-less users, long enough to
// cost nothing measurable (one cudaEventQuery per outstanding op per tick).
constexpr auto kPollInterval = std::chrono::milliseconds(20);
}  // namespace

std::string timeoutReason(const OpInfo& info, int device) {
  std::ostringstream os;
  os << info.describe() << ": Timed out after " << info.timeout.count() << " ms: the op did not finish on cuda:"
     << device << ", so the NCCL communicator was aborted. A peer has probably not reached this op (it may be "
     << "stuck, dead, or calling a different op)";
  return os.str();
}

Watchdog::Watchdog(int rank, std::string group) : rank_(rank), group_(std::move(group)) {}

Watchdog::~Watchdog() {
  stop();
}

void Watchdog::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (thread_.joinable() || stop_) return;
  thread_ = std::thread([this] { loop(); });
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  joinOrDetach(thread_);
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

void Watchdog::loop() {
  // A global-mode CUDA graph capture in another thread forbids "unsafe" calls such as
  // cudaEventQuery process-wide, and one such call invalidates the capture. Relaxed mode
  // exempts this thread; it never touches captured work anyway.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, kPollInterval, [&] { return stop_; });
    if (stop_) break;
    lk.unlock();
    try {
      poll();
    } catch (const std::exception& e) {
      auto* ce = dynamic_cast<const c10::Error*>(&e);
      fail("watchdog error on rank " + std::to_string(rank_) + ", group '" + group_ +
               "': " + (ce ? ce->what_without_backtrace() : e.what()),
           false);
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
    ncclResult_t r = c->asyncError();
    if (r != ncclSuccess && r != ncclInProgress) {
      std::ostringstream os;
      os << "NCCL reported an asynchronous error on cuda:" << c->device() << " (rank " << rank_ << ", group '"
         << group_ << "'): " << ncclErrorText(r) << "; outstanding ops cannot complete";
      fail(os.str(), false);
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
      gpuDone = w->gpuFinished();
    } catch (const std::exception& e) {
      auto* ce = dynamic_cast<const c10::Error*>(&e);
      fail(w->info().describe() + ": CUDA error while checking whether the op finished: " +
               (ce ? ce->what_without_backtrace() : e.what()),
           false, w.get());
      return;
    }
    if (gpuDone) {
      if (w->succeed()) finished.push_back(w.get());
      // else: the communicator has an error; the next tick reports it for the whole group.
    } else if (now > w->deadline()) {
      fail(timeoutReason(w->info(), w->device().index()), true, w.get());
      return;
    }
  }
  if (finished.empty()) return;
  std::lock_guard<std::mutex> lk(mu_);
  tracked_.erase(std::remove_if(tracked_.begin(), tracked_.end(),
                                [&](const c10::intrusive_ptr<NcclWork>& w) {
                                  return std::find(finished.begin(), finished.end(), w.get()) != finished.end();
                                }),
                 tracked_.end());
  if (tracked_.empty()) idleCv_.notify_all();
}

void Watchdog::fail(const std::string& why, bool timedOut, NcclWork* culprit) {
  std::vector<c10::intrusive_ptr<NcclWork>> works;
  std::vector<std::shared_ptr<NcclComm>> comms;
  std::string first;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failure_.empty()) {
      failure_ = why;
      timedOut_ = timedOut;
      comms = comms_;
    }
    first = failure_;
    works.swap(tracked_);
  }
  idleCv_.notify_all();
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
  std::string f = failure();
  if (!f.empty()) {
    throwDistError("myccl: " + info.describe() + ": the group is unusable after an earlier failure: " + f +
                   " (destroy the process group and create a new one)");
  }
}

bool Watchdog::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !failure_.empty();
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
      // No thread to make progress: poll here.
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
