// How gradients meet their bucket's memory (private to src/reducer): the empty sparse gradient
// of a parameter, whether a gradient already is its bucket slot, and the slot alias that lets
// AccumulateGrad add straight into the bucket.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sparse_coo_tensor.h>

#include <vector>

namespace myccl::reducer {

inline at::Tensor emptySparseLike(const at::Tensor& param) {
  // An embedding's gradient: one sparse dimension, dense rows.
  auto sizes = param.sizes().vec();
  std::vector<int64_t> vshape(sizes.begin() + 1, sizes.end());
  vshape.insert(vshape.begin(), 0);
  return at::sparse_coo_tensor(at::empty({1, 0}, param.options().dtype(at::kLong)),
                               at::empty(vshape, param.options()), sizes);
}

// `grad` already is the memory of the bucket slot `view`, laid out alike: a bucket view
// (gradient_as_bucket_view) or a slot alias.
inline bool inSlot(const at::Tensor& grad, const at::Tensor& view) {
  return grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() && grad.strides() == view.strides();
}

// Without gradient_as_bucket_view, torch's reducer keeps each .grad in memory of its own and
// copies it into the bucket before the reduction and back after it: two passes over every
// gradient, the second one on the critical path after backward. A slot alias is a gradient
// with a storage of its own (not a view: detach_(), set_() and requires_grad_() behave as on
// any gradient) over its bucket slot's memory, so AccumulateGrad adds into the bucket and the
// reduction leaves the averaged gradient in .grad. It holds the bucket's buffer alive.
inline at::Tensor slotAlias(const at::Tensor& view, const at::Tensor& buffer) {
  return at::from_blob(view.data_ptr(), view.sizes(), view.strides(), [keep = buffer](void*) {}, view.options());
}

}  // namespace myccl::reducer
