// The seam's third interface (beside Device and Nccl, Runtime.hpp): device memory that the
// processes of one host share, as CUDA's virtual memory management (cuMem*) and host-memory
// registration give it. Whole-memory tensors (c10d_ext.wholememory: DEVICE, CUDA CHUNKED and a
// HOST tensor's CUDA view) are built on it (SharedRegion.hpp). The real implementation
// (src/cuda/real/RealMemory.cpp) forwards each call to the CUDA driver / runtime one to one; the
// strict double (src/cuda/double/Memory.cpp) keeps "device memory" in memfd files mapped into
// host address space, so that handles travel between processes as the real ones do (file
// descriptors) and a use of memory after it was unmapped faults loudly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace myccl::cuda {

// CUmemGenericAllocationHandle: physical memory, referenced until released.
using MemHandle = uint64_t;

class Memory {
 public:
  virtual ~Memory() = default;

  // "cuda" or "double", for messages.
  virtual std::string kind() = 0;
  // The calling thread's device, -1 when it selected none (the double; CUDA answers its current one).
  virtual int currentDevice() = 0;
  // Makes `device` the calling thread's current one (cudaSetDevice, its primary context made) for
  // the calls that follow, which act on the current context; returns what puts the thread's
  // previous device back, which the caller runs when done (its callers' device is theirs).
  virtual std::function<void()> useDevice(int device) = 0;
  // Whether `device` can make memory that other processes map (virtual memory management with
  // POSIX file descriptor handles); if not, *why says what is missing.
  virtual bool shareable(int device, std::string* why) = 0;
  // The size every create / reserve / map is a multiple of (cuMemGetAllocationGranularity).
  virtual size_t granularity(int device) = 0;

  // Physical memory of `bytes` on `device`, exportable as a file descriptor (cuMemCreate).
  virtual MemHandle create(int device, size_t bytes) = 0;
  // A new file descriptor for the memory of `h`, owned by the caller (cuMemExportToShareableHandle).
  virtual int exportFd(MemHandle h) = 0;
  // A handle for memory another process exported; `fd` stays the caller's
  // (cuMemImportFromShareableHandle).
  virtual MemHandle importFd(int fd) = 0;
  // Drops the handle (cuMemRelease). The memory goes when every handle to it, in every process,
  // is released and every mapping of it is unmapped.
  virtual void release(MemHandle h) = 0;

  // A range of addresses, no memory behind it (cuMemAddressReserve); freed, with nothing mapped in
  // it any more, by unreserve (cuMemAddressFree).
  virtual uintptr_t reserve(size_t bytes) = 0;
  virtual void unreserve(uintptr_t va, size_t bytes) = 0;
  // The first `bytes` of `h` at `va`, inside a reservation (cuMemMap); not usable by any device
  // before setAccess (cuMemSetAccess, read and write for `device`).
  virtual void map(uintptr_t va, size_t bytes, MemHandle h) = 0;
  virtual void setAccess(uintptr_t va, size_t bytes, int device) = 0;
  virtual void unmap(uintptr_t va, size_t bytes) = 0;
  // Zeroes [va, va + bytes), mapped memory `device` may use, and returns once that is done
  // (cudaMemsetAsync on the device's current stream, and a wait for it): fresh physical memory
  // holds whatever was there before (cuMemCreate does not clear it).
  virtual void zero(uintptr_t va, size_t bytes, int device) = 0;
  // Blocks until every stream of `device` has run what it holds (cudaDeviceSynchronize): memory is
  // unmapped or unregistered only once no kernel queued before can still touch it (a tensor's
  // deleter runs when the last reference goes, not when the last kernel using it has run).
  virtual void synchronize(int device) = 0;

  // Host memory [p, p + bytes) becomes usable by every device's kernels (cudaHostRegister,
  // portable and mapped); returns the address devices use for it (cudaHostGetDevicePointer).
  virtual void* hostRegister(void* p, size_t bytes) = 0;
  virtual void hostUnregister(void* p) = 0;

  // A tensor of `device` over `p` (device memory mapped above, or a registered host range's device
  // address). The memory must stay as it is until `onFree` runs, from the tensor's deleter.
  virtual at::Tensor tensorAt(void* p, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype,
                              int device, std::function<void()> onFree) = 0;
};

}  // namespace myccl::cuda
