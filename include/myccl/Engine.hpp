// The one interface the backend routes every op to: the CPU engine (our transports, src/cpu)
// and the CUDA engine (NCCL, src/cuda) both implement it. The backend has already checked the
// arguments and filled OpInfo (sequence number, timeout, asyncOp); an engine only runs the op
// and hands back its Work. Whether a CUDA engine exists in this build is decided in one place,
// makeCudaEngine().
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "myccl/AbortHooks.hpp"
#include "myccl/Arguments.hpp"
#include "myccl/Config.hpp"
#include "myccl/Recorder.hpp"
#include "myccl/Reduction.hpp"
#include "myccl/Work.hpp"

namespace myccl {

namespace cuda {
class Device;
class Memory;
struct Runtime;
}

// What a split hands from a group's engine to the engine of the group split from it (its NCCL
// communicators, split by NCCL); opaque outside the engine that made it.
struct SplitParts {
  virtual ~SplitParts() = default;
};

class Engine {
 public:
  using WorkPtr = c10::intrusive_ptr<MycclWork>;
  virtual ~Engine() = default;

  // Tensors are on this engine's device, validated. `userInputs`: the caller's own input
  // tensors when `inputs` are views of them (kept alive and recorded as the op's inputs).
  virtual WorkPtr broadcast(OpInfo info, at::Tensor t, int root) = 0;
  virtual WorkPtr allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red) = 0;
  virtual WorkPtr reduce(OpInfo info, at::Tensor t, const Reduction& red, int root) = 0;
  virtual WorkPtr allgather(OpInfo info, std::vector<at::Tensor> inputs,
                            std::vector<std::vector<at::Tensor>> outputs) = 0;
  virtual WorkPtr gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root) = 0;
  virtual WorkPtr scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root) = 0;
  virtual WorkPtr reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                std::vector<at::Tensor> outputs, const Reduction& red,
                                std::vector<at::Tensor> userInputs = {}) = 0;
  virtual WorkPtr alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                           std::vector<at::Tensor> userInputs = {}) = 0;
  // all_gather_into_tensor and reduce_scatter_tensor: one tensor holds the group's blocks in rank
  // order (sizes checked by the caller). By default the blocks become per-rank views for the list
  // ops above; an engine that can work on the flat tensor (NCCL, as torch's does) overrides these
  // and saves the views.
  virtual WorkPtr allgatherBase(OpInfo info, at::Tensor input, at::Tensor output) {
    auto outs = blocks(Where{info.op.c_str(), info.rank}, output, info.size, input.numel(), "output");
    return allgather(std::move(info), {input}, {std::move(outs)});
  }
  virtual WorkPtr reduceScatterBase(OpInfo info, at::Tensor input, at::Tensor output, const Reduction& red) {
    auto ins = blocks(Where{info.op.c_str(), info.rank}, input, info.size, output.numel(), "input");
    return reduceScatter(std::move(info), {std::move(ins)}, {output}, red, {input});
  }
  // all_to_all_single: `inRows[r]` rows of `input` go to rank r, `outRows[r]` rows of `output`
  // come from it (checked by the caller). By default the rows become per-rank views for the list
  // op; an engine that can address the flat tensors (NCCL) overrides this and saves the views.
  virtual WorkPtr alltoallBase(OpInfo info, at::Tensor input, at::Tensor output, std::vector<int64_t> inRows,
                               std::vector<int64_t> outRows) {
    auto parts = [](const at::Tensor& t, const std::vector<int64_t>& rows) {
      std::vector<at::Tensor> out;
      out.reserve(rows.size());
      int64_t first = 0;
      for (int64_t n : rows) {
        out.push_back(rowSlice(t, first, n));
        first += n;
      }
      return out;
    };
    auto ins = parts(input, inRows);
    auto outs = parts(output, outRows);
    return alltoall(std::move(info), std::move(ins), std::move(outs), {input});
  }
  // `device`: the device whose work the barrier also orders (the CPU engine has one).
  virtual WorkPtr barrier(OpInfo info, at::Device device) = 0;
  virtual WorkPtr send(OpInfo info, at::Tensor t, int peer, int tag) = 0;
  virtual WorkPtr recv(OpInfo info, at::Tensor t, int peer, int tag) = 0;

  // Ops issued between the two are issued together (batch_isend_irecv); the Work of
  // endCoalescing covers those the engine held back (null when it held none back).
  virtual void startCoalescing() {}
  virtual WorkPtr endCoalescing(const OpInfo& info) { return {}; }

  virtual void eagerConnect(at::Device device) {}
  // The device of the latest op (-1 before any, or for the CPU engine).
  virtual int lastDevice() const { return -1; }
  // MYCCL_DEBUG=DETAIL for engines that cannot check agreement themselves: `agree` runs the
  // cross-rank check of an op over the CPU engine's links before it is issued.
  virtual void setAgreement(std::function<void(const OpInfo&)> agree) {}
  // The CUDA engine's device seam (Runtime.hpp; null for the CPU engine), for callers that order
  // their own device work with the engine's streams (the DDP Reducer).
  virtual std::shared_ptr<cuda::Device> deviceSeam() const { return nullptr; }
  virtual void setTimeout(std::chrono::milliseconds timeout) {}
  // Collective over this group, every rank in the same order as its ops: the resources a group
  // split from this one can take over (NCCL: each group communicator split with `color`, this
  // rank's rank `key` in the new group; color < 0: this rank is in no new group and gets null).
  // Null where the engine has nothing to share: the new group then makes its own on first use.
  virtual std::shared_ptr<SplitParts> splitParts(int color, int key, std::chrono::milliseconds timeout) {
    return nullptr;
  }
  // On the new group's engine, before its first op: take over what splitParts made.
  virtual void adoptSplit(std::shared_ptr<SplitParts> parts) {}
  virtual void abort(const std::string& why) = 0;  // no waiting for peers
  virtual void shutdown() = 0;                      // finish queued work, then leave
  virtual bool failed() const = 0;
  virtual bool timedOut() const = 0;
  // Ops issued and not finished yet (queued, running, or posted point-to-point).
  virtual size_t inFlight() const { return 0; }
};

// The CUDA engine of a group (communicators made lazily) on the process's CUDA platform, or an
// error naming `where` when there is none. `keyPrefix`: the group incarnation's key space in the store.
std::shared_ptr<Engine> makeCudaEngine(const std::string& where, c10::intrusive_ptr<c10d::Store> store,
                                       const std::string& keyPrefix, int rank, int size, const std::string& group,
                                       const Config& cfg, std::chrono::milliseconds timeout,
                                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder);

// The CUDA seam's installer: what every group's CUDA engine runs on. By default the GPU's CUDA
// runtime and NCCL (builds with NCCL); a platform installed in their place (once per process,
// before any group's first CUDA op) serves every CUDA engine, the process's device and its shared
// device memory from then on, and says which tensors are its own. Routing asks only claims().
class CudaPlatform {
 public:
  virtual ~CudaPlatform() = default;
  // Whether tensors on `d` are this platform's, so a group's CUDA engine takes them (the GPU's
  // platform: CUDA devices).
  virtual bool claims(const at::Device& d) const = 0;
  // The runtime of one CUDA engine; `store`: the engine's own key space in its group's store.
  virtual cuda::Runtime make(c10::intrusive_ptr<c10d::Store> store) = 0;
  // The process's shared device memory (cuda/Memory.hpp).
  virtual std::shared_ptr<cuda::Memory> memory() = 0;
  // The process's device (streams, events, the allocator).
  virtual std::shared_ptr<cuda::Device> device() = 0;
};
// The name of the PyCapsule that carries a std::shared_ptr<CudaPlatform>* from the extension
// that made it to _C._install_cuda_platform (both built by one setup.py run, from the same headers).
inline constexpr const char* kCudaPlatformCapsule = "myccl.CudaPlatform.v1";
void installCudaPlatform(std::shared_ptr<CudaPlatform> platform);

// Whether this build can run CUDA tensors on a GPU.
bool cudaEngineBuilt();
// Whether a group can make a CUDA engine: a platform is installed, or this build has the GPU's.
bool cudaEngineAvailable();
// Whether tensors on `d` go to a group's CUDA engine: the installed platform's answer, else
// whether `d` is a CUDA device. The one rule routing uses (Engines.hpp).
bool cudaClaims(const at::Device& d);
// The process's shared device memory: the installed platform's, else the GPU's (builds with the
// CUDA engine); null where neither exists.
std::shared_ptr<cuda::Memory> processMemory();
// The process's CUDA device seam (cuda/Runtime.hpp, Device): the installed platform's, else the
// GPU's (builds with the CUDA engine); null where neither exists. For code above the engines
// that orders its own work on streams (the Horovod layer), so that it runs on any platform
// exactly as on a GPU.
std::shared_ptr<cuda::Device> processDevice();
// The version of the libnccl this process loaded ("" without the CUDA engine).
std::string ncclRuntimeVersion();

}  // namespace myccl
