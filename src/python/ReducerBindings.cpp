// The Python face of the DDP Reducer (c10d_ext.DistributedDataParallel, src/reducer): the
// comm-hook adapter, GradBucket, Reducer and the model-state helpers. bindReducer() is called
// once from the module definition in Bindings.cpp.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "Bindings.hpp"
#include "myccl/Errors.hpp"
#include "myccl/reducer/Reducer.hpp"

namespace py = pybind11;

namespace {

namespace rd = myccl::reducer;

// A py::object that may be dropped on a thread without the GIL (the autograd thread).
std::shared_ptr<py::object> gilSafe(py::object o) {
  return std::shared_ptr<py::object>(new py::object(std::move(o)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// hook(state, bucket) -> torch.futures.Future, as for torch's DDP.
class PyCommHook final : public rd::CommHook {
 public:
  PyCommHook(py::object state, py::object hook) : state_(gilSafe(std::move(state))), hook_(gilSafe(std::move(hook))) {}

  c10::intrusive_ptr<c10::ivalue::Future> run(const std::shared_ptr<rd::GradBucket>& bucket) override {
    py::gil_scoped_acquire gil;
    py::object fut;
    try {
      fut = (*hook_)(*state_, bucket);
    } catch (py::error_already_set& e) {
      // The autograd engine carries C++ exceptions, not Python ones.
      MYCCL_CHECK(false, "ddp: the comm hook raised for bucket ", bucket->index(), ": ", e.what());
    }
    try {
      return fut.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
    } catch (const py::cast_error&) {
      MYCCL_CHECK(false, "ddp: the comm hook must return a torch.futures.Future, it returned ",
                  py::str(py::type::of(fut)).cast<std::string>());
    }
  }

  at::Tensor result(const c10::IValue& value) override {
    if (!value.isPyObject()) return rd::tensorFromFutureValue(value, "comm hook");
    py::gil_scoped_acquire gil;
    py::object obj = torch::jit::toPyObject(value);
    if ((py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) && py::len(obj) > 0)
      obj = obj[py::int_(0)];
    try {
      return obj.cast<at::Tensor>();
    } catch (const py::cast_error&) {
      MYCCL_CHECK(false, "ddp: the comm hook's future must hold a tensor (the bucket's reduced gradients), got ",
                  py::str(py::type::of(obj)).cast<std::string>());
    }
  }

 private:
  std::shared_ptr<py::object> state_, hook_;
};

py::dict iterationToDict(const rd::IterationStats& s) {
  py::list buckets;
  for (const auto& b : s.buckets) {
    py::dict d;
    d["index"] = b.index;
    d["nbytes"] = b.nbytes;
    d["num_params"] = b.numParams;
    d["sparse"] = b.sparse;
    d["backend_memory"] = b.backendMemory;
    d["fused_average"] = b.fusedAverage;
    d["grad_copies"] = b.gradCopies;
    d["on_device"] = b.onDevice;
    d["stream_waits"] = b.streamWaits;
    d["ready_us"] = b.readyUs;
    d["launch_us"] = b.launchUs;
    d["grads_pending"] = b.gradsPending;
    d["done_us"] = b.doneUs ? b.doneUs->load() : 0;
    buckets.append(d);
  }
  py::dict d;
  d["iteration"] = s.iteration;
  d["backward_start_us"] = s.backwardStartUs;
  d["backward_end_us"] = s.backwardEndUs;
  d["finished_us"] = s.finishedUs;
  d["buckets"] = buckets;
  return d;
}

}  // namespace

void bindReducer(py::module& m) {
  py::class_<rd::GradBucket, std::shared_ptr<rd::GradBucket>>(m, "GradBucket")
      .def("index", &rd::GradBucket::index)
      .def("buffer", &rd::GradBucket::buffer)
      .def("gradients", &rd::GradBucket::gradients)
      .def("parameters", &rd::GradBucket::parameters)
      .def("is_last", &rd::GradBucket::isLast)
      .def("set_buffer", &rd::GradBucket::setBuffer, py::arg("buffer"));

  py::class_<rd::Reducer, std::shared_ptr<rd::Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names, std::vector<bool> sparse,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t bucketCapBytes,
                       int64_t firstBucketCapBytes, bool findUnused, bool gradientAsBucketView, bool staticGraph,
                       size_t statsIterations) {
             rd::ReducerOptions o;
             o.caps.bytes = bucketCapBytes;
             o.caps.firstBytes = firstBucketCapBytes;
             o.findUnusedParameters = findUnused;
             o.gradientAsBucketView = gradientAsBucketView;
             o.staticGraph = staticGraph;
             o.statsIterations = statsIterations;
             return std::make_shared<rd::Reducer>(std::move(params), std::move(names), std::move(sparse), pg, o);
           }),
           py::arg("params"), py::arg("names"), py::arg("expect_sparse"), py::arg("process_group"),
           py::arg("bucket_cap_bytes"), py::arg("first_bucket_cap_bytes"), py::arg("find_unused_parameters"),
           py::arg("gradient_as_bucket_view"), py::arg("static_graph"), py::arg("stats_iterations") = 10,
           py::call_guard<py::gil_scoped_release>())
      .def("prepare_for_forward", &rd::Reducer::prepareForForward, py::call_guard<py::gil_scoped_release>())
      .def("rebuild_buckets", &rd::Reducer::rebuildBucketsIfDue, py::call_guard<py::gil_scoped_release>())
      .def("set_fused_average", &rd::Reducer::setFusedAverage, py::arg("on"), py::call_guard<py::gil_scoped_release>())
      .def("set_grad_alias", &rd::Reducer::setGradAlias, py::arg("on"), py::call_guard<py::gil_scoped_release>())
      .def("prepare_for_backward", &rd::Reducer::prepareForBackward, py::arg("outputs"), py::arg("sink_attached"),
           py::call_guard<py::gil_scoped_release>())
      .def("backward_started", &rd::Reducer::backwardStarted, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_join_future",
          [](rd::Reducer& r, const std::shared_ptr<torch::jit::PythonFutureWrapper>& fut, bool divideByInitial) {
            auto f = fut->fut;
            py::gil_scoped_release nogil;
            r.setJoinFuture(std::move(f), divideByInitial);
          },
          py::arg("future"), py::arg("divide_by_initial_world_size"))
      .def("shadow_backward", &rd::Reducer::shadowBackward, py::call_guard<py::gil_scoped_release>())
      .def(
          "register_comm_hook",
          [](rd::Reducer& r, py::object state, py::object hook) {
            auto h = std::make_shared<PyCommHook>(std::move(state), std::move(hook));
            py::gil_scoped_release nogil;
            r.registerCommHook(std::move(h));
          },
          py::arg("state"), py::arg("hook"))
      .def(
          "set_iteration_observer",
          [](rd::Reducer& r, py::object fn) {
            std::function<void(const rd::IterationStats&)> obs;
            if (!fn.is_none()) {
              auto f = gilSafe(std::move(fn));
              obs = [f](const rd::IterationStats& s) {
                py::gil_scoped_acquire gil;
                try {
                  (*f)(iterationToDict(s));
                } catch (py::error_already_set& e) {
                  e.discard_as_unraisable("c10d_ext DDP iteration observer");  // tracing never breaks training
                }
              };
            }
            py::gil_scoped_release nogil;
            r.setIterationObserver(std::move(obs));
          },
          py::arg("observer"))
      .def("bucket_stats",
           [](const rd::Reducer& r) {
             std::vector<rd::IterationStats> s;
             {
               py::gil_scoped_release nogil;
               s = r.stats();
             }
             py::list out;
             for (const auto& it : s) out.append(iterationToDict(it));
             return out;
           })
      .def("bucket_plan", &rd::Reducer::plan, py::call_guard<py::gil_scoped_release>())
      .def("bucket_buffers", &rd::Reducer::bucketBuffers, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("synced_iterations", py::cpp_function(&rd::Reducer::syncedIterations,
                                                                    py::call_guard<py::gil_scoped_release>()));

  m.def("_ddp_assign_buckets", &rd::assignBuckets, py::arg("params"), py::arg("order"), py::arg("expect_sparse"),
        py::arg("caps"));
  py::class_<rd::BucketCaps>(m, "BucketCaps")
      .def(py::init([](int64_t first, int64_t bytes) { return rd::BucketCaps{first, bytes}; }), py::arg("first_bytes"),
           py::arg("bytes"));
  m.def("_ddp_verify_params", &rd::verifyParamsAcrossRanks, py::arg("process_group"), py::arg("params"),
        py::arg("names"), py::call_guard<py::gil_scoped_release>());
  m.def("_ddp_broadcast_coalesced", &rd::broadcastCoalesced, py::arg("process_group"), py::arg("tensors"),
        py::arg("chunk_bytes"), py::arg("root"), py::call_guard<py::gil_scoped_release>());
}
