// One-sided windows on a CPU group (torch's c10d::Window, Backend::new_window). Each rank
// registers one CPU tensor; peers then put() into it and signal() it without the owner taking
// part. Between ranks of one host whose windows live in registered shared memory (tensors from
// allocate_tensor) a put is a copy straight into the peer's tensor, and map_remote_tensor() is a
// real view of it (UNIFIED). Otherwise (another host, TCP forced, or a plain tensor) a put is a
// header and a payload message on the window's tag, which the owner's transport thread writes into
// its tensor through a receive chain the window keeps posted per peer (SEPARATE). Signals travel
// behind the puts on the same chain, so a wait_signal() that returns sees every byte put before
// the signal.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "myccl/TorchCompat.hpp"

#if MYCCL_HAS_WINDOW

#include <torch/csrc/distributed/c10d/Window.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace myccl::cpu {

class CpuEngine;
struct WindowState;

class MycclWindow final : public c10d::Window {
 public:
  // Collective (Backend::new_window). `backend` runs the window's own collectives (exchanging
  // what each rank registered); `id` numbers the group's windows alike on every rank.
  MycclWindow(c10::intrusive_ptr<c10d::Backend> backend, std::shared_ptr<CpuEngine> engine, uint64_t id,
              std::chrono::milliseconds timeout, std::string group);
  ~MycclWindow() override;

  void tensor_register(const at::Tensor& tensor, bool owning = true) override;
  void tensor_deregister() override;
  c10::intrusive_ptr<c10d::Work> put(const at::Tensor& tensor, int64_t dstRank, int64_t targetOffsetNelems,
                                     bool asyncOp, const c10d::PutOptions& opts = c10d::PutOptions()) override;
  at::Tensor map_remote_tensor(int64_t rank) override;
  c10::intrusive_ptr<c10d::Work> signal(int64_t peerRank, bool asyncOp,
                                        const c10d::SignalOptions& opts = c10d::SignalOptions()) override;
  c10::intrusive_ptr<c10d::Work> wait_signal(int64_t peerRank, bool asyncOp,
                                             const c10d::WaitSignalOptions& opts = c10d::WaitSignalOptions()) override;
  c10d::WindowAttr get_attr(int64_t peerRank) override;

 private:
  std::string where(const char* op) const;
  void checkPeer(const char* op, int64_t peer) const;
  void checkRegistered(const char* op) const;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::shared_ptr<CpuEngine> engine_;  // the engine the window was made on (a reconfigure may replace the group's)
  std::shared_ptr<WindowState> st_;
};

}  // namespace myccl::cpu

#endif  // MYCCL_HAS_WINDOW
