// The one place that knows whether this build has the real CUDA runtime (MYCCL_WITH_NCCL, set by
// setup.py when torch is a CUDA build and NCCL's header is found) and that picks the platform a
// CUDA engine runs on: the GPU's, or one installed in its place (Engine.hpp, CudaPlatform).
#include "myccl/Engine.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <mutex>

#include "myccl/Errors.hpp"
#include "myccl/cuda/Memory.hpp"
#include "myccl/cuda/NcclEngine.hpp"
#ifdef MYCCL_WITH_NCCL
#include "myccl/cuda/RealRuntime.hpp"
#endif

namespace myccl {

namespace {

std::mutex platformMu;
std::shared_ptr<CudaPlatform> installedPlatform;
std::atomic<bool> havePlatform{false};  // routing asks on every op: no lock while none is installed

std::shared_ptr<CudaPlatform> installed() {
  if (!havePlatform.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lk(platformMu);
  return installedPlatform;
}

}  // namespace

bool cudaEngineBuilt() {
#ifdef MYCCL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

void installCudaPlatform(std::shared_ptr<CudaPlatform> platform) {
  std::lock_guard<std::mutex> lk(platformMu);
  installedPlatform = std::move(platform);
  havePlatform.store(installedPlatform != nullptr, std::memory_order_release);
}

bool cudaEngineAvailable() {
  return cudaEngineBuilt() || installed() != nullptr;
}

bool cudaClaims(const at::Device& d) {
  if (auto p = installed()) return p->claims(d);
  return d.is_cuda();
}

std::shared_ptr<Engine> makeCudaEngine(const std::string& where, c10::intrusive_ptr<c10d::Store> store,
                                       const std::string& keyPrefix, int rank, int size, const std::string& group,
                                       const Config& cfg, std::chrono::milliseconds timeout,
                                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder) {
  cuda::Runtime rt;
  if (auto p = installed()) {
    rt = p->make(c10::make_intrusive<c10d::PrefixStore>(keyPrefix + "platform/", store));
  } else {
#ifdef MYCCL_WITH_NCCL
    rt = cuda::realRuntime();
#else
    MYCCL_CHECK(false, where, ": NCCL engine not built");
#endif
  }
  return std::make_shared<cuda::NcclEngine>(std::move(store), keyPrefix, rank, size, group, cfg, timeout, std::move(rt),
                                            std::move(hooks), std::move(recorder));
}

std::shared_ptr<cuda::Memory> processMemory() {
  if (auto p = installed()) return p->memory();
#ifdef MYCCL_WITH_NCCL
  return cuda::realMemory();
#else
  return nullptr;
#endif
}

std::shared_ptr<cuda::Device> processDevice() {
  if (auto p = installed()) return p->device();
#ifdef MYCCL_WITH_NCCL
  return cuda::realRuntime().device;
#else
  return nullptr;
#endif
}

std::string ncclRuntimeVersion() {
#ifdef MYCCL_WITH_NCCL
  return cuda::ncclVersionString(cuda::realRuntime().nccl->version());
#else
  return {};
#endif
}

}  // namespace myccl
