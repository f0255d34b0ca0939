// The Reducer: its parameters and autograd hooks, the bucket buffers, the one bucket rebuild,
// configuration and introspection. What happens in each iteration (gradients marked ready into
// their slots, in-order asynchronous reductions that overlap backward, unused parameters) is in
// Backward.cpp, the end-of-backward wait and write-back in Finalize.cpp. The arithmetic (scale
// while copying in, sum, copy out) is the same as torch's reducer so that both give bit-identical
// parameters on the same backend.
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

namespace {

// Why hooks on the gradient accumulators (torch::autograd::impl::grad_accumulator) rather than
// Python post-accumulate-grad hooks: they run in C++ on the autograd thread without taking
// the GIL; the accumulator node is the very object the unused-parameter graph walk looks
// for; the hook sees the gradient that arrived in this backward (its input), which tells a
// parameter that got no gradient apart from one whose .grad merely holds an older value; and
// it is the same engine path torch's reducer uses, so AccumulateGrad makes the same
// steal-or-copy decisions and the gradients have the same bits under both DDPs.
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  explicit ReadyHook(std::function<void(bool)> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    fn_(!inputs.empty() && inputs[0].defined());
    return outputs;
  }

 private:
  std::function<void(bool)> fn_;
};

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<bool> expectSparse,
                 c10::intrusive_ptr<c10d::ProcessGroup> pg, ReducerOptions opts)
    : params_(std::move(params)), names_(std::move(names)), sparse_(std::move(expectSparse)), pg_(std::move(pg)),
      opts_(opts), rank_(pg_->getRank()), worldSize_(pg_->getSize()) {
  const size_t n = params_.size();
  MYCCL_CHECK(n > 0, "ddp: rank ", rank_, ": the module has no parameters that require gradients");
  MYCCL_CHECK(names_.size() == n && sparse_.size() == n, "ddp: rank ", rank_, ": ", n, " parameters but ",
              names_.size(), " names and ", sparse_.size(), " sparse flags");
  MYCCL_CHECK(opts_.caps.bytes > 0 && opts_.caps.firstBytes > 0, "ddp: rank ", rank_,
              ": bucket caps must be positive, got first=", opts_.caps.firstBytes, " bytes, others=", opts_.caps.bytes);
  for (size_t i = 0; i < n; ++i) {
    MYCCL_CHECK(params_[i].requires_grad() && params_[i].is_leaf(), "ddp: rank ", rank_, ": parameter '", names_[i],
                "' must be a leaf tensor that requires grad");
  }
  const at::Tensor& sample = params_[0];
  try {
    myccl_ = c10::dynamic_intrusive_pointer_cast<MycclBackend>(pg_->getBackend(sample.device().type()));
  } catch (const std::exception&) {
    // no backend for this device type in this group
  }
  bool anyOnDevice = false;
  for (size_t i = 0; i < n; ++i) {
    if (!routedToDevice(params_[i])) continue;
    anyOnDevice = true;
    // The device path orders its copies with one device's streams.
    MYCCL_CHECK(params_[i].device() == sample.device(), "ddp: rank ", rank_, ": parameter '", names_[i], "' is on ",
                params_[i].device(), " and '", names_[0], "' on ", sample.device(), "; use one device per process");
  }
  if (anyOnDevice) streams_ = myccl_ ? seamStreams(myccl_->cudaDevice(), sample) : c10Streams(sample.device());
  ready_.assign(n, 0);
  gotGradient_.assign(n, 0);
  localUsed_.assign(n, 0);
  hookCount_.assign(n, 0);

  // First plan: reverse registration order approximates the order backward produces gradients.
  std::vector<int64_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int64_t>(n - 1 - i);
  {
    std::lock_guard<std::mutex> lk(mu_);
    initializeBuckets(assignBuckets(params_, order, sparse_, opts_.caps));
  }

  for (size_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    MYCCL_CHECK(acc, "ddp: rank ", rank_, ": parameter '", names_[i], "' has no gradient accumulator");
    hookKeys_.push_back(acc->add_post_hook(std::make_unique<ReadyHook>([this, i](bool got) { autogradHook(i, got); })));
    accumulators_.push_back(std::move(acc));
  }
}

Reducer::~Reducer() {
  // Later backwards through these parameters must not call into a destroyed Reducer.
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hookKeys_[i]);
}

std::string Reducer::where() const {
  return "ddp: rank " + std::to_string(rank_);
}

std::string Reducer::describe(const std::vector<size_t>& indices) const {
  std::ostringstream os;
  const size_t shown = std::min<size_t>(indices.size(), 20);
  for (size_t k = 0; k < shown; ++k) os << (k ? ", " : "") << "'" << names_[indices[k]] << "'";
  if (shown < indices.size()) os << " and " << indices.size() - shown << " more";
  return os.str();
}

// ---- buckets ---------------------------------------------------------------------------------

bool Reducer::routedToDevice(const at::Tensor& t) const {
  // The backend's own rule when myccl carries the parameters (the tensors its CUDA platform
  // claims go to the CUDA engine); any other backend: device tensors to its device side.
  return myccl_ ? myccl_->onDevice(t) : !t.device().is_cpu();
}

at::Tensor Reducer::allocateBuffer(int64_t numel, const at::TensorOptions& options, bool onDevice,
                                   bool& fromBackend) {
  fromBackend = false;
  const auto device = options.device();
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg_->getBackend(device.type());
  } catch (const std::exception&) {
    // A group without a backend for this device type cannot offer memory for it either.
  }
  // CPU memory has no device index; the Backend API asks with -1 then. A device bucket asks for
  // its device, so a CPU tensor standing in for a device tensor never gets CPU-engine memory.
  if (backend && backend->supportsTensorAlloc(onDevice ? streams_->index() : -1)) {
    try {
      at::Tensor t = backend->allocateTensor(numel, options);
      fromBackend = true;
      return t;
    } catch (const std::exception& e) {
      logOnce("ddp-alloc", LogLevel::Warning,
              where() + ": the backend offered bucket memory but allocate_tensor failed (" + e.what() +
                  "); using ordinary memory");
    }
  }
  return at::empty({numel}, options);
}

std::vector<at::Tensor> Reducer::viewsInto(const at::Tensor& flat, const Bucket& bucket) const {
  std::vector<at::Tensor> views;
  views.reserve(bucket.vars.size());
  for (size_t s = 0; s < bucket.vars.size(); ++s) {
    const at::Tensor& p = params_[bucket.vars[s]];
    // Lay each view out like its parameter: AccumulateGrad gives dense parameters gradients
    // with the parameter's strides, so copies in and out stay sequential.
    if (p.is_non_overlapping_and_dense())
      views.push_back(flat.as_strided(p.sizes(), p.strides(), flat.storage_offset() + bucket.offsets[s]));
    else
      views.push_back(flat.narrow(0, bucket.offsets[s], bucket.lengths[s]).view(p.sizes()));
  }
  return views;
}

void Reducer::initializeBuckets(const BucketPlan& plan) {
  validatePlan(plan, params_, sparse_, names_);
  at::NoGradGuard noGrad;
  // Gradients that already live in the old buckets (bucket views, slot aliases) move with
  // their parameters into the new ones.
  std::vector<Bucket> old = std::move(buckets_);
  const std::vector<Locator> oldWhere = std::move(where_);
  buckets_.clear();
  where_.assign(params_.size(), Locator{});
  for (size_t b = 0; b < plan.size(); ++b) {
    Bucket bucket;
    bucket.vars = plan[b];
    bucket.times.index = b;
    bucket.times.numParams = bucket.vars.size();
    bucket.onDevice = bucket.times.onDevice = routedToDevice(params_[bucket.vars[0]]);
    if (bucket.vars.size() == 1 && sparse_[bucket.vars[0]]) {
      bucket.sparse = true;
      bucket.times.sparse = true;
    } else {
      int64_t offset = 0;
      for (int64_t i : bucket.vars) {
        bucket.offsets.push_back(offset);
        bucket.lengths.push_back(params_[i].numel());
        offset += params_[i].numel();
      }
      const at::Tensor& first = params_[bucket.vars[0]];
      bool fromBackend = false;
      bucket.buffer = allocateBuffer(offset, first.options().layout(at::kStrided).requires_grad(false),
                                     bucket.onDevice, fromBackend);
      bucket.times.backendMemory = fromBackend;
      bucket.times.nbytes = offset * static_cast<int64_t>(first.element_size());
      bucket.views = viewsInto(bucket.buffer, bucket);
    }
    for (size_t s = 0; s < bucket.vars.size(); ++s) where_[bucket.vars[s]] = Locator{b, s};
    buckets_.push_back(std::move(bucket));
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].mutable_grad();
    const auto& loc = where_[i];
    Bucket& bucket = buckets_[loc.bucket];
    if (bucket.sparse || !grad.defined()) continue;
    at::Tensor& view = bucket.views[loc.slot];
    if (opts_.gradientAsBucketView) {
      if (!grad.is_alias_of(view)) {
        view.copy_(grad);
        grad = view;
      }
    } else if (gradInSlot(bucket) && i < oldWhere.size() && !old.empty()) {
      // A slot alias of the old buckets moves with its parameter (and lets the old buffer go).
      const Bucket& was = old[oldWhere[i].bucket];
      if (!was.sparse && inSlot(grad, was.views[oldWhere[i].slot])) {
        view.copy_(grad);
        grad = slotAlias(view, bucket.buffer);
      }
    }
  }
}

bool Reducer::rebuildBucketsIfDue() {
  std::lock_guard<std::mutex> lk(mu_);
  if (rebuilt_ || synced_ == 0) return false;
  MYCCL_CHECK(!expectHooks_, where(), ": buckets cannot be rebuilt while a backward is in progress");
  rebuilt_ = true;
  const size_t n = params_.size();
  std::vector<int64_t> order = readyOrder_;
  if (order.size() != n) {  // a rank that never ran a synchronised backward (joined early)
    order.clear();
    for (const auto& b : buckets_) order.insert(order.end(), b.vars.begin(), b.vars.end());
  }
  BucketPlan mine = assignBuckets(params_, order, sparse_, opts_.caps);
  // Every rank must use the same plan, and ready orders differ between ranks: rank 0's wins.
  // Layout: [number of buckets, order (n), bucket sizes (n, zero-padded)].
  at::Tensor msg = at::zeros({static_cast<int64_t>(2 * n + 1)}, at::kLong);
  if (rank_ == 0) {
    auto* p = msg.data_ptr<int64_t>();
    p[0] = static_cast<int64_t>(mine.size());
    size_t k = 1;
    for (const auto& b : mine)
      for (int64_t i : b) p[k++] = i;
    for (size_t b = 0; b < mine.size(); ++b) p[1 + n + b] = static_cast<int64_t>(mine[b].size());
  }
  std::vector<at::Tensor> ts{params_[0].device().is_cpu() ? msg : msg.to(params_[0].device())};
  c10d::BroadcastOptions bo;
  bo.rootRank = 0;
  pg_->broadcast(ts, bo)->wait();
  msg = ts[0].cpu();
  const auto* p = msg.data_ptr<int64_t>();
  const int64_t nb = p[0];
  MYCCL_CHECK(nb >= 1 && nb <= static_cast<int64_t>(n), where(), ": rank 0's bucket plan has ", nb,
              " buckets for ", n, " parameters");
  BucketPlan plan(nb);
  size_t k = 1;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t sz = p[1 + n + b];
    MYCCL_CHECK(sz >= 1 && k - 1 + sz <= n, where(), ": rank 0's bucket plan is malformed (bucket ", b, " size ", sz, ")");
    plan[b].assign(p + k, p + k + sz);
    k += sz;
  }
  MYCCL_CHECK(k - 1 == n, where(), ": rank 0's bucket plan covers ", k - 1, " of ", n, " parameters");
  std::vector<std::vector<int64_t>> current;
  for (const auto& b : buckets_) current.push_back(b.vars);
  if (plan == current) return false;
  initializeBuckets(plan);
  return true;
}

// ---- configuration and introspection ---------------------------------------------------------

void Reducer::registerCommHook(std::shared_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lk(mu_);
  MYCCL_CHECK(hook, where(), ": register_comm_hook got no hook");
  MYCCL_CHECK(!hook_, where(), ": register_comm_hook can be called only once");
  MYCCL_CHECK(synced_ == 0 && !anyReady_, where(),
              ": register_comm_hook must be called before the first backward (", synced_,
              " synchronised backwards have run)");
  hook_ = std::move(hook);
}

void Reducer::setIterationObserver(std::function<void(const IterationStats&)> observer) {
  std::lock_guard<std::mutex> lk(mu_);
  observer_ = std::move(observer);
}

std::vector<IterationStats> Reducer::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {history_.begin(), history_.end()};
}

BucketPlan Reducer::plan() const {
  std::lock_guard<std::mutex> lk(mu_);
  BucketPlan p;
  for (const auto& b : buckets_) p.push_back(b.vars);
  return p;
}

std::vector<at::Tensor> Reducer::bucketBuffers() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<at::Tensor> out;
  for (const auto& b : buckets_) out.push_back(b.buffer);
  return out;
}

uint64_t Reducer::syncedIterations() const {
  std::lock_guard<std::mutex> lk(mu_);
  return synced_;
}

}  // namespace myccl::reducer
