// Tensors in the group's shared memory: allocate_tensor (registered, so collectives on it skip
// the staging copies) and shared_tensor (one copy per host, mapped by every local rank).
#include "myccl/Log.hpp"
#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <ATen/ATen.h>

namespace myccl::cpu {

at::Tensor CpuEngine::sharedTensor(const std::vector<int64_t>& shape, at::ScalarType dtype, int owner,
                                   std::chrono::milliseconds timeout, const std::string& where) {
  // Every rank calls this in the same order, so the counter names the same tensor everywhere.
  return cpu::sharedTensor(*store_, keyPrefix_, topo_, ++sharedCount_, shape, dtype, owner, timeout, where);
}

at::Tensor CpuEngine::allocateTensor(int64_t numel, const at::TensorOptions& options) {
  const auto dtype = options.dtype();
  const size_t nbytes = static_cast<size_t>(std::max<int64_t>(numel, 0)) * dtype.itemsize();
  std::shared_ptr<ShmSegment> seg;
  if (shm_ && nbytes > 0) seg = shm_->allocate(nbytes);
  if (!seg) {
    if (shm_ && nbytes > 0)
      logOnce("shm-table-full", LogLevel::Warning,
              "allocate_tensor: the shared-memory table is full; returning ordinary memory (no zero copy)");
    return at::empty({numel}, options.device(at::kCPU));
  }
  std::weak_ptr<ShmGroup> group = shm_;
  // The tensor owns the mapping (it may outlive the group); freeing it unregisters the slot.
  auto deleter = [seg, group](void* p) {
    if (auto g = group.lock()) g->release(p);
  };
  return at::from_blob(seg->data(), {numel}, deleter, options.device(at::kCPU));
}

}  // namespace myccl::cpu
