// The engines of one group and the one rule that routes an op to them (Engines.hpp).
#include "myccl/backend/Engines.hpp"

#include "myccl/Arguments.hpp"
#include "myccl/Errors.hpp"
#include "myccl/cpu/Engine.hpp"

namespace myccl {

void Engines::init(std::shared_ptr<cpu::CpuEngine> cpu, std::shared_ptr<Recorder> recorder, CudaMaker makeCuda) {
  std::lock_guard<std::mutex> lk(mu_);
  cpu_ = std::move(cpu);
  recorder_ = std::move(recorder);
  makeCuda_ = std::move(makeCuda);
}

bool onCudaEngine(const at::Device& d) {
  return cudaClaims(d);
}

bool onCudaEngine(const at::Tensor& t) {
  return onCudaEngine(t.device());
}

bool Engines::onDevice(const at::Tensor& t) const { return onCudaEngine(t); }
bool Engines::onDevice(const at::Device& d) const { return onCudaEngine(d); }

Held<Engine> Engines::route(const Where& where, const std::vector<at::Tensor>& tensors) {
  MYCCL_CHECK_ARG(!tensors.empty(), where, ": expected at least one tensor");
  const auto first = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    MYCCL_CHECK_ARG(t.defined(), where, ": tensor ", i, " is undefined");
    MYCCL_CHECK_ARG(t.device() == first, where, ": all tensors must be on one device, tensor 0 is on ", first,
                    " but tensor ", i, " is on ", t.device());
    MYCCL_CHECK_ARG(t.layout() == at::kStrided, where, ": tensor ", i, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported here");
  }
  if (!first.is_cpu()) {
    MYCCL_CHECK_ARG(first.is_cuda(), where, ": tensors on ", first, " are not supported (cpu and cuda only)");
    MYCCL_CHECK_ARG(cudaEngineBuilt(), where, ": got a CUDA tensor (", describe(tensors[0]),
                    ") but this myccl build has no NCCL engine; rebuild with MYCCL_WITH_NCCL=1 against a CUDA build "
                    "of torch");
  }
  auto lock = hold();
  if (onDevice(tensors[0])) return Held<Engine>(std::move(lock), &cudaLocked(where));
  return Held<Engine>(std::move(lock), &cpuLocked(where));
}

std::optional<at::Device> Engines::barrierDevice(const Where& where, const c10d::BarrierOptions& opts,
                                                 std::optional<at::Device> bound) {
  // torch's Python fills BarrierOptions::device, but its dispatcher op passes only device_ids on.
  // Where the CUDA engine takes host tensors too (cudaClaims), a barrier on the host is its.
  const bool hostOnDevice = onCudaEngine(at::Device(at::kCPU));
  if (opts.device.has_value() && onCudaEngine(*opts.device)) return opts.device;
  if (!opts.device_ids.empty()) {
    const int64_t id = opts.device_ids.front();
    MYCCL_CHECK_ARG(id >= 0, where, ": device_ids[0] must be a CUDA device index, got ", id);
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(id));
  }
  if (bound.has_value() && bound->is_cuda()) return bound;
  if (auto cuda = cudaIfMade()) {
    const int last = cuda->lastDevice();
    if (last >= 0) return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(last));
  }
  if (hostOnDevice) return at::Device(at::kCUDA);
  return std::nullopt;
}

Held<cpu::CpuEngine> Engines::cpu(const Where& where) {
  auto lock = hold();
  return Held<cpu::CpuEngine>(std::move(lock), &cpuLocked(where));
}

std::shared_ptr<cpu::CpuEngine> Engines::cpuOwned(const Where& where) const {
  auto lock = hold();
  cpuLocked(where);
  return cpu_;
}

Held<Engine> Engines::cuda(const Where& where) {
  MYCCL_CHECK_ARG(cudaEngineAvailable(), where,
                  ": this needs the NCCL engine, which this myccl build does not have");
  auto lock = hold();
  return Held<Engine>(std::move(lock), &cudaLocked(where));
}

cpu::CpuEngine& Engines::cpuLocked(const Where& where) const {
  // The pointer changes only under the exclusive lock, which the caller's shared lock excludes.
  if (!cpu_) {
    throwDistError("myccl: " + where + ": the group was created with enable_reconfigure=True and has no members "
                   "yet; call reconfigure() with every member's handle (get_reconfigure_handle()) first");
  }
  return *cpu_;
}

Engine& Engines::cudaLocked(const Where& where) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!cuda_) {
    cpu::CpuEngine& cpu = cpuLocked(where);
    cuda_ = makeCuda_(where.str().c_str(), &cpu, recorder_);
  }
  return *cuda_;
}

std::shared_ptr<cpu::CpuEngine> Engines::cpuIfAny() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cpu_;
}

std::shared_ptr<Engine> Engines::cudaIfMade() const {
  std::lock_guard<std::mutex> lk(mu_);
  return cuda_;
}

c10::SmallVector<std::shared_ptr<Engine>, 2> Engines::all() const {
  std::lock_guard<std::mutex> lk(mu_);
  c10::SmallVector<std::shared_ptr<Engine>, 2> out;
  if (cpu_) out.push_back(cpu_);
  if (cuda_) out.push_back(cuda_);
  return out;
}

std::shared_ptr<Recorder> Engines::recorder() const {
  std::lock_guard<std::mutex> lk(mu_);
  return recorder_;
}

void Engines::replace(const Where& where, const std::function<std::shared_ptr<cpu::CpuEngine>()>& make,
                      std::shared_ptr<Recorder> recorder, const std::string& why, const std::function<void()>& then) {
  std::unique_lock<std::shared_mutex> exclusive(swapMu_);
  size_t inFlight = 0;
  for (auto& e : all()) inFlight += e->inFlight();
  MYCCL_CHECK_ARG(inFlight == 0, where, ": ", inFlight, " op(s) of this group are still in flight; wait for them "
                  "(Work.wait()) before reconfiguring: the group's engines would be replaced under them");
  auto cpu = make();  // collective; raises (the group unchanged) if a member never comes
  std::shared_ptr<Engine> oldCuda;
  std::shared_ptr<cpu::CpuEngine> oldCpu;
  {
    std::lock_guard<std::mutex> lk(mu_);
    oldCuda = std::move(cuda_);
    oldCpu = std::move(cpu_);
    cpu_ = std::move(cpu);
    recorder_ = std::move(recorder);
  }
  if (oldCuda) oldCuda->abort(why);
  then();
  exclusive.unlock();
  // The old engines close their links as they go (outside the lock: it may take a moment).
  oldCuda.reset();
  oldCpu.reset();
}

}  // namespace myccl
