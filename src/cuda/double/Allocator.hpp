// The double's stream-ordered allocator (private to src/cuda/double): the CUDA caching
// allocator's reuse rule made visible. A dropped tensor's memory is released only once every
// stream it was allocated or recordStream'ed on has run what was queued before the drop; it is
// then poisoned and kept, registered as freed, so an NCCL op that still reads it is reported.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda::testdouble {

class Machine;

class Allocator {
 public:
  explicit Allocator(Machine& m) : m_(m) {}
  // Frees released and freed blocks; blocks still in use belong to their tensors' deleters.
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Stream& s);
  void recordStream(const at::Tensor& t, const Stream& s);
  // Reports a violation when [p, p + n) starts in a freed block: `use` names the op, `on` the
  // stream running it. Memory this allocator never handed out is not checked.
  void check(const void* p, size_t n, const std::string& use, const Stream& on);
  // A tensor's deleter: queue the stream-ordered release.
  void drop(uintptr_t base);

 private:
  enum class State { Alive, Releasing, Freed };
  struct Block {
    size_t capacity = 0;  // bytes reserved (a size class)
    size_t nbytes = 0;    // bytes the tensor asked for
    Stream stream{Stream::DEFAULT, c10::Device(c10::kCUDA, 0)};  // allocation stream
    std::vector<Stream> uses;  // recordStream'ed streams since allocation
    State state = State::Alive;
  };
  void release(uintptr_t base);

  Machine& m_;
  std::mutex mu_;
  std::map<uintptr_t, Block> blocks_;
  // Freed blocks by capacity, oldest first: reusing the oldest keeps recent frees detectable longest.
  std::map<size_t, std::deque<uintptr_t>> pool_;
  size_t pooled_ = 0;
};

}  // namespace myccl::cuda::testdouble
