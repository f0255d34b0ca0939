// GradBucket's per-parameter views and reading a c10d future's value; the hook interface
// itself is in CommHook.hpp, its Python adapter in src/python/Bindings.cpp.
#include "myccl/reducer/CommHook.hpp"

#include "myccl/Errors.hpp"

namespace myccl::reducer {

std::vector<at::Tensor> GradBucket::gradients() const {
  std::vector<at::Tensor> out;
  if (buffer_.is_sparse()) {
    out.push_back(buffer_);
    return out;
  }
  out.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    out.push_back(buffer_.narrow(0, offsets_[i], lengths_[i]).view(params_[i].sizes()));
  return out;
}

at::Tensor tensorFromFutureValue(const c10::IValue& value, const char* what) {
  if (value.isTensor()) return value.toTensor();
  if (value.isTensorList()) {
    auto list = value.toTensorList();
    MYCCL_CHECK(list.size() >= 1, "ddp: ", what, ": the future's value is an empty tensor list");
    return list.get(0);
  }
  if (value.isList()) {
    auto list = value.toList();
    MYCCL_CHECK(list.size() >= 1 && list.get(0).isTensor(), "ddp: ", what,
                ": the future's value is a list without a tensor first");
    return list.get(0).toTensor();
  }
  MYCCL_CHECK(false, "ddp: ", what, ": expected the future's value to be a tensor or a list of tensors, got ",
              value.tagKind());
}

}  // namespace myccl::reducer
