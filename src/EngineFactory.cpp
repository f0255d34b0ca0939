// The one place that knows whether this build has the real CUDA runtime (MYCCL_WITH_NCCL, set by
// setup.py when torch is a CUDA build and NCCL's header is found) and that picks the Runtime a
// CUDA engine runs on: real GPUs, or the strict host double for tests.
#include "myccl/Engine.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "myccl/Errors.hpp"
#include "myccl/cuda/NcclEngine.hpp"
#include "myccl/cuda/double/CudaDouble.hpp"
#ifdef MYCCL_WITH_NCCL
#include "myccl/cuda/RealRuntime.hpp"
#endif

namespace myccl {

bool cudaEngineBuilt() {
#ifdef MYCCL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<cuda::testdouble::Machine> cudaDoubleMachine(const Config& cfg) {
  cuda::testdouble::Options o;
  o.devices = cfg.testCudaDoubleDevices;
  o.seed = static_cast<uint64_t>(cfg.testCudaDoubleSeed);
  o.maxDelayUs = cfg.testCudaDoubleDelayUs;
  o.eagerBytes = cfg.testCudaDoubleEagerBytes;
  o.hangMs = cfg.testCudaDoubleHangMs;
  o.computeCapability = cfg.testCudaDoubleCapability;
  o.abortTailMs = cfg.testCudaDoubleAbortMs;
  return cuda::testdouble::machine(o);
}

std::shared_ptr<Engine> makeCudaEngine(const std::string& where, c10::intrusive_ptr<c10d::Store> store,
                                       const std::string& keyPrefix, int rank, int size, const std::string& group,
                                       const Config& cfg, std::chrono::milliseconds timeout,
                                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder) {
  cuda::Runtime rt;
  if (cfg.testCudaDouble) {
    rt = cuda::testdouble::runtime(cudaDoubleMachine(cfg),
                                   c10::make_intrusive<c10d::PrefixStore>(keyPrefix + "double/", store));
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

std::string ncclRuntimeVersion() {
#ifdef MYCCL_WITH_NCCL
  return cuda::ncclVersionString(cuda::realRuntime().nccl->version());
#else
  return {};
#endif
}

}  // namespace myccl
