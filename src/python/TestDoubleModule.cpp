// c10d_ext._test_double: the strict CUDA/NCCL host double (src/cuda/double) as a test-only
// extension, built only with MYCCL_BUILD_TESTS=1 and never part of c10d_ext._C or a wheel. It
// hands _C a CudaPlatform (through a capsule, Engine.hpp) that claims CPU tensors as the
// simulated devices' own, and gives tests the double's hooks: the
// calling thread's simulated device and stream, synchronising the devices, and the violations and
// counters tests assert on. tests/cuda_double.py wraps it.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <sstream>

#include "myccl/Engine.hpp"
#include "myccl/cuda/double/CudaDouble.hpp"

namespace py = pybind11;
namespace td = myccl::cuda::testdouble;

namespace {

// The double's tensors are CPU tensors standing for CUDA tensors: it claims both kinds.
class DoublePlatform final : public myccl::CudaPlatform {
 public:
  explicit DoublePlatform(std::shared_ptr<td::Machine> m) : machine_(std::move(m)) {}
  bool claims(const at::Device& d) const override { return d.is_cpu() || d.is_cuda(); }
  myccl::cuda::Runtime make(c10::intrusive_ptr<c10d::Store> store) override {
    return td::runtime(machine_, std::move(store));
  }
  std::shared_ptr<myccl::cuda::Memory> memory() override { return td::memory(machine_); }
  std::shared_ptr<myccl::cuda::Device> device() override { return td::device(machine_); }

 private:
  std::shared_ptr<td::Machine> machine_;
};

std::shared_ptr<td::Machine> machine() {
  return td::machine();  // made by configure() first; later calls ignore options
}

// What the tests' own kernels saw, in the order they ran (enqueue_read, enqueue_mark).
std::mutex marksMu;
std::vector<std::string> marks;

void mark(std::string what) {
  std::lock_guard<std::mutex> lk(marksMu);
  marks.push_back(std::move(what));
}

c10::Stream streamById(int64_t id) {
  auto d = td::device(machine());
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(d->current())), id);
}

void destroyCapsule(PyObject* capsule) {
  delete static_cast<std::shared_ptr<myccl::CudaPlatform>*>(PyCapsule_GetPointer(capsule, myccl::kCudaPlatformCapsule));
}

}  // namespace

PYBIND11_MODULE(_test_double, m) {
  // The process's simulated machine, once (later calls change nothing), and the platform to install.
  m.def("configure", [](int devices, int64_t seed, int delayUs, int64_t eagerBytes, int64_t hangMs, int capability,
                        int64_t abortMs) {
    td::Options o;
    o.devices = devices;
    o.seed = static_cast<uint64_t>(seed);
    o.maxDelayUs = delayUs;
    o.eagerBytes = eagerBytes;
    o.hangMs = hangMs;
    o.computeCapability = capability;
    o.abortTailMs = abortMs;
    auto p = new std::shared_ptr<myccl::CudaPlatform>(std::make_shared<DoublePlatform>(td::machine(o)));
    return py::reinterpret_steal<py::object>(PyCapsule_New(p, myccl::kCudaPlatformCapsule, destroyCapsule));
  });
  m.def("set_device", [](int index) { td::device(machine())->set(index); });
  // Device order (Machine::setDeviceOrder): each simulated device runs one launch at a time.
  m.def("set_device_order", [](bool on) { td::setDeviceOrder(*machine(), on); });
  m.def("current_device", [] { return td::device(machine())->current(); });
  m.def("synchronize", [] { td::synchronize(*machine()); }, py::call_guard<py::gil_scoped_release>());
  m.def("violations", [] { return td::violations(*machine()); });
  m.def("clear_violations", [] { td::clearViolations(*machine()); });
  m.def("counters", [] { return td::counters(*machine()); });
  m.def("hold_memory_releases", [](bool on) { td::holdMemoryReleases(on); });
  // Streams by id (0: the default stream), for tests that make gradients arrive on several streams.
  m.def("new_stream", [] {
    auto d = td::device(machine());
    return static_cast<int64_t>(d->newStream(d->current(), false).id());
  });
  m.def("current_stream", [] {
    auto d = td::device(machine());
    return static_cast<int64_t>(d->currentStream(d->current()).id());
  });
  m.def("set_stream", [](int64_t id) {
    auto d = td::device(machine());
    const auto index = static_cast<c10::DeviceIndex>(d->current());
    d->setCurrentStream(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::kCUDA, index), id));
  });
  // The tests' own kernels on stream `id` of the calling thread's device, each after `delay_ms`:
  // a producer that fills `t`, a consumer that reads it (and logs "label=sum of t"), a marker that
  // logs `label`. Like kernels they hold no reference to `t` (the caller keeps it alive, or the
  // allocator's stream rule must), and the allocator checks their memory as it checks NCCL's.
  m.def("enqueue_fill", [](int64_t id, const at::Tensor& t, double value, int delayMs) {
    auto view = [p = t.data_ptr(), n = t.numel(), dt = t.scalar_type()] {
      return at::from_blob(p, {n}, at::TensorOptions().dtype(dt));
    };
    td::kernel(*machine(), streamById(id), t.data_ptr(), t.nbytes(), "enqueue_fill", delayMs,
               [view, value] { view().fill_(value); });
  });
  m.def("enqueue_read", [](int64_t id, const at::Tensor& t, std::string label, int delayMs) {
    auto view = [p = t.data_ptr(), n = t.numel(), dt = t.scalar_type()] {
      return at::from_blob(p, {n}, at::TensorOptions().dtype(dt));
    };
    td::kernel(*machine(), streamById(id), t.data_ptr(), t.nbytes(), "enqueue_read", delayMs, [view, label] {
      std::ostringstream os;
      os << label << "=" << view().sum().item<double>();
      mark(os.str());
    });
  });
  m.def("enqueue_mark", [](int64_t id, std::string label, int delayMs) {
    td::kernel(*machine(), streamById(id), nullptr, 0, "enqueue_mark", delayMs, [label] { mark(label); });
  });
  m.def("marks", [] {
    std::lock_guard<std::mutex> lk(marksMu);
    return marks;
  });
  m.def("clear_marks", [] {
    std::lock_guard<std::mutex> lk(marksMu);
    marks.clear();
  });
}
