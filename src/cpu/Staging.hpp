// Tensors as the algorithms take them: contiguous buffers. A non-contiguous tensor is staged in a
// contiguous copy (filled first when the op reads it) and written back once the op succeeded.
#pragma once

#include <ATen/ATen.h>

namespace myccl::cpu {

// A contiguous stand-in for a user tensor; `commit` writes results back when it had to copy.
struct Staged {
  at::Tensor user;
  at::Tensor work;
  static Staged of(const at::Tensor& t, bool needsInput) {
    Staged s;
    s.user = t;
    if (t.is_contiguous()) {
      s.work = t;
    } else if (needsInput) {
      s.work = t.contiguous();
    } else {
      s.work = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    }
    return s;
  }
  char* ptr() const { return static_cast<char*>(work.data_ptr()); }
  size_t nbytes() const { return work.numel() * work.element_size(); }
  void commit() const {
    if (!work.is_same(user)) user.copy_(work);
  }
};

// A private contiguous copy (inputs that must not change, e.g. PREMUL_SUM scaling).
inline at::Tensor privateCopy(const at::Tensor& t) {
  return t.contiguous().clone(at::MemoryFormat::Contiguous);
}

}  // namespace myccl::cpu
