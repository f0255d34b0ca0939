// The one place that knows whether this build has the real CUDA runtime (MYCCL_WITH_NCCL, set by
// setup.py when torch is a CUDA build and NCCL's header is found) and that picks the Runtime a
// CUDA engine runs on: real GPUs, or a test runtime a test-only extension installed.
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

std::mutex testRuntimeMu;
std::shared_ptr<TestRuntime> installedTestRuntime;
std::atomic<bool> haveTestRuntime{false};

std::shared_ptr<TestRuntime> testRuntime() {
  std::lock_guard<std::mutex> lk(testRuntimeMu);
  return installedTestRuntime;
}

}  // namespace

bool cudaEngineBuilt() {
#ifdef MYCCL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

void installTestRuntime(std::shared_ptr<TestRuntime> runtime) {
  std::lock_guard<std::mutex> lk(testRuntimeMu);
  installedTestRuntime = std::move(runtime);
  haveTestRuntime.store(installedTestRuntime != nullptr, std::memory_order_release);
}

bool testRuntimeInstalled() {
  return haveTestRuntime.load(std::memory_order_acquire);
}

std::shared_ptr<Engine> makeCudaEngine(const std::string& where, c10::intrusive_ptr<c10d::Store> store,
                                       const std::string& keyPrefix, int rank, int size, const std::string& group,
                                       const Config& cfg, std::chrono::milliseconds timeout,
                                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder) {
  cuda::Runtime rt;
  if (auto test = testRuntime()) {
    rt = test->make(c10::make_intrusive<c10d::PrefixStore>(keyPrefix + "double/", store));
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
  if (auto test = testRuntime()) return test->memory();
#ifdef MYCCL_WITH_NCCL
  return cuda::realMemory();
#else
  return nullptr;
#endif
}

std::shared_ptr<cuda::Device> processDevice() {
  if (auto test = testRuntime()) return test->device();
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
