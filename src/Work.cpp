// MycclWork: completion, waiting with clear timeout errors, futures and profiler ranges; and
// the Work that completes with its children (combineWorks).
#include "myccl/Work.hpp"

#include <c10/util/Exception.h>
#include <sched.h>

#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "myccl/Errors.hpp"
#include "myccl/Profiler.hpp"

namespace myccl {

c10::TypePtr tensorListType() {
  static const c10::TypePtr t = c10::ListType::create(c10::TensorType::get());  // once, not per op
  return t;
}

MycclWork::MycclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                     c10::intrusive_ptr<c10::ivalue::Future> future)
    // The range needs a listener: without one (at::hasCallbacks) torch's Work would only make and
    // drop an inactive RecordFunction and a copy of the inputs.
    : c10d::Work(info.rank, info.type, at::hasCallbacks() ? profilingTitle(info.name) : nullptr,
                 at::hasCallbacks() ? std::optional<std::vector<at::Tensor>>(inputs) : std::nullopt),
      info_(std::move(info)),
      inputs_(std::move(inputs)),
      outputs_(std::move(outputs)),
      future_(future ? std::move(future) : c10::make_intrusive<c10::ivalue::Future>(tensorListType())),
      queuedAt_(std::chrono::steady_clock::now()),
      completionKey_([] {
        static std::atomic<uint64_t> next{1};
        return next.fetch_add(1, std::memory_order_relaxed);
      }()) {
  if (at::hasCallbacks()) recordParamComms(info_, inputs_, outputs_);
}

MycclWork::~MycclWork() = default;

bool MycclWork::isCompleted() {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_;
}

bool MycclWork::isSuccess() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return completed_ && !exception_;
}

std::exception_ptr MycclWork::exception() const {
  std::lock_guard<std::mutex> lk(mutex_);
  return exception_;
}

int MycclWork::sourceRank() const {
  int r = sourceRank_.load();
  TORCH_CHECK(r >= 0, "myccl: ", info_.describe(), ": sourceRank() is only defined for a completed receive-from-any");
  return r;
}

std::vector<at::Tensor> MycclWork::result() {
  return outputs_;
}

void MycclWork::setCanceller(std::function<bool()> cancel) {
  std::lock_guard<std::mutex> lk(mutex_);
  cancel_ = std::move(cancel);
  bounded_ = true;
}

bool MycclWork::wait(std::chrono::milliseconds timeout) {
  bool bounded;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    bounded = bounded_;
  }
  const bool userTimeout = timeout != kNoTimeout;
  const auto limit = userTimeout ? timeout : info_.timeout;
  if (spin_.count() > 0 && !settled_.load(std::memory_order_acquire)) {
    // Yielding, not busy-waiting: the thread that completes this work (the transport's epoll
    // thread) may need this very core.
    const auto until = std::chrono::steady_clock::now() + std::min<std::chrono::nanoseconds>(spin_, limit);
    while (!settled_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until) sched_yield();
  }
  {
    std::unique_lock<std::mutex> lk(mutex_);
    if (!userTimeout && !bounded) {
      cv_.wait(lk, [&] { return completed_; });
    } else if (!cv_.wait_for(lk, limit, [&] { return completed_; })) {
      lk.unlock();
      std::ostringstream os;
      os << "myccl: " << info_.describe() << ": Timed out in wait() after " << limit.count() << " ms";
      if (bounded && !userTimeout) {
        // Nothing will complete it: fail it for good and withdraw the request.
        std::function<bool()> cancel;
        {
          std::lock_guard<std::mutex> g(mutex_);
          cancel = cancel_;
        }
        bool withdrawn = cancel && cancel();
        os << (withdrawn ? "; the peer never sent/received, the request was withdrawn"
                         : "; the peer never completed the transfer");
        markDone(makeDistError(os.str()));
      } else {
        os << "; the operation is still in progress";
        throwDistError(os.str());
      }
      lk.lock();
    }
    if (exception_) std::rethrow_exception(exception_);
  }
  return true;
}

void MycclWork::abort() {
  markDone(makeDistError("myccl: " + info_.describe() + ": aborted"));
}

void MycclWork::settleFuture(std::exception_ptr error) {
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> MycclWork::getFuture() {
  return future_;
}

float MycclWork::getDuration() const {
  std::lock_guard<std::mutex> lk(mutex_);
  TORCH_CHECK(completed_, "myccl: ", info_.describe(), ": getDuration() called before the work completed");
  auto from = started_.load() ? startedAt_ : queuedAt_;
  return std::chrono::duration<float, std::milli>(endedAt_ - from).count();
}

uint64_t MycclWork::getSequencenumber() const {
  return info_.seq;
}

void MycclWork::markStarted() {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    startedAt_ = std::chrono::steady_clock::now();
  }
  started_.store(true);
}

void MycclWork::markDone(std::exception_ptr error) {
  bool expected = false;
  if (!done_.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) return;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    endedAt_ = std::chrono::steady_clock::now();
  }
  // The future first (as gloo does): once wait() returns, the future's value is there too.
  settleFuture(error);
  finish(error);  // sets completed_/exception_, wakes waiters, closes the profiler range
  settled_.store(true, std::memory_order_release);
  inputs_.clear();
  if (!error) maybeReportCompletion();
}

void MycclWork::setCompletionHooks(std::shared_ptr<CompletionHooks> hooks) {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    completionHooks_ = std::move(hooks);
  }
  if (settled_.load(std::memory_order_acquire) && isSuccess()) maybeReportCompletion();
}

// Once, whichever of markDone and setCompletionHooks comes second (an op run on the caller's
// thread is done before the backend hands it the hooks).
void MycclWork::maybeReportCompletion() {
  std::shared_ptr<CompletionHooks> hooks;
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (!completionHooks_ || completionReported_) return;
    completionReported_ = true;
    hooks = completionHooks_;
  }
  std::optional<float> ms;
  try {
    ms = getDuration();
  } catch (const std::exception&) {
    ms.reset();
  }
  hooks->run(completionKey_, ms);
}

namespace {

// Completes when every child has; the first child error becomes its error.
class CombinedWork final : public MycclWork {
 public:
  CombinedWork(OpInfo info, std::vector<c10::intrusive_ptr<c10d::Work>> children)
      : MycclWork(std::move(info), {}, collectOutputs(children)), children_(std::move(children)) {}

  void start() {
    auto self = c10::intrusive_ptr<CombinedWork>::reclaim_copy(this);
    pending_.store(static_cast<int>(children_.size()) + 1);
    for (auto& child : children_) {
      auto fut = child->getFuture();
      fut->addCallback([self](c10::ivalue::Future& f) { self->childDone(f.hasError() ? f.exception_ptr() : nullptr); });
    }
    childDone(nullptr);  // the +1 above: children that finished before start() cannot complete us early
  }

  // A CUDA child's future completes when its op is enqueued; waiting on this Work must also
  // order the caller's stream after every child (and apply each child's own timeout policy).
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& child : children_) child->wait(timeout);
    return MycclWork::wait(timeout);
  }

  void synchronize() override {
    for (auto& child : children_) child->synchronize();
  }

 private:
  static std::vector<at::Tensor> collectOutputs(const std::vector<c10::intrusive_ptr<c10d::Work>>& cs) {
    std::vector<at::Tensor> out;
    for (auto& c : cs)
      for (auto& t : c->result()) out.push_back(t);
    return out;
  }
  void childDone(std::exception_ptr e) {
    if (e) {
      std::lock_guard<std::mutex> lk(errMu_);
      if (!firstError_) firstError_ = e;
    }
    if (pending_.fetch_sub(1) == 1) {
      std::exception_ptr err;
      {
        std::lock_guard<std::mutex> lk(errMu_);
        err = firstError_;
      }
      markDone(err);
    }
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> children_;
  std::atomic<int> pending_{0};
  std::mutex errMu_;
  std::exception_ptr firstError_;
};

}  // namespace

c10::intrusive_ptr<MycclWork> combineWorks(OpInfo info, std::vector<c10::intrusive_ptr<c10d::Work>> children) {
  auto w = c10::make_intrusive<CombinedWork>(std::move(info), std::move(children));
  w->start();
  return w;
}

}  // namespace myccl
