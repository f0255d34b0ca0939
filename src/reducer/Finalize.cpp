// The end of a backward pass: wait for every bucket's reduction, write the averaged gradients
// back (unflattened, or left in place where they alias their slot), leave unused parameters'
// gradients as torch's DDP would, and the shadow backward a joined rank runs for the others.
#include "myccl/reducer/Reducer.hpp"

#include <ATen/ScalarOps.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sparse_coo_tensor.h>
#include <ATen/ops/view_as_real.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <sstream>
#include <unordered_set>

#include "Slots.hpp"
#include "myccl/Arguments.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"
#include "myccl/Recorder.hpp"

namespace myccl::reducer {

void Reducer::writeBack(Bucket& bucket) {
  const c10::IValue value = bucket.future->value();
  if (bucket.sparse) {
    const size_t i = bucket.vars[0];
    at::Tensor result = hook_ ? hook_->result(value) : tensorFromFutureValue(value, "sparse all_reduce");
    if (globallyUnused(i)) return;
    at::Tensor& grad = params_[i].mutable_grad();
    if (!grad.defined())
      grad = result;
    else if (!result.is_same(grad))
      grad.copy_(result);
    return;
  }
  std::vector<at::Tensor> out;
  const std::vector<at::Tensor>* viewsOut = &bucket.views;
  if (hook_) {
    at::Tensor result = hook_->result(value);
    if (!result.is_same(bucket.buffer)) {
      MYCCL_CHECK(result.numel() == bucket.buffer.numel() && result.device() == bucket.buffer.device(), where(),
                  ": the comm hook's result for bucket ", bucket.times.index, " has ", result.numel(),
                  " elements on ", result.device(), ", the bucket ", bucket.buffer.numel(), " on ",
                  bucket.buffer.device());
      out = viewsInto(result.is_contiguous() ? result : result.contiguous(), bucket);
      viewsOut = &out;
    }
  }
  for (size_t s = 0; s < bucket.vars.size(); ++s) {
    const size_t i = bucket.vars[s];
    const at::Tensor& src = (*viewsOut)[s];
    at::Tensor& view = bucket.views[s];
    const bool unused = globallyUnused(i);
    at::Tensor& grad = params_[i].mutable_grad();
    if (!opts_.gradientAsBucketView) {
      if (unused) continue;  // nobody computed it: leave .grad as it was
      if (grad.defined()) {
        if (!inSlot(grad, src)) grad.copy_(src);  // a slot alias holds the result already
      } else if (gradInSlot(bucket) && src.is_same(view)) {
        grad = slotAlias(view, bucket.buffer);
      } else {
        grad = torch::autograd::utils::clone_obey_contract(src, params_[i]);
      }
      continue;
    }
    if (!view.is_alias_of(src)) view.copy_(src);
    if (unused) continue;
    if (!grad.defined())
      grad = view;
    else
      MYCCL_CHECK(grad.is_alias_of(view), where(), ": parameter '", names_[i],
                  "'.grad is no longer its bucket view (gradient_as_bucket_view=True); something replaced it "
                  "during backward");
  }
}

void Reducer::waitAllQuietly() {
  for (auto& b : buckets_) {
    if (!b.future) continue;
    try {
      b.future->wait();
    } catch (const std::exception&) {
      // The caller is about to raise its own error; this one would only hide it.
    }
  }
  if (usedWork_) {
    try {
      usedWork_->wait();
    } catch (const std::exception&) {
    }
  }
}

void Reducer::endIteration() {
  expectHooks_ = false;
  finalizeQueued_ = false;
  anyReady_ = false;
  divFactor_ = 0;
  joinFuture_.reset();
  for (auto& b : buckets_) b.sparseGrad.reset();
}

void Reducer::finalizeBackward() {
  std::function<void(const IterationStats&)> observer;
  IterationStats record;
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (!expectHooks_) return;  // e.g. a second backward through the same graph
    const size_t n = params_.size();
    current_.backwardEndUs = Recorder::nowUs();
    const bool firstStatic = staticFirstIteration();
    if (firstStatic) {
      for (size_t i = 0; i < n; ++i)
        if (hookCount_[i] == 0) readyOrder_.push_back(static_cast<int64_t>(i));
      for (size_t i = 0; i < n; ++i) markReady(i);
    } else {
      markUnusedOnce();
    }
    // The check torch's DDP defers to the next forward (after optimizer.step() has applied
    // unsynchronised gradients): a parameter with no gradient in this backward is an error now.
    std::vector<size_t> missing;
    for (size_t i = 0; i < n; ++i) {
      const bool noGradient = !opts_.findUnusedParameters && !opts_.staticGraph && !gotGradient_[i];
      if (!ready_[i] || noGradient) missing.push_back(i);
    }
    std::string missingError;
    std::exception_ptr failure;
    if (!missing.empty()) {
      // Reduce what is left (zeros where nothing arrived) so that ranks which did get every
      // gradient are not left waiting in a collective this rank never joins; the iteration
      // then counts as done everywhere, so later collectives (the rebuild) stay aligned.
      for (size_t i : missing) {
        if (ready_[i]) continue;
        const Locator loc = where_[i];
        Bucket& b = buckets_[loc.bucket];
        ready_[i] = 1;
        if (b.sparse) {
          b.sparseGrad = emptySparseLike(params_[i]);
        } else {
          unalias(i);  // a slot alias keeps its value before its slot is zeroed
          b.views[loc.slot].zero_();
        }
        if (b.onDevice) noteStream(b);
        if (--b.pending == 0) b.times.readyUs = Recorder::nowUs();
      }
      launchReadyBuckets();
      if (usedMapNeeded()) launchUsedMap(localUsed_);
      waitAllQuietly();
      missingError = c10::str(
          where(), ": ", missing.size(), " of ", n, " parameters received no gradient in this backward: ",
          describe(missing),
          ". With find_unused_parameters=False every parameter must take part in every backward. Gradients "
          "were NOT synchronised; do not step the optimizer for this iteration. Pass find_unused_parameters=True "
          "(or static_graph=True if the same parameters are unused in every iteration), or make the loss "
          "depend on all of the module's outputs.");
    } else {
      if (usedMapNeeded()) launchUsedMap(localUsed_);
      try {
        for (auto& b : buckets_) {
          b.future->wait();
          // A future wakes its waiters before it runs its callbacks: if ours has not run yet,
          // now is when this rank saw the bucket done.
          int64_t unset = 0;
          b.times.doneUs->compare_exchange_strong(unset, Recorder::nowUs());
          writeBack(b);
        }
        if (usedMapNeeded() && !usedReduced_) usedWork_->wait();  // its tensor is reused next time
        if (firstStatic) {
          // Everything about the graph is known now: what counts as complete, what is unused.
          if (!usedReduced_) {
            at::Tensor h = usedDev_.cpu();
            reducedUsed_.assign(h.data_ptr<int32_t>(), h.data_ptr<int32_t>() + h.numel());
            usedReduced_ = true;
          }
          globalUsed_.assign(n, 0);
          for (size_t i = 0; i < n; ++i) globalUsed_[i] = reducedUsed_[i] != 0;
          unused_.clear();
          for (size_t i = 0; i < n; ++i)
            if (hookCount_[i] == 0) unused_.push_back(static_cast<int64_t>(i));
        }
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (dynamicFindUnused()) std::fill(localUsed_.begin(), localUsed_.end(), 0);
    endIteration();
    if (failure) {
      waitAllQuietly();
      std::rethrow_exception(failure);
    }
    if (recordingOrder_) {
      recordingOrder_ = false;
      std::vector<char> in(n, 0);
      for (int64_t i : readyOrder_) in[i] = 1;
      for (size_t i = 0; i < n; ++i)  // parameters marked ready without a hook go last
        if (!in[i]) readyOrder_.push_back(static_cast<int64_t>(i));
    }
    ++synced_;
    current_.finishedUs = Recorder::nowUs();
    for (const auto& b : buckets_) current_.buckets.push_back(b.times);
    history_.push_back(current_);
    while (history_.size() > std::max<size_t>(1, opts_.statsIterations)) history_.pop_front();
    MYCCL_CHECK(missingError.empty(), missingError);
    if (observer_ && Recorder::tracing()) {
      observer = observer_;
      record = current_;
    }
  }
  // Outside the lock: the observer takes the GIL.
  if (observer) observer(record);
}

void Reducer::setFusedAverage(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  MYCCL_CHECK(!expectHooks_, where(), ": set_fused_average during a backward");
  allowFused_ = on;
}

void Reducer::setGradAlias(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  MYCCL_CHECK(!expectHooks_, where(), ": set_grad_alias during a backward");
  allowAlias_ = on;
  if (on || opts_.gradientAsBucketView) return;
  at::NoGradGuard noGrad;
  for (size_t i = 0; i < params_.size(); ++i) unalias(i);
}

void Reducer::shadowBackward() {
  std::lock_guard<std::mutex> lk(mu_);
  MYCCL_CHECK(!expectHooks_, where(), ": a joined rank cannot shadow a backward while running its own");
  shadowing_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{shadowing_};
  IterationStats rec;
  rec.iteration = synced_ + 1;
  rec.backwardStartUs = rec.backwardEndUs = Recorder::nowUs();
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    at::Tensor zeros = bucket.sparse ? emptySparseLike(params_[bucket.vars[0]]) : at::zeros_like(bucket.buffer);
    BucketTimes t = bucket.times;
    t.readyUs = t.launchUs = Recorder::nowUs();
    t.gradCopies = 0;
    futures.push_back(runReduction(b, zeros));
    t.doneUs = std::make_shared<std::atomic<int64_t>>(0);
    auto done = t.doneUs;
    futures.back()->addCallback([done](c10::ivalue::Future&) { done->store(Recorder::nowUs()); });
    rec.buckets.push_back(t);
  }
  if (usedMapNeeded()) launchUsedMap(std::vector<int32_t>(params_.size(), 0));
  for (size_t b = 0; b < futures.size(); ++b) {
    futures[b]->wait();
    int64_t unset = 0;
    rec.buckets[b].doneUs->compare_exchange_strong(unset, Recorder::nowUs());  // see finalize
  }
  if (usedMapNeeded()) usedWork_->wait();
  ++synced_;
  rec.finishedUs = Recorder::nowUs();
  history_.push_back(std::move(rec));
  while (history_.size() > std::max<size_t>(1, opts_.statsIterations)) history_.pop_front();
}

}  // namespace myccl::reducer
