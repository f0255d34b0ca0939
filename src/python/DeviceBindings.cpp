// The CUDA device seam (cuda/Runtime.hpp, Device and Event) for Python code above the engines
// that orders its own work on streams: the Horovod layer's streams, ready and done events,
// staging tensors and recordStream: the CUDA platform's (Engine.hpp), torch's CUDA calls on a
// GPU, so the layer's stream discipline runs on any platform (the test double in CI) as on a GPU.
// A stream crosses the boundary as (stream id, device index).
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "myccl/Engine.hpp"
#include "myccl/backend/Engines.hpp"
#include "myccl/cuda/Runtime.hpp"
#include "Bindings.hpp"

namespace py = pybind11;

namespace {

using myccl::cuda::Device;
using myccl::cuda::Stream;
using StreamKey = std::pair<int64_t, int>;

std::shared_ptr<Device> device(const char* call) {
  auto d = myccl::processDevice();
  TORCH_CHECK(d != nullptr, "myccl: ", call, ": this build has no CUDA engine (rebuild with MYCCL_WITH_NCCL=1 against "
              "a CUDA build of torch)");
  return d;
}

Stream stream(const StreamKey& k) {
  return Stream(Stream::UNSAFE, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(k.second)), k.first);
}

StreamKey key(const Stream& s) { return {s.id(), s.device_index()}; }

// One CUDA event, made on the calling thread's device at its first record (torch's CUDAEvent).
class PyEvent {
 public:
  PyEvent() : device_(device("cuda event")), ev_(device_->newEvent(false)) {}
  void record(const StreamKey& s) { ev_->record(stream(s)); }
  void block(const StreamKey& s) { ev_->block(stream(s)); }
  bool query() { return ev_->query(); }
  void synchronize() { ev_->synchronize(); }

 private:
  std::shared_ptr<Device> device_;  // keeps the double's machine alive as long as the event
  std::unique_ptr<myccl::cuda::Event> ev_;
};

}  // namespace

void bindDevice(py::module& m) {
  // The device index of the CUDA engine that takes `t` in a myccl group, or -1 where the CPU
  // engine takes it (the rule the backend routes by).
  m.def("_cuda_engine_device", [](const at::Tensor& t) -> int {
    if (!t.defined() || !myccl::onCudaEngine(t)) return -1;
    auto d = myccl::processDevice();
    if (d == nullptr) return -1;  // a CUDA tensor in a build without the engine: the op's own error says so
    return d->deviceOf(t).index();
  });
  // Whether work ordered on a stream is ordered for its consumers too (a GPU), or the host reads
  // tensors and must wait for the stream first (the double, Device::streamOrdered).
  m.def("_cuda_stream_ordered", [] { return device("stream_ordered")->streamOrdered(); });
  m.def("_cuda_current_device", [] { return device("current_device")->current(); });
  m.def("_cuda_set_device", [](int index) { device("set_device")->set(index); });
  // Back to the device a thread had before (makes no context on a device that has none yet).
  m.def("_cuda_restore_device", [](int index) { device("restore_device")->restore(index); });
  m.def("_cuda_current_stream", [](int index) { return key(device("current_stream")->currentStream(index)); });
  m.def("_cuda_new_stream", [](int index) { return key(device("new_stream")->newStream(index, false)); });
  m.def("_cuda_set_stream", [](const StreamKey& s) { device("set_stream")->setCurrentStream(stream(s)); });
  // A staging tensor of `like`'s dtype on stream `s` (the caching allocator's stream of its memory).
  m.def("_cuda_empty", [](std::vector<int64_t> sizes, const at::Tensor& like, const StreamKey& s) {
    return device("empty")->empty(sizes, like.scalar_type(), stream(s));
  });
  m.def("_cuda_record_stream", [](const at::Tensor& t, const StreamKey& s) {
    device("record_stream")->recordStream(t, stream(s));
  });
  py::class_<PyEvent>(m, "_CudaEvent")
      .def(py::init<>())
      .def("record", &PyEvent::record)
      .def("block", &PyEvent::block)
      .def("query", &PyEvent::query, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &PyEvent::synchronize, py::call_guard<py::gil_scoped_release>());
}
