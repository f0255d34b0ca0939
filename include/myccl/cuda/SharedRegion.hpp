// Device memory shared by the processes of one host (whole-memory DEVICE and CUDA CHUNKED
// tensors), on the seam's Memory: each process makes its own pages, exports them as a file
// descriptor, imports everyone else's and maps all of them, either into one reserved range (one
// contiguous tensor, DEVICE) or each part into a range of its own (one tensor per part, CHUNKED).
// Passing the descriptors between processes is the caller's (c10d_ext/wholememory/device.py:
// SCM_RIGHTS over a Unix socket). The memory goes when the last process drops its last tensor:
// every tensor keeps its region, and a region releases its handles and mappings when it goes:
// on a thread of its own, after synchronising every device given access to it (the last
// tensor's deleter may run on any thread, an engine's watchdog included, while kernels queued on
// the memory still run, on any of those devices).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "myccl/cuda/Memory.hpp"

namespace myccl::cuda {

class SharedRegion : public std::enable_shared_from_this<SharedRegion> {
 public:
  // This process's pages: `bytes` on `device`, rounded up to the granularity (0: no pages).
  SharedRegion(std::shared_ptr<Memory> memory, int device, size_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  size_t granularity() const { return gran_; }
  size_t bytes() const { return bytes_; }  // this process's pages, rounded
  // A new descriptor for this process's pages, owned by the caller; -1 when it has none.
  int exportFd();
  // Maps every part, in order: part i is `fds[i]` (ignored for `mine`, whose pages are this
  // process's own; -1 for a part with no pages) of `sizes[i]` bytes (each a multiple of the
  // granularity). contiguous: one range holding the parts back to back; else one range per
  // part. The device this region was made for gets access, and this process's own pages are
  // zeroed (every process zeroes its own: the memory is zero-filled once all have mapped). Once only.
  void map(const std::vector<int>& fds, const std::vector<size_t>& sizes, int mine, bool contiguous);
  // A tensor over part `part` (-1: the whole contiguous range), starting `offset` bytes in, seen
  // from `device` (granted access first if it has none yet). It keeps the region alive.
  at::Tensor view(int part, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype,
                  int device);

 private:
  struct Range {
    uintptr_t va = 0;
    size_t bytes = 0;
    std::vector<std::pair<uintptr_t, size_t>> mapped;  // (address, bytes) of each mapping in it
  };
  void grant(int device);

  std::shared_ptr<Memory> mem_;
  const int device_;
  size_t gran_ = 0;
  size_t bytes_ = 0;
  MemHandle own_ = 0;
  bool haveOwn_ = false;
  std::mutex mu_;
  bool mapped_ = false;
  bool contiguous_ = false;  // map()'s choice: one range for all parts
  std::vector<MemHandle> imported_;
  std::vector<Range> ranges_;      // one (contiguous) or one per part
  std::vector<int> partRange_;     // part -> index into ranges_, -1 for a part with no pages
  std::set<int> granted_;
};

// A tensor of `device` over the host memory of `host`: the storage is registered with CUDA
// (portable, mapped) while any view of it lives, and each view keeps `host` alive. Views of one
// storage share its registration; a view made while the last one's unregistration still waits
// on the releaser takes the registration back (registering the range twice is an error in CUDA).
at::Tensor hostView(std::shared_ptr<Memory> memory, const at::Tensor& host, int device);

// Runs `release` on the shared-memory releaser thread, after synchronising every device in
// `devices` through `memory` (each device that was given access: kernels on any of them may still
// use the memory): how a region's mappings and a registered host range are given back.
void releaseLater(std::shared_ptr<Memory> memory, std::vector<int> devices, std::function<void()> release);
// Blocks until every release handed over so far has run (tests, and before reporting leaks).
void quiesceSharedMemory();

}  // namespace myccl::cuda
