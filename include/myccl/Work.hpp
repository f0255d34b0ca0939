// The Work handed back for every op: really asynchronous (an engine thread completes it),
// with wait(timeout), a Future for DDP and comm hooks, profiler titles and durations.
// NCCL work (src/cuda) derives from it and adds CUDA events.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>

#include "myccl/AbortHooks.hpp"
#include "myccl/Errors.hpp"
#include "myccl/OpInfo.hpp"
#include "myccl/TorchCompat.hpp"

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace myccl {

class MycclWork : public c10d::Work {
 public:
  // The profiler range ("myccl:all_reduce", with input shapes) opens here and closes when
  // the work completes; while a profiler listens, the op is also recorded here (on the calling
  // thread) as torch's "record_param_comms" event with torch's comm metadata (collective name,
  // element counts, dtype, group name and ranks), as torch's own backends record it.
  // `future`: the Future it hands out (a device-aware one); a plain one when none is given.
  MycclWork(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
            c10::intrusive_ptr<c10::ivalue::Future> future = {});
  ~MycclWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  float getDuration() const override;
  uint64_t getSequencenumber() const override;
#if MYCCL_HAS_COMPLETION_HOOKS
  // Never reused within the process (a completion may be reported after the Work is gone).
  uint64_t getCompletionKey() const override { return completionKey_; }
#endif
  // Runs `hooks` once this Work has completed successfully (at once if it already has), with its
  // completion key and duration; a failed Work reports nothing (torch's contract).
  void setCompletionHooks(std::shared_ptr<CompletionHooks> hooks);

  const OpInfo& info() const { return info_; }
  // The tensors it holds until completion (result() copies the outputs).
  const std::vector<at::Tensor>& inputs() const { return inputs_; }
  const std::vector<at::Tensor>& outputs() const { return outputs_; }

  // Completed by a device (the CUDA engine's Works), not by an engine thread.
  virtual bool onDevice() const { return false; }
  std::chrono::steady_clock::time_point startTime() const { return started_.load() ? startedAt_ : queuedAt_; }

  // Engine side. markDone is idempotent: the first call decides the outcome.
  void markStarted();
  void markDone(std::exception_ptr error = nullptr);
  void setSourceRank(int rank) { sourceRank_.store(rank); }
  // Point-to-point work: wait() without a timeout is bounded by the op's timeout (nothing else
  // would ever complete a receive whose sender never sends); `cancel` withdraws the request.
  void setCanceller(std::function<bool()> cancel);
  // wait() first yields the core for up to this long (re-checking between yields) before it
  // sleeps: a thread woken from a condition variable costs more than the message it waits for
  // when the peer answers within microseconds (0: sleep at once).
  void setSpinWait(std::chrono::nanoseconds spin) { spin_ = spin; }

 protected:
  // How markDone settles future_ (completed with the outputs, or failed). A subclass whose
  // future is completed elsewhere (the NCCL work completes its CUDA-aware future when its ops
  // are enqueued) overrides it; called at most once, before waiters are woken.
  virtual void settleFuture(std::exception_ptr error);

  OpInfo info_;
  std::vector<at::Tensor> inputs_;   // kept alive until completion
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> done_{false};
  std::atomic<int> sourceRank_{-1};
  std::chrono::steady_clock::time_point queuedAt_, startedAt_, endedAt_;
  std::atomic<bool> started_{false};
  std::function<bool()> cancel_;
  bool bounded_ = false;
  std::chrono::nanoseconds spin_{0};
  std::atomic<bool> settled_{false};  // set once waiters may return (after finish())

 private:
  void maybeReportCompletion();
  const uint64_t completionKey_;
  std::shared_ptr<CompletionHooks> completionHooks_;  // under mutex_
  bool completionReported_ = false;                    // under mutex_
};

// A Work that completes when all of its children have (coalescing, composite ops).
c10::intrusive_ptr<MycclWork> combineWorks(OpInfo info, std::vector<c10::intrusive_ptr<c10d::Work>> children);

// List[Tensor], the value type of every Work's future (created once).
c10::TypePtr tensorListType();

}  // namespace myccl
