// MycclBackend: argument checks and routing only. Everything that can be checked locally is
// checked here, on the caller's thread, before any peer is involved, so a bad call raises a
// ValueError naming the op, the rank and the value, and never leaves peers half-way in an op.
#include "myccl/ProcessGroupMyccl.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <sstream>

#include "myccl/Arguments.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/TorchCompat.hpp"
#include "myccl/Log.hpp"
#include "myccl/cpu/Engine.hpp"

namespace myccl {

using c10d::OpType;
using WorkRef = c10::intrusive_ptr<c10d::Work>;

namespace {

// 64 random bits in hex: tells this process's instance of a group from any other's.
std::string randomNonce() {
  std::random_device rd;
  char buf[24];
  snprintf(buf, sizeof(buf), "%08x%08x", rd(), rd());
  return buf;
}

}  // namespace

// On every op: an op that raises inside a coalescing block leaves the block with it. torch's
// coalescing manager never calls end_coalescing when its body raises, and a block left open
// would hold every later op of the group back for good.
class CoalescingGuard {
 public:
  explicit CoalescingGuard(MycclBackend* b) : b_(b), unwinding_(std::uncaught_exceptions()) {}
  ~CoalescingGuard() {
    if (std::uncaught_exceptions() > unwinding_) {
      try {
        b_->abandonCoalescing("an op of the block raised on rank " + std::to_string(b_->getRank()));
      } catch (...) {
      }
    }
  }

 private:
  MycclBackend* b_;
  int unwinding_;
};

MycclBackend::MycclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, std::string groupName, std::vector<int64_t> globalRanks,
                           Config cfg, const std::string& keyPrefix, bool reconfigurable, const CpuMaker& makeCpu)
    : Backend(rank, size),
      group_(std::move(groupName)),
      globalRanks_(std::move(globalRanks)),
      cfg_(std::move(cfg)),
      timeout_(timeout),
      store_(store) {
  MYCCL_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "init: rank ", rank, " is not in [0, ", size, ")");
  setRanks(globalRanks_);
  recorder_ = makeRecorder(rank, size);
  // In the reconfigure regime the group holds no links until reconfigure() names its members.
  if (makeCpu) {
    cpu_ = makeCpu(recorder_);
    cpu_->setAbortHooks(abortHooks_);
  } else if (!reconfigurable) {
    cpu_ = std::make_unique<cpu::CpuEngine>(store_, rank, size, timeout, group_, cfg_, recorder_, keyPrefix);
    cpu_->setAbortHooks(abortHooks_);  // before any op can fail
  }
  nonce_ = randomNonce();
  RecorderRegistry::get().add(recorder_);  // once the group is up: a failed init leaves nothing
  if (cfg_.flightRecorderEntries > 0) RecorderRegistry::get().installSignalHandler();
  init();
}

std::shared_ptr<Recorder> MycclBackend::makeRecorder(int rank, int size) const {
  return std::make_shared<Recorder>(group_, rank, size,
                                    static_cast<size_t>(std::max<int64_t>(0, cfg_.flightRecorderEntries)),
                                    cfg_.flightRecorderDump);
}

void MycclBackend::setRanks(std::vector<int64_t> globalRanks) {
  globalRanks_ = std::move(globalRanks);
  // torch describes a group's ranks as start + stride (stride -1: not evenly spaced).
  rankStart_ = 0;
  rankStride_ = 1;
  if (!globalRanks_.empty()) {
    rankStart_ = static_cast<int>(globalRanks_[0]);
    rankStride_ = globalRanks_.size() > 1 ? static_cast<int>(globalRanks_[1] - globalRanks_[0]) : 1;
    for (size_t i = 1; i < globalRanks_.size(); ++i)
      if (globalRanks_[i] - globalRanks_[i - 1] != rankStride_) rankStride_ = -1;
  }
}

cpu::CpuEngine& MycclBackend::cpuEngine(const char* op) const {
  if (!cpu_) {
    throwDistError("myccl: " + where(op) + ": the group was created with enable_reconfigure=True and has no members "
                   "yet; call reconfigure() with every member's handle (get_reconfigure_handle()) first");
  }
  return *cpu_;
}

MycclBackend::~MycclBackend() {
  if (recorder_) RecorderRegistry::get().retire(recorder_);
  if (!shutdown_.exchange(true)) {
    // Destroyed without shutdown(): stop threads and sockets without waiting for peers.
    for (Engine* e : engines()) e->abort("process group destroyed");
  }
}

c10::intrusive_ptr<c10d::Backend::Options> MycclBackend::getBackendOptions() {
  auto o = c10::make_intrusive<Options>("myccl", timeout_.load());
  o->group_name = group_;
  for (auto r : globalRanks_) o->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  return o;
}

std::string MycclBackend::where(const char* op) const {
  return std::string(op) + " (rank " + std::to_string(rank_) + ")";
}

OpInfo MycclBackend::info(OpType type, const char* op, std::chrono::milliseconds timeout, bool asyncOp, bool p2p) {
  OpInfo i;
  // Validate before taking a sequence number: a rejected call must not put this rank's
  // numbering out of step with its peers.
  MYCCL_CHECK_ARG(timeout == c10d::kUnsetTimeout || timeout.count() > 0, where(op), ": timeout must be positive, got ",
                  timeout.count(), " ms");
  i.asyncOp = asyncOp;
  i.type = type;
  i.op = op;
  i.name = op;
  i.seq = p2p ? p2pSeq_.fetch_add(1) : collSeq_.fetch_add(1) + 1;
  i.rank = rank_;
  i.size = size_;
  i.rankStart = rankStart_;
  i.rankStride = rankStride_;
  i.group = group_;
  i.timeout = (timeout == c10d::kUnsetTimeout) ? timeout_.load() : timeout;
  // Extensions are rare: the flag keeps the lock off every op's path.
  if (anyExtensions_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(extensionsMu_);
    // An extension ends when the first op created after it completes.
    std::erase_if(extensions_, [](const Extension& x) { return x.first && x.first->isCompleted(); });
    for (const auto& x : extensions_) i.timeout += x.extra;
    if (extensions_.empty()) anyExtensions_.store(false, std::memory_order_release);
  }
  return i;
}

WorkRef MycclBackend::record(WorkRef w) {
  if (!completionHooks_->empty()) {
    if (auto* mw = dynamic_cast<MycclWork*>(w.get())) mw->setCompletionHooks(completionHooks_);
  }
  if (anyExtensions_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(extensionsMu_);
    for (auto& x : extensions_)
      if (!x.first) x.first = w;
  }
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    if (coalescing_) coalesced_.push_back(w);
  }
  return w;
}

#if MYCCL_HAS_ABORT_HOOKS
void MycclBackend::addEphemeralTimeout(const std::chrono::milliseconds& timeout) {
  MYCCL_CHECK_ARG(timeout.count() >= 0, where("add_ephemeral_timeout"), ": the extension must not be negative, got ",
                  timeout.count(), " ms");
  std::lock_guard<std::mutex> lk(extensionsMu_);
  extensions_.push_back({timeout, {}});
  anyExtensions_.store(true, std::memory_order_release);
}

void MycclBackend::registerAbortHook(int64_t hookId, c10d::AbortHook hook) {
  MYCCL_CHECK_ARG(hook != nullptr, where("register_abort_hook"), ": hook ", hookId, " is empty");
  abortHooks_->add(hookId, std::move(hook));
}

void MycclBackend::unregisterAbortHook(int64_t hookId) {
  abortHooks_->remove(hookId);
}
#endif

#if MYCCL_HAS_COMPLETION_HOOKS
void MycclBackend::registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) {
  MYCCL_CHECK_ARG(hook != nullptr, where("register_completion_hook"), ": hook ", hookId, " is empty");
  completionHooks_->add(hookId, [hook = std::move(hook)](uint64_t key, std::optional<float> ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = ms;
    hook(args);
  });
}

void MycclBackend::unregisterCompletionHook(int64_t hookId) {
  completionHooks_->remove(hookId);
}
#endif

bool MycclBackend::isCuda(const char* op, const std::vector<at::Tensor>& tensors) const {
  MYCCL_CHECK_ARG(!tensors.empty(), where(op), ": expected at least one tensor");
  const auto first = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    MYCCL_CHECK_ARG(t.defined(), where(op), ": tensor ", i, " is undefined");
    MYCCL_CHECK_ARG(t.device() == first, where(op), ": all tensors must be on one device, tensor 0 is on ", first,
                    " but tensor ", i, " is on ", t.device());
    MYCCL_CHECK_ARG(t.layout() == at::kStrided, where(op), ": tensor ", i, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported here");
  }
  if (first.is_cpu()) return onDevice(tensors[0]);
  MYCCL_CHECK_ARG(first.is_cuda(), where(op), ": tensors on ", first, " are not supported (cpu and cuda only)");
  MYCCL_CHECK_ARG(cudaEngineBuilt(), where(op), ": got a CUDA tensor (", describe(tensors[0]),
                  ") but this myccl build has no NCCL engine; rebuild with MYCCL_WITH_NCCL=1 against a CUDA build "
                  "of torch");
  return true;
}

Engine& MycclBackend::engineFor(const char* op, const std::vector<at::Tensor>& tensors) {
  return isCuda(op, tensors) ? cudaEngine(op) : cpuEngine(op);
}

at::Tensor MycclBackend::allocateTensor(long size, at::TensorOptions options) {
  MYCCL_CHECK_ARG(size >= 0, where("allocate_tensor"), ": size must be >= 0, got ", size);
  MYCCL_CHECK_ARG(!options.has_device() || options.device().is_cpu(), where("allocate_tensor"),
                  ": only CPU tensors come from myccl's shared memory, got device ", options.device());
  return cpuEngine("allocate_tensor").allocateTensor(size, options);
}

at::Tensor MycclBackend::sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  const auto w = where("shared_tensor");
  for (size_t i = 0; i < shape.size(); ++i)
    MYCCL_CHECK_ARG(shape[i] >= 0, w, ": dimension ", i, " is negative (", shape[i], ")");
  return cpuEngine("shared_tensor").sharedTensor(shape, dtype);
}

bool MycclBackend::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
  // CPU (no device index): registered shared memory when the group uses it.
  return deviceIdx < 0 && usesSharedMemory();
}

std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> MycclBackend::stats() const {
  std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> out;
  if (!cpu_) return out;
  for (auto& e : cpu_->stats().snapshot()) out.emplace_back(e.op, e.algo, e.count, e.bytes, e.seconds);
  return out;
}

std::map<std::string, double> MycclBackend::linkModel() const {
  if (!cpu_) return {};
  const cpu::LinkModel m = cpu_->linkModel();
  if (!m.measured) return {};
  return {{"hierarchical", m.hierarchical},
          {"declared", m.declared},
          {"link_bytes_per_s", m.linkBytesPerS},
          {"local_bytes_per_s", m.localBytesPerS},
          {"ranks_per_host", m.ranksPerHost},
          {"hosts", m.hosts},
          {"seconds", m.seconds},
          {"bytes", static_cast<double>(m.bytes)}};
}

void MycclBackend::resetStats() {
  if (cpu_) cpu_->stats().reset();
}

int MycclBackend::rejectedConnections() const {
  return cpu_ ? cpu_->rejectedConnections() : 0;
}

const Topology& MycclBackend::topology() const {
  return cpuEngine("topology").topology();
}

bool MycclBackend::usesSharedMemory() const {
  return cpu_ && cpu_->usesSharedMemory();
}

Engine& MycclBackend::cudaEngine(const char* op) {
  std::lock_guard<std::mutex> lk(cudaMu_);
  if (!cuda_) {
    cuda_ = makeCudaEngine(where(op), store_, cpuEngine(op).keyPrefix(), rank_, size_, group_, cfg_, timeout_.load(),
                           abortHooks_, recorder_);
    if (cfg_.debugDetail && size_ > 1) {
      cpu::CpuEngine* cpu = cpu_.get();
      cuda_->setAgreement([cpu](const OpInfo& i) {
        OpInfo check = i;
        check.op = "desync check of " + i.op;
        cpu->agree(std::move(check));
      });
    }
    // Created inside a coalescing block: group this op with the rest of the block.
    std::lock_guard<std::mutex> clk(coalesceMu_);
    if (coalescing_) cuda_->startCoalescing();
  }
  return *cuda_;
}

std::shared_ptr<cuda::Device> MycclBackend::cudaDevice() {
  auto device = cudaEngine("ddp").deviceSeam();
  MYCCL_CHECK(device != nullptr, where("ddp"), ": the CUDA engine has no device seam");
  return device;
}

std::vector<Engine*> MycclBackend::engines() {
  std::vector<Engine*> out;
  if (cpu_) out.push_back(cpu_.get());
  std::lock_guard<std::mutex> lk(cudaMu_);
  if (cuda_) out.push_back(cuda_.get());
  return out;
}



// ---- collectives ---------------------------------------------------------------------------

WorkRef MycclBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("broadcast");
  const at::Tensor& t = single(w, tensors);
  Engine& e = engineFor("broadcast", tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  checkWritable(w, t, "tensor");
  auto i = info(OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, nullptr);
  return record(e.broadcast(std::move(i), t, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_reduce");
  MYCCL_CHECK_ARG(tensors.size() == 1, w, ": expected exactly one tensor, got ", tensors.size());
  if (tensors[0].defined() && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  Engine& e = engineFor("all_reduce", tensors);
  checkWritable(w, tensors[0], "tensor");
  auto red = toReduction(w, tensors[0], opts.reduceOp, size_, onDevice(tensors[0]));
  auto i = info(OpType::ALLREDUCE, "all_reduce", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e.allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::allreduceScaled(at::Tensor& tensor, double scale) {
  const auto w = where("all_reduce");
  MYCCL_CHECK_ARG(tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous() &&
                      (tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kDouble),
                  w, ": a scaled sum needs a contiguous float32/float64 CPU tensor, got ", describe(tensor));
  // Every other op on this tensor goes to the CUDA engine (the test double): a scaled sum on the
  // CPU engine would reduce it on another transport than its peers' ops.
  MYCCL_CHECK_ARG(!onDevice(tensor), w, ": a scaled sum runs on the CPU engine only, and this group sends ",
                  describe(tensor), " to the CUDA engine (MYCCL_TEST_CUDA_DOUBLE=1)");
  MYCCL_CHECK_ARG(scale != 0.0 && std::isfinite(scale), w, ": scale must be finite and non-zero, got ", scale);
  checkWritable(w, tensor, "tensor");
  const c10d::AllreduceOptions opts;
  auto red = toReduction(w, tensor, opts.reduceOp, size_, onDevice(tensor));
  red.spec.scale = scale;
  auto i = info(OpType::ALLREDUCE, "all_reduce", opts.timeout, true);
  annotate(i, tensor, -1, "SUM(scaled)");
  return record(cpuEngine("all_reduce").allreduce(std::move(i), {tensor}, red));
}

WorkRef MycclBackend::allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const auto w = where("all_reduce");
  const at::Tensor& t = single(w, tensors);
  MYCCL_CHECK_ARG(t.is_sparse() && t.device().is_cpu(), w, ": sparse all_reduce needs a sparse COO CPU tensor, got ",
                  describe(t));
  MYCCL_CHECK_ARG(opts.reduceOp.op_ == c10d::ReduceOp::SUM, w, ": sparse tensors support only ReduceOp.SUM, got ",
                  reduceOpName(opts.reduceOp.op_));
  // Sparse sum = all-gather every rank's (indices, values) and coalesce: the gathered sizes
  // differ per rank, so first agree on them.
  at::Tensor in = t.coalesce();
  const int64_t nnz = in._nnz();
  at::Tensor myCount = at::tensor({nnz}, at::kLong);
  std::vector<at::Tensor> counts;
  for (int r = 0; r < size_; ++r) counts.push_back(at::empty({1}, at::kLong));
  auto ci = info(OpType::_ALLREDUCE_SPARSE, "all_reduce(sparse):sizes", opts.timeout, opts.asyncOp);
  auto cw = cpuEngine("all_reduce").allgather(std::move(ci), {myCount}, {counts});
  cw->wait();
  std::vector<at::Tensor> idxOut, valOut;
  at::Tensor indices = in._indices().contiguous();
  at::Tensor values = in._values().contiguous();
  for (int r = 0; r < size_; ++r) {
    int64_t n = counts[r].item<int64_t>();
    idxOut.push_back(at::empty({indices.size(0), n}, indices.options()));
    auto vshape = values.sizes().vec();
    vshape[0] = n;
    valOut.push_back(at::empty(vshape, values.options()));
  }
  // Indices travel transposed so that each rank's block is one contiguous run of rows.
  std::vector<at::Tensor> idxRows;
  for (auto& x : idxOut) idxRows.push_back(at::empty({x.size(1), x.size(0)}, x.options()));
  auto gi = info(OpType::_ALLREDUCE_SPARSE, "all_reduce(sparse)", opts.timeout, opts.asyncOp);
  auto gw = cpuEngine("all_reduce").allgather(std::move(gi), {indices.t().contiguous(), values}, {idxRows, valOut});
  gw->wait();
  std::vector<at::Tensor> idxCols;
  for (auto& x : idxRows) idxCols.push_back(x.t());
  at::Tensor all = at::sparse_coo_tensor(at::cat(idxCols, 1), at::cat(valOut, 0), in.sizes()).coalesce();
  tensors[0].copy_(all);
  auto done = c10::make_intrusive<MycclWork>(gw->info(), std::vector<at::Tensor>{}, std::vector<at::Tensor>{tensors[0]});
  done->markDone();
  return record(done);
}

WorkRef MycclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_reduce_coalesced");
  Engine& e = engineFor("all_reduce_coalesced", tensors);
  for (size_t k = 0; k < tensors.size(); ++k) {
    checkSameDtype(w, tensors[0], tensors[k], ("tensor " + std::to_string(k)).c_str());
    checkWritable(w, tensors[k], "tensor");
  }
  auto red = toReduction(w, tensors[0], opts.reduceOp, size_, onDevice(tensors[0]));
  auto i = info(OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e.allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce");
  const at::Tensor& t = single(w, tensors);
  Engine& e = engineFor("reduce", tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  if (rank_ == opts.rootRank) checkWritable(w, t, "tensor");
  auto red = toReduction(w, t, opts.reduceOp, size_, onDevice(t));
  auto i = info(OpType::REDUCE, "reduce", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, reduceOpName(opts.reduceOp.op_));
  return record(e.reduce(std::move(i), t, red, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather");
  const at::Tensor& in = single(w, inputs, "input tensor");
  MYCCL_CHECK_ARG(outputs.size() == 1, w, ": expected one output list, got ", outputs.size());
  auto& outs = outputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(outs.size()) == size_, w, ": the output list has ", outs.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = outs;
  all.push_back(in);
  Engine& e = engineFor("all_gather", all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, in, outs[r], ("output " + std::to_string(r)).c_str());
    checkWritable(w, outs[r], "output");
  }
  MYCCL_CHECK_ARG(outs[rank_].numel() == in.numel(), w, ": output ", rank_, " (this rank's block) has ",
                  outs[rank_].numel(), " elements but the input has ", in.numel());
  auto i = info(OpType::ALLGATHER, "all_gather", opts.timeout, opts.asyncOp);
  annotate(i, in, -1, nullptr);
  return record(e.allgather(std::move(i), {in}, {outs}));
}

WorkRef MycclBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_into_tensor");
  Engine& e = engineFor("all_gather_into_tensor", {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(output.numel() == input.numel() * size_, w, ": output ", shapeOf(output), " has ", output.numel(),
                  " elements but must have input numel ", input.numel(), " x group size ", size_, " = ",
                  input.numel() * size_);
  auto outs = blocks(w, output, size_, input.numel(), "output");
  auto i = info(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, nullptr);
  return record(e.allgather(std::move(i), {input}, {outs}));
}

WorkRef MycclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                          std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_coalesced");
  MYCCL_CHECK_ARG(!inputs.empty(), w, ": expected at least one input tensor");
  MYCCL_CHECK_ARG(static_cast<int>(outputLists.size()) == size_, w, ": expected one output list per rank (", size_,
                  "), got ", outputLists.size());
  std::vector<at::Tensor> all = inputs;
  for (int r = 0; r < size_; ++r) {
    MYCCL_CHECK_ARG(outputLists[r].size() == inputs.size(), w, ": output list ", r, " has ", outputLists[r].size(),
                    " tensors but there are ", inputs.size(), " inputs");
    all.insert(all.end(), outputLists[r].begin(), outputLists[r].end());
  }
  Engine& e = engineFor("all_gather_coalesced", all);
  // outputLists[r][k] receives rank r's inputs[k]: regroup per input.
  std::vector<std::vector<at::Tensor>> per(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    for (int r = 0; r < size_; ++r) {
      const auto& o = outputLists[r][k];
      checkSameDtype(w, inputs[k], o, "output");
      checkWritable(w, o, "output");
      per[k].push_back(o);
    }
    MYCCL_CHECK_ARG(per[k][rank_].numel() == inputs[k].numel(), w, ": output ", rank_, "/", k, " has ",
                    per[k][rank_].numel(), " elements but input ", k, " has ", inputs[k].numel());
  }
  auto i = info(OpType::ALLGATHER_COALESCED, "all_gather_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e.allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_into_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  Engine& e = engineFor("all_gather_into_tensor_coalesced", all);
  std::vector<std::vector<at::Tensor>> per;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkSameDtype(w, inputs[k], outputs[k], "output");
    checkWritable(w, outputs[k], "output");
    MYCCL_CHECK_ARG(outputs[k].numel() == inputs[k].numel() * size_, w, ": output ", k, " has ", outputs[k].numel(),
                    " elements but must have ", inputs[k].numel() * size_);
    per.push_back(blocks(w, outputs[k], size_, inputs[k].numel(), "output"));
  }
  auto i = info(compat::kAllgatherIntoTensorCoalesced, "all_gather_into_tensor_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e.allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::GatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("gather");
  const at::Tensor& in = single(w, inputs, "input tensor");
  checkRoot(w, opts.rootRank, size_);
  std::vector<at::Tensor> all = {in};
  std::vector<at::Tensor> outs;
  if (rank_ == opts.rootRank) {
    MYCCL_CHECK_ARG(outputs.size() == 1, w, ": the root needs one output list, got ", outputs.size());
    outs = outputs[0];
    MYCCL_CHECK_ARG(static_cast<int>(outs.size()) == size_, w, ": the output list has ", outs.size(),
                    " tensors but the group has ", size_, " ranks");
    for (int r = 0; r < size_; ++r) {
      checkSameDtype(w, in, outs[r], "output");
      checkWritable(w, outs[r], "output");
    }
    MYCCL_CHECK_ARG(outs[rank_].numel() == in.numel(), w, ": output ", rank_, " has ", outs[rank_].numel(),
                    " elements but the input has ", in.numel());
    all.insert(all.end(), outs.begin(), outs.end());
  } else {
    MYCCL_CHECK_ARG(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), w,
                    ": only the root (rank ", opts.rootRank, ") may pass output tensors");
  }
  Engine& e = engineFor("gather", all);
  auto i = info(OpType::GATHER, "gather", opts.timeout, opts.asyncOp);
  annotate(i, in, opts.rootRank, nullptr);
  return record(e.gather(std::move(i), in, outs, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("scatter");
  const at::Tensor& out = single(w, outputs, "output tensor");
  checkRoot(w, opts.rootRank, size_);
  checkWritable(w, out, "output");
  std::vector<at::Tensor> all = {out};
  std::vector<at::Tensor> ins;
  if (rank_ == opts.rootRank) {
    MYCCL_CHECK_ARG(inputs.size() == 1, w, ": the root needs one input list, got ", inputs.size());
    ins = inputs[0];
    MYCCL_CHECK_ARG(static_cast<int>(ins.size()) == size_, w, ": the input list has ", ins.size(),
                    " tensors but the group has ", size_, " ranks");
    for (int r = 0; r < size_; ++r) checkSameDtype(w, out, ins[r], "input");
    MYCCL_CHECK_ARG(ins[rank_].numel() == out.numel(), w, ": input ", rank_, " has ", ins[rank_].numel(),
                    " elements but the output has ", out.numel());
    all.insert(all.end(), ins.begin(), ins.end());
  } else {
    MYCCL_CHECK_ARG(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), w,
                    ": only the root (rank ", opts.rootRank, ") may pass input tensors");
  }
  Engine& e = engineFor("scatter", all);
  auto i = info(OpType::SCATTER, "scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, opts.rootRank, nullptr);
  return record(e.scatter(std::move(i), ins, out, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter");
  const at::Tensor& out = single(w, outputs, "output tensor");
  MYCCL_CHECK_ARG(inputs.size() == 1, w, ": expected one input list, got ", inputs.size());
  auto& ins = inputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(ins.size()) == size_, w, ": the input list has ", ins.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = ins;
  all.push_back(out);
  Engine& e = engineFor("reduce_scatter", all);
  checkWritable(w, out, "output");
  for (int r = 0; r < size_; ++r) checkSameDtype(w, out, ins[r], "input");
  MYCCL_CHECK_ARG(ins[rank_].numel() == out.numel(), w, ": input ", rank_, " has ", ins[rank_].numel(),
                  " elements but the output has ", out.numel());
  auto red = toReduction(w, out, opts.reduceOp, size_, onDevice(out));
  auto i = info(OpType::REDUCE_SCATTER, "reduce_scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, -1, reduceOpName(opts.reduceOp.op_));
  return record(e.reduceScatter(std::move(i), {ins}, {out}, red));
}

WorkRef MycclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter_tensor");
  Engine& e = engineFor("reduce_scatter_tensor", {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(input.numel() == output.numel() * size_, w, ": input ", shapeOf(input), " has ", input.numel(),
                  " elements but must have output numel ", output.numel(), " x group size ", size_, " = ",
                  output.numel() * size_);
  auto red = toReduction(w, output, opts.reduceOp, size_, onDevice(output));
  auto ins = blocks(w, input, size_, output.numel(), "input");
  auto i = info(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, reduceOpName(opts.reduceOp.op_));
  return record(e.reduceScatter(std::move(i), {ins}, {output}, red, {input}));
}

WorkRef MycclBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  Engine& e = engineFor("reduce_scatter_tensor_coalesced", all);
  std::vector<std::vector<at::Tensor>> per;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkSameDtype(w, inputs[0], inputs[k], "input");
    checkSameDtype(w, inputs[k], outputs[k], "output");
    checkWritable(w, outputs[k], "output");
    MYCCL_CHECK_ARG(inputs[k].numel() == outputs[k].numel() * size_, w, ": input ", k, " has ", inputs[k].numel(),
                    " elements but must have ", outputs[k].numel() * size_);
    per.push_back(blocks(w, inputs[k], size_, outputs[k].numel(), "input"));
  }
  auto red = toReduction(w, outputs[0], opts.reduceOp, size_, onDevice(outputs[0]));
  auto i = info(compat::kReduceScatterTensorCoalesced, "reduce_scatter_tensor_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e.reduceScatter(std::move(i), per, outputs, red, inputs));
}

WorkRef MycclBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_to_all_single");
  Engine& e = engineFor("all_to_all_single", {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  auto splitsFor = [&](const at::Tensor& t, std::vector<int64_t> splits, const char* what) {
    if (t.dim() == 0) {
      MYCCL_CHECK_ARG(false, w, ": ", what, " must have at least one dimension");
    }
    const int64_t rows = t.size(0);
    if (splits.empty()) {
      MYCCL_CHECK_ARG(rows % size_ == 0, w, ": ", what, " has ", rows, " rows, not divisible by the group size ",
                      size_, "; pass split sizes for uneven exchanges");
      splits.assign(size_, rows / size_);
    }
    MYCCL_CHECK_ARG(static_cast<int>(splits.size()) == size_, w, ": ", what, " split sizes have ", splits.size(),
                    " entries but the group has ", size_, " ranks");
    int64_t sum = 0;
    for (size_t r = 0; r < splits.size(); ++r) {
      MYCCL_CHECK_ARG(splits[r] >= 0, w, ": ", what, " split size for rank ", r, " is negative (", splits[r], ")");
      sum += splits[r];
    }
    MYCCL_CHECK_ARG(sum == rows, w, ": ", what, " split sizes sum to ", sum, " but the tensor has ", rows,
                    " rows (first dimension)");
    std::vector<at::Tensor> parts;
    parts.reserve(size_);
    int64_t off = 0;
    for (int r = 0; r < size_; ++r) {
      parts.push_back(rowSlice(t, off, splits[r]));
      off += splits[r];
    }
    return parts;
  };
  auto ins = splitsFor(input, inputSplits, "input");
  auto outs = splitsFor(output, outputSplits, "output");
  MYCCL_CHECK_ARG(ins[rank_].numel() == outs[rank_].numel(), w, ": this rank sends ", ins[rank_].numel(),
                  " elements to itself but expects ", outs[rank_].numel());
  auto i = info(OpType::ALLTOALL_BASE, "all_to_all_single", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, nullptr);
  return record(e.alltoall(std::move(i), ins, outs, {input}));
}

WorkRef MycclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_to_all");
  MYCCL_CHECK_ARG(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_, w,
                  ": expected ", size_, " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  Engine& e = engineFor("all_to_all", all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, inputs[0], inputs[r], "input");
    checkSameDtype(w, inputs[0], outputs[r], "output");
    checkWritable(w, outputs[r], "output");
  }
  MYCCL_CHECK_ARG(inputs[rank_].numel() == outputs[rank_].numel(), w, ": this rank sends ", inputs[rank_].numel(),
                  " elements to itself but expects ", outputs[rank_].numel());
  auto i = info(OpType::ALLTOALL, "all_to_all", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e.alltoall(std::move(i), inputs, outputs));
}

std::optional<at::Device> MycclBackend::barrierDevice(const c10d::BarrierOptions& opts) {
  // torch's Python fills BarrierOptions::device, but its dispatcher op passes only device_ids on.
  if (opts.device.has_value() && (opts.device->is_cuda() || cfg_.testCudaDouble)) return opts.device;
  if (!opts.device_ids.empty()) {
    const int64_t id = opts.device_ids.front();
    MYCCL_CHECK_ARG(id >= 0, where("barrier"), ": device_ids[0] must be a CUDA device index, got ", id);
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(id));
  }
  if (auto bound = getBoundDeviceId(); bound.has_value() && bound->is_cuda()) return bound;
  std::lock_guard<std::mutex> lk(cudaMu_);
  if (cuda_) {
    const int last = cuda_->lastDevice();
    if (last >= 0) return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(last));
  }
  // The double has no CPU tensors of its own: its barrier is the CUDA engine's, on the current device.
  if (cfg_.testCudaDouble) return at::Device(at::kCUDA);
  return std::nullopt;
}

WorkRef MycclBackend::barrier(const c10d::BarrierOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto device = barrierDevice(opts);
  MYCCL_CHECK_ARG(!device.has_value() || cudaEngineBuilt() || cfg_.testCudaDouble, where("barrier"),
                  ": a barrier on ", *device, " needs the NCCL engine, which this build does not have");
  auto i = info(OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp);
  // On a device the barrier also orders the device's streams: every rank's kernel must meet.
  if (device.has_value()) return record(cudaEngine("barrier").barrier(std::move(i), *device));
  return record(cpuEngine("barrier").barrier(std::move(i), at::kCPU));
}

void MycclBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  auto i = info(OpType::BARRIER, "monitored_barrier", opts.timeout, false, true);
  cpuEngine("monitored_barrier").monitoredBarrier(i, ++monitoredSeq_, waitAllRanks);
}

// ---- point-to-point ------------------------------------------------------------------------

WorkRef MycclBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("send");
  const at::Tensor& t = single(w, tensors);
  Engine& e = engineFor("send", tensors);
  checkPeer(w, dstRank, rank_, size_, isCuda("send", tensors));
  auto i = info(OpType::SEND, "send", c10d::kUnsetTimeout, true, true);
  annotate(i, t, dstRank, nullptr);
  i.op = "send to " + std::to_string(dstRank) + " tag " + std::to_string(tag);
  return record(e.send(std::move(i), t, dstRank, tag));
}

WorkRef MycclBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("recv");
  const at::Tensor& t = single(w, tensors);
  Engine& e = engineFor("recv", tensors);
  checkPeer(w, srcRank, rank_, size_, isCuda("recv", tensors));
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECV, "recv", c10d::kUnsetTimeout, true, true);
  annotate(i, t, srcRank, nullptr);
  i.op = "recv from " + std::to_string(srcRank) + " tag " + std::to_string(tag);
  return record(e.recv(std::move(i), t, srcRank, tag));
}

WorkRef MycclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("recv_any_source");
  const at::Tensor& t = single(w, tensors);
  MYCCL_CHECK_ARG(!isCuda("recv_any_source", tensors), w, ": receive-from-any-source is supported for CPU tensors only (NCCL has no wildcard receive)");
  MYCCL_CHECK_ARG(size_ > 1, w, ": a group of one rank has nobody to receive from");
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECVANYSOURCE, "recv_any_source", c10d::kUnsetTimeout, true, true);
  annotate(i, t, -1, nullptr);
  i.op = "recv from any tag " + std::to_string(tag);
  return record(cpuEngine("recv_any_source").recvAny(std::move(i), t, tag));
}

// ---- coalescing, state ---------------------------------------------------------------------

void MycclBackend::abandonCoalescing(const std::string& why) {
  std::vector<WorkRef> held;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    if (!coalescing_) return;
    coalescing_ = false;
    held.swap(coalesced_);
  }
  logOnce("coalescing-abandoned", LogLevel::Warning,
          "group '" + group_ + "': a coalescing block was left without end_coalescing (" + why +
              "); its held CUDA ops are dropped and later ops run on their own");
  for (Engine* e : engines()) {
    try {
      e->startCoalescing();  // drops whatever the engine held back ...
      (void)e->endCoalescing(info(OpType::COALESCED, "coalesced", c10d::kUnsetTimeout, true, true));
    } catch (...) {
      // ... and issuing nothing cannot fail in a way the caller could act on.
    }
  }
}

void MycclBackend::startCoalescing() {
  bool open;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    open = coalescing_;
  }
  if (open) abandonCoalescing("a new block started before the previous one ended");
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    coalescing_ = true;
    coalesced_.clear();
  }
  for (Engine* e : engines()) e->startCoalescing();
}

WorkRef MycclBackend::endCoalescing() {
  std::vector<WorkRef> works;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    MYCCL_CHECK(coalescing_, where("end_coalescing"), ": end_coalescing without start_coalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  auto i = info(OpType::COALESCED, "coalesced", c10d::kUnsetTimeout, true, true);
  std::vector<WorkRef> cpuWorks;
  WorkRef cudaBatch;
  for (Engine* e : engines()) {
    if (auto held = e->endCoalescing(i)) cudaBatch = held;
  }
  if (cudaBatch) {
    // The CUDA engine's batch Work covers every CUDA op of the block and keeps its Future
    // CUDA-aware; only CPU ops of the same block need combining with it.
    for (auto& w : works) {
      auto* mw = dynamic_cast<MycclWork*>(w.get());
      if (!mw || !mw->onDevice()) cpuWorks.push_back(w);
    }
    if (cpuWorks.empty()) return record(cudaBatch);
    cpuWorks.push_back(cudaBatch);
    return record(combineWorks(std::move(i), std::move(cpuWorks)));
  }
  return record(combineWorks(std::move(i), std::move(works)));
}

void MycclBackend::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda() && (cudaEngineBuilt() || cfg_.testCudaDouble)) cudaEngine("eager_connect").eagerConnect(device);
}

#if MYCCL_TORCH_AT_LEAST(2, 14)
void MycclBackend::setBoundDeviceId(std::optional<at::Device> device) {
  c10d::Backend::setBoundDeviceId(device);
  if (device.has_value()) eagerConnectSingleDevice(*device);
}
#endif

void MycclBackend::setTimeout(std::chrono::milliseconds timeout) {
  MYCCL_CHECK_ARG(timeout.count() > 0, where("set_timeout"), ": timeout must be positive, got ", timeout.count(), " ms");
  timeout_ = timeout;
  for (Engine* e : engines()) e->setTimeout(timeout);
}

c10d::ErrorType MycclBackend::getError() {
  for (Engine* e : engines())
    if (e->failed()) return e->timedOut() ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR;
  return c10d::ErrorType::SUCCESS;
}

void MycclBackend::abort() {
  shutdown_ = true;
  for (Engine* e : engines()) e->abort("aborted by ProcessGroup.abort() on rank " + std::to_string(rank_));
}

void MycclBackend::shutdown() {
  if (shutdown_.exchange(true)) return;
  for (Engine* e : engines()) e->shutdown();
}

std::string MycclBackend::describeLinks() const {
  return cpu_ ? cpu_->describeLinks() : std::string();
}

}  // namespace myccl
