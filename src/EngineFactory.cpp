// The one place that knows whether this build has the CUDA engine (MYCCL_WITH_NCCL, set by
// setup.py when torch is a CUDA build and NCCL's header is found).
#include "myccl/Engine.hpp"

#include "myccl/Errors.hpp"
#ifdef MYCCL_WITH_NCCL
#include "myccl/cuda/NcclEngine.hpp"
#endif

namespace myccl {

bool cudaEngineBuilt() {
#ifdef MYCCL_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<Engine> makeCudaEngine(const std::string& where, c10::intrusive_ptr<c10d::Store> store, int rank,
                                       int size, const std::string& group, const Config& cfg,
                                       std::chrono::milliseconds timeout) {
#ifdef MYCCL_WITH_NCCL
  return std::make_shared<cuda::NcclEngine>(std::move(store), rank, size, group, cfg, timeout);
#else
  MYCCL_CHECK(false, where, ": NCCL engine not built");
#endif
}

std::string ncclRuntimeVersion() {
#ifdef MYCCL_WITH_NCCL
  return cuda::NcclEngine::version();
#else
  return {};
#endif
}

}  // namespace myccl
