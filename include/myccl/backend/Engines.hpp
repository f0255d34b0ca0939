// The engines of one group and the one rule that routes an op to them. The CPU engine is made
// with the group (or by reconfigure), the CUDA engine at the group's first CUDA op. An op holds
// the engines for the whole of its issue (Held: a shared lock); reconfigure replaces the CPU
// engine under the lock held exclusively and refuses while an op is in flight, so no op ever
// runs on an engine being replaced.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Recorder.hpp"

namespace myccl {

namespace cpu {
class CpuEngine;
}

// An engine held for one op: the engines cannot be replaced while it lives.
template <class E>
class Held {
 public:
  Held(std::shared_lock<std::shared_mutex> lock, E* engine) : lock_(std::move(lock)), engine_(engine) {}
  E* operator->() const { return engine_; }
  E& operator*() const { return *engine_; }

 private:
  std::shared_lock<std::shared_mutex> lock_;
  E* engine_;
};

// The rule route() uses: whether a (valid) tensor, or tensors on a device, go to a group's CUDA
// engine: those the CUDA platform claims (Engine.hpp, cudaClaims).
bool onCudaEngine(const at::Tensor& t);
bool onCudaEngine(const at::Device& d);

class Engines {
 public:
  // Makes the group's CUDA engine at its first CUDA op (`op` names it in errors), given the CPU
  // engine (its key space, and MYCCL_DEBUG=DETAIL's agreement over its links) and the recorder.
  using CudaMaker =
      std::function<std::shared_ptr<Engine>(const char* op, cpu::CpuEngine* cpu, std::shared_ptr<Recorder> recorder)>;
  // Once, as the group is made (cpu: null for a group made with enable_reconfigure=True).
  void init(std::shared_ptr<cpu::CpuEngine> cpu, std::shared_ptr<Recorder> recorder, CudaMaker makeCuda);

  // The engine for these tensors: all on CPU, or all on CUDA (with NCCL built); anything else
  // raises, naming `where` ("all_gather (rank 3)"). Which engine takes them is onCudaEngine's.
  Held<Engine> route(const Where& where, const std::vector<at::Tensor>& tensors);
  // Whether a (valid) tensor, or tensors on `d`, go to the CUDA engine, by the rule route() uses
  // (onCudaEngine).
  bool onDevice(const at::Tensor& t) const;
  bool onDevice(const at::Device& d) const;
  // The device a barrier orders, as torch's nccl picks it: device_ids[0], else the group's bound
  // device, else the device of the CUDA engine's latest op; none: a CPU barrier.
  std::optional<at::Device> barrierDevice(const Where& where, const c10d::BarrierOptions& opts,
                                          std::optional<at::Device> bound);
  Held<cpu::CpuEngine> cpu(const Where& where);
  // The CPU engine for something that outlives one op (a window), or an error naming `where`.
  std::shared_ptr<cpu::CpuEngine> cpuOwned(const Where& where) const;
  Held<Engine> cuda(const Where& where);

  // Snapshots, for lifecycle calls that must not wait for running ops (abort, timeouts, stats).
  std::shared_ptr<cpu::CpuEngine> cpuIfAny() const;
  std::shared_ptr<Engine> cudaIfMade() const;
  // Those that exist, CPU first (inline: a coalescing block asks twice and allocates nothing).
  c10::SmallVector<std::shared_ptr<Engine>, 2> all() const;
  std::shared_ptr<Recorder> recorder() const;

  // Collective with the group's new members (torch's reconfigure): with every op held off, checks
  // that none is in flight (else raises, naming how many and `where`), builds the new CPU engine
  // with `make` (which may raise: the group then stays as it was), aborts the CUDA engine (a new
  // one is made at the next CUDA op) and swaps. `then` runs under the same lock, after the swap.
  void replace(const Where& where, const std::function<std::shared_ptr<cpu::CpuEngine>()>& make,
               std::shared_ptr<Recorder> recorder, const std::string& why, const std::function<void()>& then);

 private:
  std::shared_lock<std::shared_mutex> hold() const { return std::shared_lock<std::shared_mutex>(swapMu_); }
  Engine& cudaLocked(const Where& where);
  cpu::CpuEngine& cpuLocked(const Where& where) const;

  mutable std::shared_mutex swapMu_;  // ops: shared for their issue; replace(): exclusive
  mutable std::mutex mu_;             // the pointers below, for snapshots and the lazy CUDA engine
  std::shared_ptr<cpu::CpuEngine> cpu_;
  std::shared_ptr<Engine> cuda_;
  std::shared_ptr<Recorder> recorder_;
  CudaMaker makeCuda_;
};

}  // namespace myccl
