// The module's shared device memory (cuda/Memory.hpp, cuda/SharedRegion.hpp) for
// c10d_ext.wholememory: which Memory this process has, regions mapped by the processes of one
// host, and the CUDA view of host memory.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "Bindings.hpp"
#include "myccl/Engine.hpp"
#include "myccl/cuda/Memory.hpp"
#include "myccl/cuda/SharedRegion.hpp"

namespace py = pybind11;
using myccl::cuda::SharedRegion;

void bindMemory(py::module& m) {
  // "cuda" (a GPU build), "double" (the test double installed) or "" (neither).
  m.def("_cuda_memory_kind", [] {
    auto mem = myccl::processMemory();
    return mem ? mem->kind() : std::string();
  });
  m.def("_cuda_memory_device", [] {
    auto mem = myccl::processMemory();
    return mem ? mem->currentDevice() : -1;
  });

  py::class_<SharedRegion, std::shared_ptr<SharedRegion>>(m, "_SharedRegion")
      .def(py::init([](int device, size_t bytes) {
             return std::make_shared<SharedRegion>(myccl::processMemory(), device, bytes);
           }),
           py::arg("device"), py::arg("bytes"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("granularity", &SharedRegion::granularity)
      .def_property_readonly("bytes", &SharedRegion::bytes)
      .def("export_fd", &SharedRegion::exportFd)
      .def("map", &SharedRegion::map, py::arg("fds"), py::arg("sizes"), py::arg("mine"), py::arg("contiguous"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "view",
          [](SharedRegion& r, int part, int64_t offset, std::vector<int64_t> sizes, std::vector<int64_t> strides,
             at::ScalarType dtype, int device) { return r.view(part, offset, sizes, strides, dtype, device); },
          py::arg("part"), py::arg("offset"), py::arg("sizes"), py::arg("strides"), py::arg("dtype"),
          py::arg("device"));

  // A tensor of `device` over the host memory of `host` (registered with CUDA while any view of
  // it lives; SharedRegion.hpp: hostView).
  m.def(
      "_host_device_view",
      [](const at::Tensor& host, int device) { return myccl::cuda::hostView(myccl::processMemory(), host, device); },
      py::arg("host"), py::arg("device"));
  // Waits until shared device memory and registrations given up so far are released.
  m.def("_cuda_memory_quiesce", &myccl::cuda::quiesceSharedMemory, py::call_guard<py::gil_scoped_release>());
}
