// How the Reducer orders its own device work (private to src/reducer): the stream the calling
// thread's tensor ops run on now, and events between streams. Two sources, one interface: the
// CUDA engine's seam when myccl carries the parameters (its CUDA platform's, so CI runs this very
// logic without a GPU), c10's device-generic streams and events for other backends' device
// tensors (no CUDA header either way).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>

#include "myccl/cuda/Runtime.hpp"

namespace myccl::reducer {

class DeviceStreams {
 public:
  virtual ~DeviceStreams() = default;
  // The calling thread's current stream on the parameters' device: where the tensor ops it
  // issues now run (in an autograd hook, the stream that produced the gradient).
  virtual cuda::Stream current() = 0;
  virtual std::unique_ptr<cuda::Event> newEvent() = 0;
  // The device index the parameters live on (the double's simulated device for its CPU tensors).
  virtual int index() const = 0;
};

// Over the CUDA engine's seam; `sample` is a parameter (the seam says which device it is on).
std::unique_ptr<DeviceStreams> seamStreams(std::shared_ptr<cuda::Device> device, const at::Tensor& sample);
// Over c10's streams and events for `device`'s type (its backend registered by torch).
std::unique_ptr<DeviceStreams> c10Streams(c10::Device device);

}  // namespace myccl::reducer
