// MycclBackend's life: construction (the CPU engine, the flight recorder, SIGUSR1), the CUDA
// engine's recipe, timeouts, errors, abort and shutdown, and what c10d_ext asks of a group
// (topology, stats, link model, memory).
#include <random>

#include "myccl/Arguments.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"
#include "myccl/cpu/Engine.hpp"

namespace myccl {

namespace {

// 64 random bits in hex: tells this process's instance of a group from any other's.
std::string randomNonce() {
  std::random_device rd;
  char buf[24];
  snprintf(buf, sizeof(buf), "%08x%08x", rd(), rd());
  return buf;
}

}  // namespace

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
  auto recorder = makeRecorder(rank, size);
  // In the reconfigure regime the group holds no links until reconfigure() names its members.
  std::shared_ptr<cpu::CpuEngine> cpu;
  if (makeCpu) {
    cpu = makeCpu(recorder);
  } else if (!reconfigurable) {
    cpu = std::make_shared<cpu::CpuEngine>(store_, rank, size, timeout, group_, cfg_, recorder, keyPrefix);
  }
  if (cpu) cpu->setAbortHooks(abortHooks_);  // before any op can fail
  engines_.init(std::move(cpu), recorder, cudaMaker());
  nonce_ = randomNonce();
  RecorderRegistry::get().add(recorder);  // once the group is up: a failed init leaves nothing
  if (cfg_.flightRecorder > 0) RecorderRegistry::get().installSignalHandler();
  init();
}

Engines::CudaMaker MycclBackend::cudaMaker() {
  return [this](const char* where, cpu::CpuEngine* cpu, std::shared_ptr<Recorder> recorder) {
    auto cuda = makeCudaEngine(where, store_, cpu->keyPrefix(), rank_, size_, group_, cfg_, timeout_.load(),
                               abortHooks_, std::move(recorder));
    if (cfg_.debug && size_ > 1) {
      cuda->setAgreement([cpu](const OpInfo& i) {
        OpInfo check = i;
        check.op = "desync check of " + i.op;
        cpu->agree(std::move(check));
      });
    }
    // Made inside a coalescing block: this op joins the rest of the block.
    std::lock_guard<std::mutex> lk(coalesceMu_);
    if (coalescing_) cuda->startCoalescing();
    return cuda;
  };
}

std::shared_ptr<Recorder> MycclBackend::makeRecorder(int rank, int size) const {
  return std::make_shared<Recorder>(group_, rank, size, static_cast<size_t>(std::max<int64_t>(0, cfg_.flightRecorder)),
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

MycclBackend::~MycclBackend() {
  if (auto r = engines_.recorder()) RecorderRegistry::get().retire(r);
  if (!shutdown_.exchange(true)) {
    // Destroyed without shutdown(): stop threads and sockets without waiting for peers.
    for (auto& e : engines_.all()) e->abort("process group destroyed");
  }
}

c10::intrusive_ptr<c10d::Backend::Options> MycclBackend::getBackendOptions() {
  auto o = c10::make_intrusive<Options>("myccl", timeout_.load());
  o->group_name = group_;
  for (auto r : globalRanks_) o->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  return o;
}

void MycclBackend::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda() && cudaEngineAvailable())
    engines_.cuda(where("eager_connect"))->eagerConnect(device);
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
  for (auto& e : engines_.all()) e->setTimeout(timeout);
}

c10d::ErrorType MycclBackend::getError() {
  for (auto& e : engines_.all())
    if (e->failed()) return e->timedOut() ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR;
  return c10d::ErrorType::SUCCESS;
}

void MycclBackend::abort() {
  shutdown_ = true;
  for (auto& e : engines_.all()) e->abort("aborted by ProcessGroup.abort() on rank " + std::to_string(rank_));
}

void MycclBackend::shutdown() {
  if (shutdown_.exchange(true)) return;
  for (auto& e : engines_.all()) e->shutdown();
}

// ---- what c10d_ext asks of a group ------------------------------------------------------------

at::Tensor MycclBackend::allocateTensor(long size, at::TensorOptions options) {
  const auto w = where("allocate_tensor");
  MYCCL_CHECK_ARG(size >= 0, w, ": size must be >= 0, got ", size);
  MYCCL_CHECK_ARG(!options.has_device() || options.device().is_cpu(), w,
                  ": only CPU tensors come from myccl's shared memory, got device ", options.device());
  return engines_.cpu(w)->allocateTensor(size, options);
}

at::Tensor MycclBackend::sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype, int owner) {
  const auto w = where("shared_tensor");
  for (size_t i = 0; i < shape.size(); ++i)
    MYCCL_CHECK_ARG(shape[i] >= 0, w, ": dimension ", i, " is negative (", shape[i], ")");
  MYCCL_CHECK_ARG(owner >= 0 && owner < topology().localSize, w, ": owner must be a local rank in [0, ",
                  topology().localSize, "), got ", owner);
  return engines_.cpu(w)->sharedTensor(shape, dtype, owner, timeout(), w.str());
}

bool MycclBackend::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
  // CPU (no device index): registered shared memory when the group uses it.
  return deviceIdx < 0 && usesSharedMemory();
}

std::shared_ptr<cuda::Device> MycclBackend::cudaDevice() {
  auto device = engines_.cuda(where("ddp"))->deviceSeam();
  MYCCL_CHECK(device != nullptr, where("ddp"), ": the CUDA engine has no device seam");
  return device;
}

std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> MycclBackend::stats() const {
  std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, double>> out;
  auto cpu = engines_.cpuIfAny();
  if (!cpu) return out;
  for (auto& e : cpu->stats().snapshot()) out.emplace_back(e.op, e.algo, e.count, e.bytes, e.seconds);
  return out;
}

void MycclBackend::resetStats() {
  if (auto cpu = engines_.cpuIfAny()) cpu->stats().reset();
}

std::map<std::string, double> MycclBackend::linkModel() const {
  auto cpu = engines_.cpuIfAny();
  if (!cpu) return {};
  const cpu::LinkModel m = cpu->linkModel();
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

int MycclBackend::rejectedConnections() const {
  auto cpu = engines_.cpuIfAny();
  return cpu ? cpu->rejectedConnections() : 0;
}

Topology MycclBackend::topology() const {
  auto cpu = engines_.cpuIfAny();
  if (!cpu) {
    throwDistError("myccl: " + where("topology") + ": the group was created with enable_reconfigure=True and has "
                   "no members yet; call reconfigure() first");
  }
  return cpu->topology();
}

bool MycclBackend::usesSharedMemory() const {
  auto cpu = engines_.cpuIfAny();
  return cpu && cpu->usesSharedMemory();
}

std::string MycclBackend::describeLinks() const {
  auto cpu = engines_.cpuIfAny();
  return cpu ? cpu->describeLinks() : std::string();
}

std::vector<int> MycclBackend::vanishedRanks() const {
  auto cpu = engines_.cpuIfAny();
  return cpu ? cpu->vanishedRanks() : std::vector<int>{};
}

}  // namespace myccl
