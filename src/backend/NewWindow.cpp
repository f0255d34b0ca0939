// Backend::new_window: one-sided windows (torch 2.15's Window API) on the group's CPU engine
// (src/cpu/Window.cpp). Collective: every rank makes its n-th window of the group at the same
// call, so the n-th window has the same tags everywhere.
#include "myccl/backend/ProcessGroupMyccl.hpp"

#if MYCCL_HAS_WINDOW

#include "myccl/Errors.hpp"
#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/Window.hpp"

namespace myccl {

c10::intrusive_ptr<c10d::Window> MycclBackend::new_window(const std::optional<at::Tensor>& tensor) {
  const auto at = where("new_window");
  auto engine = engines_.cpuOwned(at);
  MYCCL_CHECK_ARG(!tensor.has_value() || !tensor->defined() || tensor->device().is_cpu(), at,
                  ": windows hold CPU tensors, got one on ", tensor->device());
  auto self = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(this);
  auto w = c10::make_intrusive<cpu::MycclWindow>(self, engine, windows_++, timeout_.load(), group_);
  if (tensor.has_value() && tensor->defined()) w->tensor_register(*tensor, true);
  return w;
}

}  // namespace myccl

#endif
