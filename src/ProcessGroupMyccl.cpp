// MycclBackend: argument checks and routing only. Everything that can be checked locally is
// checked here, on the caller's thread, before any peer is involved, so a bad call raises a
// ValueError naming the op, the rank and the value, and never leaves peers half-way in an op.
#include "myccl/ProcessGroupMyccl.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <sys/mman.h>

#include <cmath>
#include <numeric>
#include <sstream>
#include <typeinfo>

#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/TorchCompat.hpp"
#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/transport/Net.hpp"
#include "myccl/cpu/transport/Shm.hpp"
#include "myccl/cpu/transport/Tcp.hpp"
#ifdef MYCCL_WITH_NCCL
#include "myccl/cuda/NcclEngine.hpp"
#endif

namespace myccl {

using c10d::OpType;
using WorkRef = c10::intrusive_ptr<c10d::Work>;

namespace {

// torch's Python names ("float32"), which is what users read in traces and errors.
std::string dtypeName(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kComplexHalf: return "complex32";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    default: return c10::toString(st);
  }
}


// "[4, 1024]" -- on every op (flight recorder), so no stream machinery.
std::string shapeOf(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d) s += ", ";
    s += std::to_string(t.size(d));
  }
  return s + "]";
}

std::string describe(const at::Tensor& t) {
  return dtypeName(t.scalar_type()) + shapeOf(t) + " on " + t.device().str();
}

DType toDType(at::ScalarType st, const std::string& where) {
  switch (st) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kShort: return DType::I16;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kBool: return DType::Bool;
    case at::kComplexFloat: return DType::C64;
    case at::kComplexDouble: return DType::C128;
    default: break;
  }
  MYCCL_CHECK_ARG(false, where, ": reductions are not supported for dtype ", dtypeName(st),
                  " (supported: float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8, bool, "
                  "complex64, complex128)");
}

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// What the flight recorder, traces and cross-rank checks say about an op.
void annotate(OpInfo& i, const at::Tensor& t, int64_t root, const char* redop) {
  i.dtype = dtypeName(t.scalar_type());
  i.shape = shapeOf(t);
  i.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  i.root = root;
  if (redop) i.redop = redop;
}

// Every rank commits up to ShmGroup::kMailboxSlots slots of this size per local peer.
constexpr int64_t kMaxMailboxSlotBytes = 4 << 20;

}  // namespace

MycclBackend::MycclBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout, std::string groupName, std::vector<int64_t> globalRanks,
                           Config cfg)
    : Backend(rank, size),
      group_(std::move(groupName)),
      globalRanks_(std::move(globalRanks)),
      cfg_(std::move(cfg)),
      timeout_(timeout),
      store_(store) {
  MYCCL_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, "init: rank ", rank, " is not in [0, ", size, ")");
  // A fresh key space per incarnation: a store reused across destroy/init never serves a
  // previous group's addresses or secret.
  const int64_t ticket = store_->add("myccl/incarnation", 1);
  const std::string prefix = "myccl/" + std::to_string((ticket - 1) / size) + "/";
  keyPrefix_ = prefix;
  topo_ = Topology::exchange(*store_, prefix, rank, size, cpu::hostIdentity(cfg_.hostId));

  // The group's secret: every connection must present it before any data is accepted.
  std::string token;
  if (rank == 0) {
    token = cpu::randomHex(16);
    store_->set(prefix + "secret", std::vector<uint8_t>(token.begin(), token.end()));
  } else {
    auto v = store_->get(prefix + "secret");
    token.assign(v.begin(), v.end());
  }
  cpu::TcpSetup setup;
  setup.rank = rank;
  setup.size = size;
  setup.timeout = timeout;
  setup.eagerBytes = cfg_.tcpEagerBytes;
  setup.localEagerBytes = cfg_.localEagerBytes;
  setup.copyThreads = cfg_.copyThreads;
  setup.socketsPerPeer = cfg_.socketsPerPeer;
  setup.connectDelay = std::chrono::milliseconds(cfg_.testConnectDelayMs);
  // Ranks that all live on one host talk over loopback unless told otherwise; nothing else on
  // the network can even reach the listener then.
  setup.bindAddress = (topo_.singleHost() && cfg_.socketIfname.empty())
                          ? "127.0.0.1"
                          : cpu::chooseListenAddress(cfg_.socketIfname, cfg_.masterAddr);
  // Large messages between ranks of this host are copied straight from the sender's memory,
  // unless TCP was asked for everywhere.
  if (cfg_.transport != "tcp") {
    setup.directPeers.resize(size);
    for (int r = 0; r < size; ++r) setup.directPeers[r] = r != rank && topo_.sameHost(rank, r);
  }
  std::shared_ptr<cpu::ShmGroup> shm;
  // Shared memory among this host's ranks of the group (all of them, or one level of a
  // hierarchical group that spans hosts).
  if (topo_.localSize > 1 && cfg_.transport != "tcp") {
    cpu::ShmGroup::Options so;
    so.rank = topo_.localRank;
    so.groupRanks = topo_.localRanks;
    so.stagingBytes = static_cast<size_t>(cfg_.shmBufferBytes);
    so.spinUs = cfg_.spinUs;
    so.timeout = timeout;
    // Mailbox slots for local messages up to the eager limit (kMaxMailboxSlotBytes at most:
    // every rank commits kMailboxSlots of them per local peer).
    so.mailboxSlotBytes = static_cast<size_t>(std::clamp<int64_t>(cfg_.localEagerBytes, 0, kMaxMailboxSlotBytes));
    try {
      shm = std::make_shared<cpu::ShmGroup>(*store_, prefix, so);
    } catch (const cpu::ShmUnavailable& e) {
      MYCCL_CHECK(cfg_.transport != "shm", "init (rank ", rank, "): MYCCL_TRANSPORT=shm but shared memory is unavailable: ",
                  e.what());
      logOnce("shm-unavailable", LogLevel::Warning,
              std::string("shared memory unavailable (") + e.what() + "); using TCP between local ranks");
    }
  }
  MYCCL_CHECK_ARG(cfg_.transport != "shm" || topo_.singleHost(), "init (rank ", rank,
                  "): MYCCL_TRANSPORT=shm but the group spans ", topo_.crossSize, " hosts");
  // Made after shared memory, which it may use for local messages: its epoll thread starts
  // with the mailbox in place, so no announcement can arrive before there is one.
  if (shm && shm->mailboxSlotBytes() > 0) setup.mailbox = std::make_shared<cpu::ShmMailbox>(shm);
  auto transport = std::make_shared<cpu::TcpTransport>(*store_, prefix + "tcp/", setup, token);
  recorder_ = std::make_shared<Recorder>(group_, rank, size,
                                         static_cast<size_t>(std::max<int64_t>(0, cfg_.flightRecorderEntries)),
                                         cfg_.flightRecorderDump);
  RecorderRegistry::get().add(recorder_);
  if (cfg_.flightRecorderEntries > 0) RecorderRegistry::get().installSignalHandler();
  const bool viaShm = shm != nullptr;
  cpu_ = std::make_unique<cpu::CpuEngine>(std::move(transport), std::move(shm), topo_, group_, cfg_, recorder_);
  if (logEnabled(LogLevel::Info)) {
    log(LogLevel::Info, "group '" + group_ + "' rank " + std::to_string(rank) + "/" + std::to_string(size) + ": " +
                            std::to_string(topo_.crossSize) + " host(s), collectives over " +
                            (viaShm ? "shared memory" : "TCP") + ", TCP listener on " + setup.bindAddress);
  }
  init();
}

MycclBackend::~MycclBackend() {
  if (recorder_) RecorderRegistry::get().retire(recorder_);
  if (!shutdown_.exchange(true)) {
    // Destroyed without shutdown(): stop threads and sockets without waiting for peers.
    if (cpu_) cpu_->abort("process group destroyed");
#ifdef MYCCL_WITH_NCCL
    if (nccl_) nccl_->abort("process group destroyed");
#endif
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
  i.group = group_;
  i.timeout = (timeout == c10d::kUnsetTimeout) ? timeout_.load() : timeout;
  return i;
}

WorkRef MycclBackend::record(WorkRef w) {
  std::lock_guard<std::mutex> lk(coalesceMu_);
  if (coalescing_) coalesced_.push_back(w);
  return w;
}

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
  if (first.is_cpu()) return false;
  MYCCL_CHECK_ARG(first.is_cuda(), where(op), ": tensors on ", first, " are not supported (cpu and cuda only)");
#ifdef MYCCL_WITH_NCCL
  return true;
#else
  MYCCL_CHECK_ARG(false, where(op), ": got a CUDA tensor (", describe(tensors[0]),
                  ") but this myccl build has no NCCL engine; rebuild with MYCCL_WITH_NCCL=1 against a CUDA build "
                  "of torch");
#endif
}

at::Tensor MycclBackend::allocateTensor(long size, at::TensorOptions options) {
  MYCCL_CHECK_ARG(size >= 0, where("allocate_tensor"), ": size must be >= 0, got ", size);
  MYCCL_CHECK_ARG(!options.has_device() || options.device().is_cpu(), where("allocate_tensor"),
                  ": only CPU tensors come from myccl's shared memory, got device ", options.device());
  return cpu_->allocateTensor(size, options);
}

at::Tensor MycclBackend::sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  const auto w = where("shared_tensor");
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    MYCCL_CHECK_ARG(shape[i] >= 0, w, ": dimension ", i, " is negative (", shape[i], ")");
    numel *= shape[i];
  }
  const size_t nbytes = std::max<size_t>(64, static_cast<size_t>(numel) * c10::elementSize(dtype));
  // Every rank calls this in the same order, so the counter names the same tensor everywhere.
  const std::string key = keyPrefix_ + "shared/" + std::to_string(++sharedCount_) + "/host" +
                          std::to_string(topo_.crossRank);
  std::shared_ptr<cpu::ShmSegment> seg;
  if (topo_.localRank == 0) {
    seg = cpu::ShmSegment::create(nbytes);
    store_->set(key, std::vector<uint8_t>(seg->name().begin(), seg->name().end()));
  } else {
    auto v = store_->get(key);
    seg = cpu::ShmSegment::open(std::string(v.begin(), v.end()), nbytes);
  }
  // The last local rank to map it removes the name: nothing is left in /dev/shm.
  if (store_->add(key + "/mapped", 1) == topo_.localSize) shm_unlink(seg->name().c_str());
  return at::from_blob(seg->data(), shape, [seg](void*) {}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

bool MycclBackend::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
  // CPU (no device index): registered shared memory when the group uses it.
  return deviceIdx < 0 && usesSharedMemory();
}

std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> MycclBackend::stats() const {
  std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> out;
  for (auto& e : cpu_->stats().snapshot()) out.emplace_back(e.op, e.algo, e.count, e.bytes, e.seconds);
  return out;
}

void MycclBackend::resetStats() {
  cpu_->stats().reset();
}

int MycclBackend::rejectedConnections() const {
  auto* tcp = dynamic_cast<cpu::TcpTransport*>(&cpu_->transport());
  return tcp ? tcp->rejectedConnections() : 0;
}

bool MycclBackend::usesSharedMemory() const {
  return cpu_ && cpu_->usesSharedMemory();
}

cuda::NcclEngine& MycclBackend::nccl(const char* op) {
#ifdef MYCCL_WITH_NCCL
  std::lock_guard<std::mutex> lk(ncclMu_);
  if (!nccl_) {
    nccl_ = std::make_shared<cuda::NcclEngine>(store_, rank_, size_, group_, cfg_, timeout_.load());
    // Created inside a coalescing block: group this op with the rest of the block.
    std::lock_guard<std::mutex> clk(coalesceMu_);
    if (coalescing_) nccl_->startCoalescing();
  }
  return *nccl_;
#else
  MYCCL_CHECK(false, where(op), ": NCCL engine not built");
#endif
}

Reduction MycclBackend::reduction(const char* op, const at::Tensor& t, const c10d::ReduceOp& rop) const {
  const std::string w = where(op);
  Reduction r;
  r.spec.dtype = toDType(t.scalar_type(), w);
  const DType dt = r.spec.dtype;
  const bool floating = isFloating(dt), complex = isComplex(dt), boolean = dt == DType::Bool;
  const char* name = reduceOpName(rop.op_);
  auto reject = [&](const char* why) {
    MYCCL_CHECK_ARG(false, w, ": ReduceOp.", name, " is not defined for dtype ", dtypeName(t.scalar_type()), " (",
                    why, ")");
  };
  switch (rop.op_) {
    case c10d::ReduceOp::SUM: r.spec.op = RedOp::Sum; break;
    case c10d::ReduceOp::PRODUCT: r.spec.op = RedOp::Prod; break;
    case c10d::ReduceOp::AVG:
      if (boolean) reject("averaging booleans has no meaning; use SUM (logical or) or MIN (logical and)");
      r.spec.op = RedOp::Sum;
      r.spec.divisor = size_;
      break;
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      if (complex) reject("complex numbers are not ordered");
      r.spec.op = rop.op_ == c10d::ReduceOp::MIN ? RedOp::Min : RedOp::Max;
      break;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (floating || complex) reject("bitwise operators need an integer or bool dtype");
      r.spec.op = rop.op_ == c10d::ReduceOp::BAND ? RedOp::BAnd : rop.op_ == c10d::ReduceOp::BOR ? RedOp::BOr : RedOp::BXor;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!floating && !complex) reject("the pre-multiplication factor is a float");
      auto* sup = dynamic_cast<compat::PreMulSumSupplement*>(rop.supplement_.get());
      MYCCL_CHECK_ARG(sup != nullptr, w, ": ReduceOp.PREMUL_SUM without a factor; build it with "
                                       "torch.distributed._make_nccl_premul_sum(factor)");
      r.spec.op = RedOp::Sum;
      r.premul = true;
      if (sup->tensor_factor.defined()) {
        MYCCL_CHECK_ARG(sup->tensor_factor.numel() == 1, w, ": PREMUL_SUM factor must have one element, got ",
                        shapeOf(sup->tensor_factor));
        r.factor = sup->tensor_factor.to(at::kCPU).to(at::kDouble).item<double>();
      } else {
        r.factor = sup->double_factor;
      }
      break;
    }
    default:
      MYCCL_CHECK_ARG(false, w, ": unknown ReduceOp ", static_cast<int>(rop.op_));
  }
  return r;
}

namespace {

void checkRoot(const std::string& w, int64_t root, int size) {
  MYCCL_CHECK_ARG(root >= 0 && root < size, w, ": root ", root, " is not a rank of this group (size ", size, ")");
}

void checkPeer(const std::string& w, int peer, int rank, int size) {
  MYCCL_CHECK_ARG(peer >= 0 && peer < size, w, ": peer rank ", peer, " is not a rank of this group (size ", size, ")");
  MYCCL_CHECK_ARG(peer != rank, w, ": peer rank ", peer, " is this rank; myccl does not send to itself");
}

const at::Tensor& single(const std::string& w, const std::vector<at::Tensor>& ts, const char* what = "tensor") {
  MYCCL_CHECK_ARG(ts.size() == 1, w, ": expected exactly one ", what, ", got ", ts.size());
  return ts[0];
}

void checkWritable(const std::string& w, const at::Tensor& t, const char* what) {
  MYCCL_CHECK_ARG(at::has_internal_overlap(t) != at::MemOverlap::Yes, w, ": ", what, " ", shapeOf(t),
                  " has elements that share memory (e.g. from expand()); it cannot receive data");
}

void checkSameDtype(const std::string& w, const at::Tensor& ref, const at::Tensor& t, const char* what) {
  MYCCL_CHECK_ARG(t.scalar_type() == ref.scalar_type(), w, ": ", what, " has dtype ", dtypeName(t.scalar_type()),
                  " but the input has ", dtypeName(ref.scalar_type()), "; all tensors of one op must share a dtype");
}

// rowSlice(t, first, count): rows [first, first + count) of `t`, as t.narrow(0, first, count)
// gives them. For a contiguous plain CPU tensor the alias is built directly on the same storage:
// narrow() and view() go through the dispatcher and autograd's view bookkeeping (1-2 µs a block,
// made and freed on every call); at 4 ranks on 2 cores that was over a third of a small
// all_gather_into_tensor's CPU time. The alias carries no autograd history; the engine only
// reads its memory. Anything else (CUDA, subclasses, strided tensors) keeps narrow().
bool aliasable(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  return t.is_cpu() && t.layout() == at::kStrided && t.dim() > 0 && t.is_contiguous() &&
         typeid(*impl) == typeid(c10::TensorImpl) && !impl->is_python_dispatch() && t.has_storage();
}

// A contiguous tensor of `sizes` starting `offset` elements into contiguous `t` (aliasable).
at::Tensor alias(const at::Tensor& t, int64_t offset, at::IntArrayRef sizes) {
  auto a = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(), t.dtype());
  a->set_storage_offset(t.storage_offset() + offset);
  a->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(a));
}

at::Tensor rowSlice(const at::Tensor& t, int64_t first, int64_t count) {
  if (!aliasable(t)) return t.narrow(0, first, count);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= t.size(0), "rows [", first, ", ", first + count,
              ") out of range for ", t.size(0));
  std::vector<int64_t> sizes = t.sizes().vec();
  int64_t rowNumel = 1;
  for (size_t d = 1; d < sizes.size(); ++d) rowNumel *= sizes[d];
  sizes[0] = count;
  return alias(t, first * rowNumel, sizes);
}

// Row-major blocks of `t` for each rank: block r holds elements [r*n, (r+1)*n).
std::vector<at::Tensor> blocks(const std::string& w, const at::Tensor& t, int size, int64_t n, const char* what) {
  std::vector<at::Tensor> out;
  out.reserve(size);
  if (aliasable(t) && t.numel() >= static_cast<int64_t>(size) * n) {
    for (int r = 0; r < size; ++r) out.push_back(alias(t, r * n, {n}));
    return out;
  }
  if (t.is_contiguous() || t.dim() <= 1) {
    at::Tensor flat = t.is_contiguous() ? t.view({-1}) : t;
    for (int r = 0; r < size; ++r) out.push_back(rowSlice(flat, r * n, n));
    return out;
  }
  MYCCL_CHECK_ARG(t.size(0) % size == 0, w, ": non-contiguous ", what, " ", shapeOf(t),
                  " must have its first dimension divisible by the group size ", size);
  int64_t per = t.size(0) / size;
  for (int r = 0; r < size; ++r) out.push_back(t.narrow(0, r * per, per));
  return out;
}

}  // namespace

// ---- collectives ---------------------------------------------------------------------------

WorkRef MycclBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  const auto w = where("broadcast");
  const at::Tensor& t = single(w, tensors);
  [[maybe_unused]] const bool cuda = isCuda("broadcast", tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  checkWritable(w, t, "tensor");
  auto i = info(OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("broadcast").broadcast(std::move(i), t, opts.rootRank, opts.asyncOp));
#endif
  return record(cpu_->broadcast(std::move(i), t, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const auto w = where("all_reduce");
  MYCCL_CHECK_ARG(tensors.size() == 1, w, ": expected exactly one tensor, got ", tensors.size());
  if (tensors[0].defined() && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  [[maybe_unused]] const bool cuda = isCuda("all_reduce", tensors);
  checkWritable(w, tensors[0], "tensor");
  auto red = reduction("all_reduce", tensors[0], opts.reduceOp);
  auto i = info(OpType::ALLREDUCE, "all_reduce", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_reduce").allreduce(std::move(i), tensors, red, opts.asyncOp));
#endif
  return record(cpu_->allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::allreduceScaled(at::Tensor& tensor, double scale) {
  const auto w = where("all_reduce");
  MYCCL_CHECK_ARG(tensor.defined() && tensor.device().is_cpu() && tensor.is_contiguous() &&
                      (tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kDouble),
                  w, ": a scaled sum needs a contiguous float32/float64 CPU tensor, got ", describe(tensor));
  MYCCL_CHECK_ARG(scale != 0.0 && std::isfinite(scale), w, ": scale must be finite and non-zero, got ", scale);
  checkWritable(w, tensor, "tensor");
  const c10d::AllreduceOptions opts;
  auto red = reduction("all_reduce", tensor, opts.reduceOp);
  red.spec.scale = scale;
  auto i = info(OpType::ALLREDUCE, "all_reduce", opts.timeout, true);
  annotate(i, tensor, -1, "SUM(scaled)");
  return record(cpu_->allreduce(std::move(i), {tensor}, red));
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
  auto cw = cpu_->allgather(std::move(ci), {myCount}, {counts});
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
  auto gw = cpu_->allgather(std::move(gi), {indices.t().contiguous(), values}, {idxRows, valOut});
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
  const auto w = where("all_reduce_coalesced");
  [[maybe_unused]] const bool cuda = isCuda("all_reduce_coalesced", tensors);
  for (size_t k = 0; k < tensors.size(); ++k) {
    checkSameDtype(w, tensors[0], tensors[k], ("tensor " + std::to_string(k)).c_str());
    checkWritable(w, tensors[k], "tensor");
  }
  auto red = reduction("all_reduce_coalesced", tensors[0], opts.reduceOp);
  auto i = info(OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_reduce_coalesced").allreduce(std::move(i), tensors, red, opts.asyncOp));
#endif
  return record(cpu_->allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const auto w = where("reduce");
  const at::Tensor& t = single(w, tensors);
  [[maybe_unused]] const bool cuda = isCuda("reduce", tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  if (rank_ == opts.rootRank) checkWritable(w, t, "tensor");
  auto red = reduction("reduce", t, opts.reduceOp);
  auto i = info(OpType::REDUCE, "reduce", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("reduce").reduce(std::move(i), t, red, opts.rootRank, opts.asyncOp));
#endif
  return record(cpu_->reduce(std::move(i), t, red, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) {
  const auto w = where("all_gather");
  const at::Tensor& in = single(w, inputs, "input tensor");
  MYCCL_CHECK_ARG(outputs.size() == 1, w, ": expected one output list, got ", outputs.size());
  auto& outs = outputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(outs.size()) == size_, w, ": the output list has ", outs.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = outs;
  all.push_back(in);
  [[maybe_unused]] const bool cuda = isCuda("all_gather", all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, in, outs[r], ("output " + std::to_string(r)).c_str());
    checkWritable(w, outs[r], "output");
  }
  MYCCL_CHECK_ARG(outs[rank_].numel() == in.numel(), w, ": output ", rank_, " (this rank's block) has ",
                  outs[rank_].numel(), " elements but the input has ", in.numel());
  auto i = info(OpType::ALLGATHER, "all_gather", opts.timeout, opts.asyncOp);
  annotate(i, in, -1, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_gather").allgather(std::move(i), {in}, {outs}, opts.asyncOp));
#endif
  return record(cpu_->allgather(std::move(i), {in}, {outs}));
}

WorkRef MycclBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const auto w = where("all_gather_into_tensor");
  [[maybe_unused]] const bool cuda = isCuda("all_gather_into_tensor", {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(output.numel() == input.numel() * size_, w, ": output ", shapeOf(output), " has ", output.numel(),
                  " elements but must have input numel ", input.numel(), " x group size ", size_, " = ",
                  input.numel() * size_);
  auto outs = blocks(w, output, size_, input.numel(), "output");
  auto i = info(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_gather_into_tensor").allgather(std::move(i), {input}, {outs}, opts.asyncOp));
#endif
  return record(cpu_->allgather(std::move(i), {input}, {outs}));
}

WorkRef MycclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                          std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
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
  [[maybe_unused]] const bool cuda = isCuda("all_gather_coalesced", all);
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
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_gather_coalesced").allgather(std::move(i), inputs, per, opts.asyncOp));
#endif
  return record(cpu_->allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  const auto w = where("all_gather_into_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  [[maybe_unused]] const bool cuda = isCuda("all_gather_into_tensor_coalesced", all);
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
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_gather_into_tensor_coalesced").allgather(std::move(i), inputs, per, opts.asyncOp));
#endif
  return record(cpu_->allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::GatherOptions& opts) {
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
  [[maybe_unused]] const bool cuda = isCuda("gather", all);
  auto i = info(OpType::GATHER, "gather", opts.timeout, opts.asyncOp);
  annotate(i, in, opts.rootRank, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("gather").gather(std::move(i), in, outs, opts.rootRank, opts.asyncOp));
#endif
  return record(cpu_->gather(std::move(i), in, outs, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) {
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
  [[maybe_unused]] const bool cuda = isCuda("scatter", all);
  auto i = info(OpType::SCATTER, "scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, opts.rootRank, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("scatter").scatter(std::move(i), ins, out, opts.rootRank, opts.asyncOp));
#endif
  return record(cpu_->scatter(std::move(i), ins, out, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) {
  const auto w = where("reduce_scatter");
  const at::Tensor& out = single(w, outputs, "output tensor");
  MYCCL_CHECK_ARG(inputs.size() == 1, w, ": expected one input list, got ", inputs.size());
  auto& ins = inputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(ins.size()) == size_, w, ": the input list has ", ins.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = ins;
  all.push_back(out);
  [[maybe_unused]] const bool cuda = isCuda("reduce_scatter", all);
  checkWritable(w, out, "output");
  for (int r = 0; r < size_; ++r) checkSameDtype(w, out, ins[r], "input");
  MYCCL_CHECK_ARG(ins[rank_].numel() == out.numel(), w, ": input ", rank_, " has ", ins[rank_].numel(),
                  " elements but the output has ", out.numel());
  auto red = reduction("reduce_scatter", out, opts.reduceOp);
  auto i = info(OpType::REDUCE_SCATTER, "reduce_scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, -1, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("reduce_scatter").reduceScatter(std::move(i), {ins}, {out}, red, opts.asyncOp));
#endif
  return record(cpu_->reduceScatter(std::move(i), {ins}, {out}, red));
}

WorkRef MycclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) {
  const auto w = where("reduce_scatter_tensor");
  [[maybe_unused]] const bool cuda = isCuda("reduce_scatter_tensor", {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(input.numel() == output.numel() * size_, w, ": input ", shapeOf(input), " has ", input.numel(),
                  " elements but must have output numel ", output.numel(), " x group size ", size_, " = ",
                  output.numel() * size_);
  auto red = reduction("reduce_scatter_tensor", output, opts.reduceOp);
  auto ins = blocks(w, input, size_, output.numel(), "input");
  auto i = info(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("reduce_scatter_tensor").reduceScatter(std::move(i), {ins}, {output}, red, opts.asyncOp));
#endif
  return record(cpu_->reduceScatter(std::move(i), {ins}, {output}, red, {input}));
}

WorkRef MycclBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts) {
  const auto w = where("reduce_scatter_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  [[maybe_unused]] const bool cuda = isCuda("reduce_scatter_tensor_coalesced", all);
  std::vector<std::vector<at::Tensor>> per;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkSameDtype(w, inputs[0], inputs[k], "input");
    checkSameDtype(w, inputs[k], outputs[k], "output");
    checkWritable(w, outputs[k], "output");
    MYCCL_CHECK_ARG(inputs[k].numel() == outputs[k].numel() * size_, w, ": input ", k, " has ", inputs[k].numel(),
                    " elements but must have ", outputs[k].numel() * size_);
    per.push_back(blocks(w, inputs[k], size_, outputs[k].numel(), "input"));
  }
  auto red = reduction("reduce_scatter_tensor_coalesced", outputs[0], opts.reduceOp);
  auto i = info(compat::kReduceScatterTensorCoalesced, "reduce_scatter_tensor_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, reduceOpName(opts.reduceOp.op_));
#ifdef MYCCL_WITH_NCCL
  if (cuda)
    return record(nccl("reduce_scatter_tensor_coalesced").reduceScatter(std::move(i), per, outputs, red, opts.asyncOp));
#endif
  return record(cpu_->reduceScatter(std::move(i), per, outputs, red, inputs));
}

WorkRef MycclBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  const auto w = where("all_to_all_single");
  [[maybe_unused]] const bool cuda = isCuda("all_to_all_single", {input, output});
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
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_to_all_single").alltoall(std::move(i), ins, outs, opts.asyncOp));
#endif
  return record(cpu_->alltoall(std::move(i), ins, outs, {input}));
}

WorkRef MycclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) {
  const auto w = where("all_to_all");
  MYCCL_CHECK_ARG(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_, w,
                  ": expected ", size_, " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  [[maybe_unused]] const bool cuda = isCuda("all_to_all", all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, inputs[0], inputs[r], "input");
    checkSameDtype(w, inputs[0], outputs[r], "output");
    checkWritable(w, outputs[r], "output");
  }
  MYCCL_CHECK_ARG(inputs[rank_].numel() == outputs[rank_].numel(), w, ": this rank sends ", inputs[rank_].numel(),
                  " elements to itself but expects ", outputs[rank_].numel());
  auto i = info(OpType::ALLTOALL, "all_to_all", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("all_to_all").alltoall(std::move(i), inputs, outputs, opts.asyncOp));
#endif
  return record(cpu_->alltoall(std::move(i), inputs, outputs));
}

WorkRef MycclBackend::barrier(const c10d::BarrierOptions& opts) {
  auto i = info(OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp);
#ifdef MYCCL_WITH_NCCL
  // With an accelerator device the barrier must also order the device's streams.
  if (opts.device.has_value() && opts.device->is_cuda()) return record(nccl("barrier").barrier(std::move(i), *opts.device));
#endif
  return record(cpu_->barrier(std::move(i)));
}

// ---- point-to-point ------------------------------------------------------------------------

WorkRef MycclBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const auto w = where("send");
  const at::Tensor& t = single(w, tensors);
  [[maybe_unused]] const bool cuda = isCuda("send", tensors);
  checkPeer(w, dstRank, rank_, size_);
  auto i = info(OpType::SEND, "send", c10d::kUnsetTimeout, true, true);
  annotate(i, t, dstRank, nullptr);
  i.op = "send to " + std::to_string(dstRank) + " tag " + std::to_string(tag);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("send").send(std::move(i), t, dstRank));
#endif
  return record(cpu_->send(std::move(i), t, dstRank, tag));
}

WorkRef MycclBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const auto w = where("recv");
  const at::Tensor& t = single(w, tensors);
  [[maybe_unused]] const bool cuda = isCuda("recv", tensors);
  checkPeer(w, srcRank, rank_, size_);
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECV, "recv", c10d::kUnsetTimeout, true, true);
  annotate(i, t, srcRank, nullptr);
  i.op = "recv from " + std::to_string(srcRank) + " tag " + std::to_string(tag);
#ifdef MYCCL_WITH_NCCL
  if (cuda) return record(nccl("recv").recv(std::move(i), t, srcRank));
#endif
  return record(cpu_->recv(std::move(i), t, srcRank, tag));
}

WorkRef MycclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const auto w = where("recv_any_source");
  const at::Tensor& t = single(w, tensors);
  [[maybe_unused]] const bool cuda = isCuda("recv_any_source", tensors);
  MYCCL_CHECK_ARG(!cuda, w, ": receive-from-any-source is supported for CPU tensors only (NCCL has no wildcard receive)");
  MYCCL_CHECK_ARG(size_ > 1, w, ": a group of one rank has nobody to receive from");
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECVANYSOURCE, "recv_any_source", c10d::kUnsetTimeout, true, true);
  annotate(i, t, -1, nullptr);
  i.op = "recv from any tag " + std::to_string(tag);
  return record(cpu_->recvAny(std::move(i), t, tag));
}

// ---- coalescing, state ---------------------------------------------------------------------

void MycclBackend::startCoalescing() {
  std::lock_guard<std::mutex> lk(coalesceMu_);
  MYCCL_CHECK(!coalescing_, where("start_coalescing"), ": already coalescing (nested coalescing is not supported)");
  coalescing_ = true;
  coalesced_.clear();
#ifdef MYCCL_WITH_NCCL
  if (nccl_) nccl_->startCoalescing();
#endif
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
#ifdef MYCCL_WITH_NCCL
  if (nccl_) works.push_back(nccl_->endCoalescing(i));
#endif
  return combineWorks(std::move(i), std::move(works));
}

void MycclBackend::eagerConnectSingleDevice(at::Device device) {
#ifdef MYCCL_WITH_NCCL
  if (device.is_cuda()) nccl("eager_connect").eagerConnect(device);
#endif
}

void MycclBackend::setTimeout(std::chrono::milliseconds timeout) {
  MYCCL_CHECK_ARG(timeout.count() > 0, where("set_timeout"), ": timeout must be positive, got ", timeout.count(), " ms");
  timeout_ = timeout;
#ifdef MYCCL_WITH_NCCL
  if (nccl_) nccl_->setTimeout(timeout);
#endif
}

c10d::ErrorType MycclBackend::getError() {
  if (cpu_ && cpu_->failed()) return cpu_->timedOut() ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR;
#ifdef MYCCL_WITH_NCCL
  if (nccl_ && nccl_->failed()) return nccl_->timedOut() ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR;
#endif
  return c10d::ErrorType::SUCCESS;
}

void MycclBackend::abort() {
  shutdown_ = true;
  if (cpu_) cpu_->abort("aborted by ProcessGroup.abort() on rank " + std::to_string(rank_));
#ifdef MYCCL_WITH_NCCL
  if (nccl_) nccl_->abort("aborted by ProcessGroup.abort()");
#endif
}

void MycclBackend::shutdown() {
  if (shutdown_.exchange(true)) return;
  if (cpu_) cpu_->shutdown();
#ifdef MYCCL_WITH_NCCL
  if (nccl_) nccl_->shutdown();
#endif
}

std::string MycclBackend::describeLinks() const {
  std::ostringstream os;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    os << "rank " << r << ": " << cpu_->transport().describePeer(r) << "\n";
  }
  return os.str();
}

}  // namespace myccl
