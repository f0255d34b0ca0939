// What a communication hook sees (GradBucket) and what it must provide (CommHook). The
// Reducer knows only this interface; the Python adapter lives in src/python/Bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace myccl::reducer {

// One bucket handed to a hook: the flat buffer (or the sparse gradient) and which parameters
// it holds. Same methods as torch's dist.GradBucket, so hooks written for torch's DDP run
// unchanged. set_buffer() only changes what this object returns; the Reducer takes the
// hook's result from the future.
class GradBucket {
 public:
  GradBucket(size_t index, size_t count, at::Tensor buffer, std::vector<at::Tensor> params,
             std::vector<int64_t> offsets, std::vector<int64_t> lengths)
      : index_(index), count_(count), buffer_(std::move(buffer)), params_(std::move(params)),
        offsets_(std::move(offsets)), lengths_(std::move(lengths)) {}

  size_t index() const { return index_; }
  bool isLast() const { return index_ + 1 == count_; }
  const at::Tensor& buffer() const { return buffer_; }
  void setBuffer(at::Tensor buffer) { buffer_ = std::move(buffer); }
  const std::vector<at::Tensor>& parameters() const { return params_; }
  // Per-parameter views of the current buffer (the whole buffer for a sparse bucket).
  std::vector<at::Tensor> gradients() const;

 private:
  size_t index_, count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> offsets_, lengths_;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts reducing `bucket`; the future's value holds the averaged gradients in the
  // bucket's layout. Called on the autograd thread, in bucket order.
  virtual c10::intrusive_ptr<c10::ivalue::Future> run(const std::shared_ptr<GradBucket>& bucket) = 0;
  // Turns the completed future's value into the tensor to unflatten.
  virtual at::Tensor result(const c10::IValue& value) = 0;
};

// The value of a c10d Work's future (a tensor or a list of them) as one tensor.
at::Tensor tensorFromFutureValue(const c10::IValue& value, const char* what);

}  // namespace myccl::reducer
