// The Reducer during an iteration (Reducer.hpp): the checks before forward and backward, the
// autograd hook of each parameter, gradients marked ready into their bucket slots (dense and
// sparse), buckets launched in order as their last gradient arrives so that the reductions overlap
// backward, and the map of globally unused parameters. The end of backward is Finalize.cpp's.
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
#include "Streams.hpp"
#include "myccl/Arguments.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"
#include "myccl/Recorder.hpp"

namespace myccl::reducer {

// ---- per iteration ---------------------------------------------------------------------------

void Reducer::prepareForForward() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!(expectHooks_ && anyReady_)) return;
  std::vector<size_t> pending;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!ready_[i]) pending.push_back(i);
  MYCCL_CHECK(false, where(), ": the previous synchronised backward never finished: gradients were marked ready (",
              params_.size() - pending.size(), " of ", params_.size(),
              " parameters) but the backward did not pass through this DDP module's outputs, so the reduction "
              "was never completed. Parameters still waiting: ",
              pending.empty() ? std::string("none") : describe(pending),
              ". Compute the loss from the DDP module's outputs (or run the forward under no_sync()).");
}

void Reducer::prepareForBackward(const std::vector<at::Tensor>& outputs, bool sinkAttached) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t n = params_.size();
  expectHooks_ = true;
  finalizeQueued_ = false;
  sinkAttached_ = sinkAttached;
  unusedMarked_ = false;
  anyReady_ = false;
  nextBucket_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  std::fill(gotGradient_.begin(), gotGradient_.end(), 0);
  if (recordingOrder_) readyOrder_.clear();
  for (auto& b : buckets_) {
    b.pending = b.vars.size();
    b.future.reset();
    b.sparseGrad.reset();
    b.times.readyUs = b.times.launchUs = 0;
    b.times.gradsPending = -1;
    b.times.gradCopies = 0;
    b.times.streamWaits = 0;
    b.times.doneUs = std::make_shared<std::atomic<int64_t>>(0);
    b.marksUsed = 0;
  }
  current_ = IterationStats{};
  current_.iteration = synced_ + 1;
  if (opts_.staticGraph && synced_ > 0) remaining_ = hookCount_;

  if (dynamicFindUnused()) {
    // Parameters whose accumulator is unreachable from the outputs get no gradient in this
    // backward: they are marked ready when backward starts so their buckets need not wait.
    unused_.clear();
    std::unordered_set<torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    for (const auto& out : outputs)
      if (out.defined() && out.grad_fn() && seen.insert(out.grad_fn().get()).second) stack.push_back(out.grad_fn().get());
    while (!stack.empty()) {
      auto* fn = stack.back();
      stack.pop_back();
      for (const auto& edge : fn->next_edges())
        if (auto* next = edge.function.get(); next && seen.insert(next).second) stack.push_back(next);
    }
    for (size_t i = 0; i < n; ++i)
      if (!seen.count(accumulators_[i].get())) unused_.push_back(static_cast<int64_t>(i));
  }
}

void Reducer::queueFinalize() {
  finalizeQueued_ = true;
  // The callback runs when the graph task that queued it finishes; a weak reference because
  // the DDP module may be gone by then.
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this()] {
    if (auto self = weak.lock()) self->finalizeBackward();
  });
}

void Reducer::backwardStarted() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!expectHooks_ || finalizeQueued_) return;
  if (current_.backwardStartUs == 0) current_.backwardStartUs = Recorder::nowUs();
  queueFinalize();
  if (!staticFirstIteration()) markUnusedOnce();
}

void Reducer::setJoinFuture(c10::intrusive_ptr<c10::ivalue::Future> activeRanks, bool divideByInitialWorldSize) {
  std::lock_guard<std::mutex> lk(mu_);
  joinFuture_ = std::move(activeRanks);
  joinStaticWorld_ = divideByInitialWorldSize;
}

void Reducer::autogradHook(size_t index, bool gotGradient) {
  std::lock_guard<std::mutex> lk(mu_);
  const bool trackUse = dynamicFindUnused() || (staticFirstIteration() && expectHooks_);
  // Under no_sync() too: a parameter used in any accumulated micro-step has a gradient to sync.
  if (trackUse && params_[index].grad().defined()) localUsed_[index] = 1;
  if (!expectHooks_) return;  // no_sync(), or a backward the Reducer was not armed for
  if (current_.backwardStartUs == 0) current_.backwardStartUs = Recorder::nowUs();
  // Without DDP's sink (the outputs held no tensor needing grad) this is the earliest point
  // inside backward; the callback then runs at the end of whichever graph task runs this hook.
  if (!finalizeQueued_ && !sinkAttached_) queueFinalize();
  if (gotGradient) gotGradient_[index] = 1;
  if (staticFirstIteration()) {
    // The first static-graph backward only counts hook firings; buckets are reduced at its
    // end, when it is known how many firings make each gradient complete.
    if (hookCount_[index]++ == 0) readyOrder_.push_back(static_cast<int64_t>(index));
    return;
  }
  markUnusedOnce();
  if (opts_.staticGraph) {
    MYCCL_CHECK(remaining_[index] > 0, where(), ": parameter '", names_[index], "' received more gradients in this ",
                "backward than in the first one (", hookCount_[index],
                "); with static_graph=True the autograd graph must be the same in every iteration");
    if (--remaining_[index] > 0) return;
  }
  MYCCL_CHECK(!ready_[index], where(), ": parameter '", names_[index], "' received a gradient after it was ",
              std::find(unused_.begin(), unused_.end(), static_cast<int64_t>(index)) != unused_.end()
                  ? "found unreachable from the outputs (find_unused_parameters=True cannot see through "
                    "reentrant checkpointing)"
                  : "already reduced in this backward (it is used in several reentrant backward passes, e.g. a "
                    "module checkpointed more than once)",
              ". Use static_graph=True if the graph is the same every iteration, or "
              "torch.utils.checkpoint(..., use_reentrant=False).");
  if (recordingOrder_) readyOrder_.push_back(static_cast<int64_t>(index));
  markReady(index);
}

void Reducer::markUnusedOnce() {
  if (unusedMarked_) return;
  unusedMarked_ = true;
  for (int64_t i : unused_) {
    // A parameter unused here may be unused everywhere, and then its .grad must come out of
    // this iteration as it went in: a slot alias would be reduced with its bucket, so it gets
    // memory of its own first (its value still goes into the slot, as torch's copy would).
    unalias(static_cast<size_t>(i));
    markReady(static_cast<size_t>(i));
  }
}

// Average inside the reduction (ReduceOp.PREMUL_SUM with 1/d, which myccl's CPU engine folds into
// its sum: sum of round(g * 1/d)) instead of scaling every gradient on the way into the bucket:
// with gradient_as_bucket_view that saves a pass over all gradients per step. Only where the
// result is the same bits torch's reducer gets (it divides each gradient by d, then sums):
// float32/float64, d a power of two, so 1/d is exact and x * (1/d) == x / d. Every rank must
// decide alike, so not under join() (joined ranks shadow with zeros and may count a different
// d), and not with a comm hook.
bool Reducer::fusedAverage(const Bucket& bucket) {
  if (!allowFused_ || hook_ || !myccl_ || joinFuture_ || shadowing_ || bucket.sparse || bucket.onDevice) return false;
  const auto st = bucket.buffer.scalar_type();
  if (st != at::kFloat && st != at::kDouble) return false;
  const int64_t d = divFactor();
  return d > 1 && (d & (d - 1)) == 0;
}

void Reducer::unalias(size_t index) {
  if (opts_.gradientAsBucketView) return;
  at::Tensor& grad = params_[index].mutable_grad();
  const Locator loc = where_[index];
  const Bucket& b = buckets_[loc.bucket];
  if (grad.defined() && !b.sparse && inSlot(grad, b.views[loc.slot])) grad = grad.clone();
}

bool Reducer::gradInSlot(const Bucket& bucket) const {
  return allowAlias_ && !opts_.gradientAsBucketView && !bucket.sparse && !bucket.onDevice;
}

int64_t Reducer::divFactor() {
  if (divFactor_ > 0) return divFactor_;
  divFactor_ = worldSize_;
  if (joinFuture_ && !joinStaticWorld_) {
    // join(divide_by_initial_world_size=False): average over the ranks still training.
    joinFuture_->wait();
    at::Tensor active = tensorFromFutureValue(joinFuture_->value(), "join");
    divFactor_ = std::max<int64_t>(1, static_cast<int64_t>(active.cpu().item<double>() + 0.5));
  }
  return divFactor_;
}

void Reducer::markReady(size_t index) {
  const Locator loc = where_[index];
  Bucket& bucket = buckets_[loc.bucket];
  ready_[index] = 1;
  anyReady_ = true;
  if (bucket.sparse)
    markSparse(bucket, index);
  else
    markDense(bucket, loc.slot, index);
  if (bucket.onDevice) noteStream(bucket);
  if (--bucket.pending == 0) {
    bucket.times.readyUs = Recorder::nowUs();
    launchReadyBuckets();
  }
}

void Reducer::markDense(Bucket& bucket, size_t slot, size_t index) {
  at::Tensor& view = bucket.views[slot];
  at::Tensor& grad = params_[index].mutable_grad();
  if (!grad.defined()) {
    view.zero_();  // no gradient here: contribute zeros (and leave .grad unset unless others had one)
    return;
  }
  MYCCL_CHECK(!grad.is_sparse(), where(), ": parameter '", names_[index],
              "' got a sparse gradient; build the DDP module with its nn.Embedding(sparse=True) visible so it "
              "gets a sparse bucket");
  MYCCL_CHECK(grad.scalar_type() == view.scalar_type() && grad.device() == view.device() &&
                  grad.numel() == view.numel(),
              where(), ": parameter '", names_[index], "' got a gradient of ", grad.scalar_type(), " ",
              shapeOf(grad), " on ", grad.device(), ", expected ", view.scalar_type(), " ", shapeOf(view), " on ",
              view.device());
  const bool fused = fusedAverage(bucket);
  const bool average = !hook_ && !fused;
  if (inSlot(grad, view) && (opts_.gradientAsBucketView || !grad.requires_grad())) {
    // .grad already lives in the bucket (a bucket view or a slot alias): scale in place,
    // unless the reduction does it. The bits are those of torch's reducer in the same mode:
    // it divides bucket views and multiplies copies by 1 / world_size.
    if (average && opts_.gradientAsBucketView)
      view.div_(divFactor());
    else if (average)
      view.mul_(at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(divFactor())));
    return;
  }
  ++bucket.times.gradCopies;
  if (average) {
    // Average while copying in (one pass instead of two). x * (1 / world_size), rounded once:
    // the same operation torch's reducer does, hence the same bits.
    const auto scale = at::native::wrapped_scalar_tensor(1.0 / static_cast<double>(divFactor()));
    if (grad.requires_grad())
      view.copy_(at::mul(grad, scale));  // create_graph=True: keep the graph's gradient untouched
    else
      at::mul_out(view, grad, scale);
  } else {
    view.copy_(grad);  // a comm hook, or the reduction, owns the averaging
  }
  if (opts_.gradientAsBucketView)
    grad = view;
  else if (gradInSlot(bucket) && gotGradient_[index] && !grad.requires_grad())
    grad = slotAlias(view, bucket.buffer);  // from the next iteration on, no copy either way
}

void Reducer::markSparse(Bucket& bucket, size_t index) {
  at::Tensor& grad = params_[index].mutable_grad();
  if (!grad.defined()) {
    // Unused here but perhaps used elsewhere: take part with no rows.
    bucket.sparseGrad = emptySparseLike(params_[index]);
    return;
  }
  MYCCL_CHECK(grad.is_sparse(), where(), ": parameter '", names_[index],
              "' was expected to get a sparse gradient (nn.Embedding(sparse=True)) but got a dense one");
  bucket.sparseGrad = grad;
  if (!hook_) bucket.sparseGrad.div_(divFactor());
}

// Gradients are copied into a bucket on the stream that produced them (the current stream in the
// autograd hook); the reduction (or hook) is launched on the current stream of whichever hook or
// callback finds the bucket complete, and the engine orders its own stream after that one. One
// stream throughout is the usual case and costs no event. A model that runs parts of its forward
// on other streams has gradients copied in on several: each of those records an event after its
// copy, and the launch's stream waits for them (and for the first stream, if it is not the
// launch's own) before the reduction is issued.
void Reducer::noteStream(Bucket& bucket) {
  const cuda::Stream s = streams_->current();
  auto& marks = bucket.marks;
  if (bucket.marksUsed == 0) {
    if (marks.empty())
      marks.push_back({s, nullptr});
    else
      marks[0].stream = s;
    bucket.marksUsed = 1;
    return;
  }
  if (s == marks[0].stream) return;
  size_t k = 1;
  while (k < bucket.marksUsed && marks[k].stream != s) ++k;
  if (k == bucket.marksUsed) {
    if (k == marks.size())
      marks.push_back({s, nullptr});
    else
      marks[k].stream = s;
    ++bucket.marksUsed;
  }
  if (!marks[k].event) marks[k].event = streams_->newEvent();
  marks[k].event->record(s);  // after this copy; a later copy on s records it again
}

size_t Reducer::orderLaunch(Bucket& bucket) {
  if (bucket.marksUsed == 0) return 0;
  const cuda::Stream launch = streams_->current();
  size_t waits = 0;
  for (size_t k = 0; k < bucket.marksUsed; ++k) {
    auto& m = bucket.marks[k];
    if (m.stream == launch) continue;
    if (!m.event) m.event = streams_->newEvent();
    if (k == 0) m.event->record(m.stream);  // the first stream recorded nothing yet: all it holds now
    m.event->block(launch);
    ++waits;
  }
  return waits;
}

void Reducer::launchReadyBuckets() {
  while (nextBucket_ < buckets_.size() && buckets_[nextBucket_].pending == 0) {
    Bucket& b = buckets_[nextBucket_];
    b.times.launchUs = Recorder::nowUs();
    if (b.onDevice) b.times.streamWaits = orderLaunch(b);
    int64_t later = 0;
    for (size_t k = nextBucket_ + 1; k < buckets_.size(); ++k) later += static_cast<int64_t>(buckets_[k].pending);
    b.times.gradsPending = later;
    b.times.fusedAverage = fusedAverage(b);
    b.future = runReduction(nextBucket_, b.sparse ? b.sparseGrad : b.buffer);
    auto done = b.times.doneUs;
    b.future->addCallback([done](c10::ivalue::Future&) { done->store(Recorder::nowUs()); });
    ++nextBucket_;
  }
}

c10::intrusive_ptr<c10::ivalue::Future> Reducer::runReduction(size_t index, const at::Tensor& buffer) {
  const Bucket& bucket = buckets_[index];
  if (hook_) {
    std::vector<at::Tensor> ps;
    ps.reserve(bucket.vars.size());
    for (int64_t i : bucket.vars) ps.push_back(params_[i]);
    auto gb = std::make_shared<GradBucket>(index, buckets_.size(), buffer, std::move(ps), bucket.offsets, bucket.lengths);
    return hook_->run(gb);
  }
  std::vector<at::Tensor> ts{buffer.is_complex() ? at::view_as_real(buffer) : buffer};
  if (fusedAverage(bucket)) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = compat::makePreMulSum(1.0 / static_cast<double>(divFactor()));
    return pg_->allreduce(ts, opts)->getFuture();
  }
  // Averaged already (scaled on the way in): a plain sum finishes it.
  return pg_->allreduce(ts)->getFuture();
}

void Reducer::launchUsedMap(const std::vector<int32_t>& used) {
  const bool toDevice = !params_[0].device().is_cpu();
  // Pinned, so the copy to the device is asynchronous: from pageable memory CUDA first waits for
  // the stream on the host. The caching host allocator keeps it until the copy has run.
  at::Tensor host = at::empty({static_cast<int64_t>(used.size())}, at::TensorOptions(at::kInt).pinned_memory(toDevice));
  std::copy(used.begin(), used.end(), host.data_ptr<int32_t>());
  usedDev_ = toDevice ? host.to(params_[0].device(), at::kInt, /*non_blocking=*/true) : host;
  std::vector<at::Tensor> ts{usedDev_};
  usedWork_ = pg_->allreduce(ts);
  usedReduced_ = false;
}

bool Reducer::globallyUnused(size_t index) {
  if (!(opts_.findUnusedParameters || opts_.staticGraph)) return false;
  if (opts_.staticGraph && synced_ > 0) return !globalUsed_[index];
  if (localUsed_[index]) return false;  // used here, so used somewhere: no need to wait
  if (!usedReduced_) {
    usedWork_->wait();
    at::Tensor h = usedDev_.cpu();
    reducedUsed_.assign(h.data_ptr<int32_t>(), h.data_ptr<int32_t>() + h.numel());
    usedReduced_ = true;
  }
  return reducedUsed_[index] == 0;
}

}  // namespace myccl::reducer
