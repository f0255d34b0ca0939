// c10d_ext._C's hooks into the CUDA test double (c10d_ext/cuda_double.py wraps them): the
// calling thread's simulated device and current stream, synchronising the simulated devices,
// and the violations and counters tests assert on. Each takes the Config whose MYCCL_TEST_CUDA_DOUBLE_* settings
// make the machine if no group has made it yet.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "Bindings.hpp"
#include "myccl/Config.hpp"
#include "myccl/Engine.hpp"
#include "myccl/cuda/double/CudaDouble.hpp"

namespace py = pybind11;
namespace td = myccl::cuda::testdouble;

void bindCudaDouble(py::module& m) {
  m.def("_cuda_double_set_device",
        [](int index, const myccl::Config& cfg) { td::device(myccl::cudaDoubleMachine(cfg))->set(index); });
  m.def("_cuda_double_current_device",
        [](const myccl::Config& cfg) { return td::device(myccl::cudaDoubleMachine(cfg))->current(); });
  m.def(
      "_cuda_double_synchronize", [](const myccl::Config& cfg) { td::synchronize(*myccl::cudaDoubleMachine(cfg)); },
      py::call_guard<py::gil_scoped_release>());
  m.def("_cuda_double_violations",
        [](const myccl::Config& cfg) { return td::violations(*myccl::cudaDoubleMachine(cfg)); });
  m.def("_cuda_double_clear_violations",
        [](const myccl::Config& cfg) { td::clearViolations(*myccl::cudaDoubleMachine(cfg)); });
  m.def("_cuda_double_counters", [](const myccl::Config& cfg) { return td::counters(*myccl::cudaDoubleMachine(cfg)); });
  // The calling thread's current stream on its device, by id (0: the default stream), for tests
  // that make gradients arrive on several streams.
  m.def("_cuda_double_new_stream", [](const myccl::Config& cfg) {
    auto d = td::device(myccl::cudaDoubleMachine(cfg));
    return static_cast<int64_t>(d->newStream(d->current(), false).id());
  });
  m.def("_cuda_double_current_stream", [](const myccl::Config& cfg) {
    auto d = td::device(myccl::cudaDoubleMachine(cfg));
    return static_cast<int64_t>(d->currentStream(d->current()).id());
  });
  m.def("_cuda_double_set_stream", [](int64_t id, const myccl::Config& cfg) {
    auto d = td::device(myccl::cudaDoubleMachine(cfg));
    const auto index = static_cast<c10::DeviceIndex>(d->current());
    d->setCurrentStream(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, index), id));
  });
}
