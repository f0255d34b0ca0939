// The Python module c10d_ext._C: the backend class, its Config, build facts and a few hooks
// for tests; the Reducer's part is in ReducerBindings.cpp. src/python/ holds the only files that
// include pybind11 (torch's bundled copy, so the c10d::Backend holder type matches torch's).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include "myccl/Arguments.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"
#include "myccl/cpu/Copy.hpp"
#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/Rows.hpp"
#include "myccl/cpu/transport/Net.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <sys/stat.h>

#include "Bindings.hpp"
#include "Horovod.hpp"

namespace py = pybind11;

namespace {

py::dict recordToDict(const myccl::OpRecord& r) {
  static const char* states[] = {"queued", "started", "completed", "failed"};
  py::dict d;
  d["seq"] = r.seq;
  d["op"] = r.op;
  d["p2p"] = r.p2p;
  d["dtype"] = r.dtype;
  d["shape"] = r.shape;
  d["bytes"] = r.bytes;
  d["root"] = r.root;
  d["redop"] = r.redop;
  d["algorithm"] = r.algo;
  d["transport"] = r.transport;
  d["state"] = states[static_cast<int>(r.state)];
  d["queued_us"] = r.queuedUs;
  d["started_us"] = r.startedUs;
  d["ended_us"] = r.endedUs;
  d["error"] = r.error;
  return d;
}

// Holder that drops the GIL while the backend is destroyed: destruction joins our threads,
// and one of them may be running a Python future callback that needs the GIL.
template <typename T>
class NoGilHolder {
 public:
  NoGilHolder() = default;
  NoGilHolder(const NoGilHolder&) = default;
  NoGilHolder(NoGilHolder&&) noexcept = default;
  NoGilHolder& operator=(const NoGilHolder&) = default;
  NoGilHolder& operator=(NoGilHolder&&) noexcept = default;
  /* implicit */ NoGilHolder(c10::intrusive_ptr<T> p) : p_(std::move(p)) {}
  // pybind11 constructs holders from raw pointers of freshly created objects.
  explicit NoGilHolder(T* raw) : p_(c10::intrusive_ptr<T>::unsafe_steal_from_new(raw)) {}
  ~NoGilHolder() {
    if (!p_) return;
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      p_.reset();
    } else {
      p_.reset();
    }
  }
  T* get() const noexcept { return p_.get(); }
  T& operator*() const noexcept { return *p_; }
  T* operator->() const noexcept { return p_.get(); }

 private:
  c10::intrusive_ptr<T> p_;
};

myccl::RedOp parseRedOp(const std::string& s) {
  using myccl::RedOp;
  if (s == "sum") return RedOp::Sum;
  if (s == "prod") return RedOp::Prod;
  if (s == "min") return RedOp::Min;
  if (s == "max") return RedOp::Max;
  if (s == "band") return RedOp::BAnd;
  if (s == "bor") return RedOp::BOr;
  if (s == "bxor") return RedOp::BXor;
  throw py::value_error("unknown reduce op " + s);
}

myccl::DType reducibleDtype(at::ScalarType st) {
  auto dt = myccl::dtypeOf(st);
  if (!dt || !myccl::cpuReducible(*dt)) throw py::value_error("unsupported dtype " + myccl::scalarTypeName(st));
  return *dt;
}

}  // namespace


PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true);

PYBIND11_MODULE(_C, m) {
  // The torch-version guard runs in c10d_ext/__init__.py, before this module is loaded: a build
  // for another torch may not even link against the torch in this process.
  py::module::import("torch.distributed");

  py::class_<myccl::Config> config(m, "Config");
  config.def(py::init<>());
#define MYCCL_BIND_CONFIG(type, member, pyName, dflt) config.def_readwrite(pyName, &myccl::Config::member);
  MYCCL_CONFIG_FIELDS(MYCCL_BIND_CONFIG)
#undef MYCCL_BIND_CONFIG

  py::class_<myccl::MycclBackend, c10d::Backend, NoGilHolder<myccl::MycclBackend>>(m, "MycclBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group, std::vector<int64_t> globalRanks,
                       myccl::Config cfg, bool reconfigurable) {
             return c10::make_intrusive<myccl::MycclBackend>(store, rank, size, timeout, std::move(group),
                                                             std::move(globalRanks), std::move(cfg), "",
                                                             reconfigurable);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
           py::arg("global_ranks"), py::arg("config"), py::arg("reconfigurable") = false,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("group_name", &myccl::MycclBackend::groupName)
      .def_property_readonly("timeout", &myccl::MycclBackend::timeout)
      // torch binds Backend.get_error only from 2.14 on; the same method here serves every torch.
      .def("get_error", &myccl::MycclBackend::getError, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("local_rank", [](const myccl::MycclBackend& b) { return b.topology().localRank; })
      .def_property_readonly("local_size", [](const myccl::MycclBackend& b) { return b.topology().localSize; })
      .def_property_readonly("cross_rank", [](const myccl::MycclBackend& b) { return b.topology().crossRank; })
      .def_property_readonly("cross_size", [](const myccl::MycclBackend& b) { return b.topology().crossSize; })
      .def_property_readonly("local_ranks", [](const myccl::MycclBackend& b) { return b.topology().localRanks; })
      .def_property_readonly("host_of_rank", [](const myccl::MycclBackend& b) { return b.topology().hostOfRank; })
      .def_property_readonly("uses_shared_memory", &myccl::MycclBackend::usesSharedMemory)
      .def_property_readonly("rejected_connections", &myccl::MycclBackend::rejectedConnections)
      .def("describe_links", &myccl::MycclBackend::describeLinks)
      .def("_agreed_all_reduce", &myccl::horovod::agreedAllreduce, py::arg("tensor"), py::arg("agreed"),
           py::arg("key"), py::arg("op"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("_agreed_available", &myccl::horovod::agreedAvailable)
      .def("shared_tensor", &myccl::MycclBackend::sharedTensor, py::arg("shape"), py::arg("dtype"), py::arg("owner") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("flight_recorder",
           [](const myccl::MycclBackend& b) {
             py::list out;
             for (auto& r : b.recorder()->flight()) out.append(recordToDict(r));
             return out;
           })
      .def(
          "dump_flight_recorder",
          [](const myccl::MycclBackend& b, const std::string& dir, const std::string& reason) {
            return b.recorder()->dumpTo(dir, reason);
          },
          py::arg("dir"), py::arg("reason") = "requested")
      .def("_abandon_coalescing", &myccl::MycclBackend::abandonCoalescing, py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      .def("survivors", &myccl::MycclBackend::survivors, py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("vanished_ranks", [](const myccl::MycclBackend& b) { return b.vanishedRanks(); })
      // torch binds these from the release that has shrink; ours for every torch (and the tests).
      .def_property_readonly("_supports_shrinking", &myccl::MycclBackend::supportsShrinking)
      // torch's new_group asks a parent that supports splitting and is bound to a device to take
      // part in NCCL's split on ranks outside the new group. myccl's new_group makes its own
      // communicators among the members (only split_group splits), so there is nothing to join.
      .def("perform_nocolor_split", [](myccl::MycclBackend&, const at::Device&) {}, py::arg("device"))
      .def("stats", &myccl::MycclBackend::stats)
      .def("link_model", &myccl::MycclBackend::linkModel)
      .def("reset_stats", &myccl::MycclBackend::resetStats);

  m.def("build_info", []() {
    py::dict d;
    d["torch_version"] = MYCCL_TORCH_VERSION;
    d["with_nccl"] = myccl::cudaEngineBuilt();
    if (myccl::cudaEngineBuilt()) {
      d["nccl_runtime_version"] = myccl::ncclRuntimeVersion();
    } else {
      d["nccl_runtime_version"] = py::none();
    }
    d["reduce_isa"] = myccl::cpu::reduceIsa();
#if defined(__VERSION__)
    d["compiler"] = __VERSION__;
#endif
    return d;
  });

  m.def("set_log_level", [](int level) { myccl::setLogLevel(static_cast<myccl::LogLevel>(level)); });
  m.def("set_log_sink", [](py::object fn) {
    if (fn.is_none()) {
      py::gil_scoped_release nogil;  // the logger thread may need the GIL to finish a message
      myccl::setLogSink(nullptr);
      return;
    }
    // Dropped (with the GIL) whenever the sink is replaced.
    std::shared_ptr<py::object> holder(new py::object(fn), [](py::object* o) {
      py::gil_scoped_acquire gil;
      delete o;
    });
    myccl::setLogSink([holder](int level, const std::string& msg) {
      if (!Py_IsInitialized()) return;
      py::gil_scoped_acquire gil;
      (*holder)(level, msg);
    });
  });
  m.def("_log", [](int level, const std::string& msg) { myccl::log(static_cast<myccl::LogLevel>(level), msg); });
  m.def("set_tracing", &myccl::Recorder::setTracing);
  m.def("tracing", &myccl::Recorder::tracing);
  // Every finished op of every group (also destroyed ones) since the last drain.
  m.def("drain_trace", []() {
    py::list out;
    for (auto& rec : myccl::RecorderRegistry::get().all()) {
      auto events = rec->drainTrace();
      if (events.empty()) continue;
      py::list evs;
      for (auto& r : events) evs.append(recordToDict(r));
      out.append(py::make_tuple(rec->group(), rec->rank(), evs));
    }
    return out;
  });
  m.def(
      "dump_all_flight_recorders",
      [](const std::string& dir, const std::string& reason) { return myccl::RecorderRegistry::get().dumpAll(dir, reason); },
      py::arg("dir"), py::arg("reason") = "requested");
  m.def("now_us", &myccl::Recorder::nowUs);

  // Test hook: a segment as myccl creates them; (name, permission bits) read before unlinking.
  m.def("_shm_segment_probe", []() {
    auto seg = myccl::cpu::ShmSegment::create(4096);
    struct stat st {};
    ::stat(("/dev/shm" + seg->name()).c_str(), &st);
    return py::make_tuple(seg->name(), static_cast<int>(st.st_mode & 0777));
  });

  m.def("host_identity", [](const std::string& override) { return myccl::cpu::hostIdentity(override); },
        py::arg("override") = "");

  // Test hook: the reduction kernels on local tensors, out = reduce(ins) in list order.
  m.def(
      "_reduce_kernel",
      [](std::vector<at::Tensor> ins, at::Tensor out, const std::string& op, int64_t divisor, double scale) {
        TORCH_CHECK(!ins.empty(), "need inputs");
        std::vector<const void*> ptrs;
        for (auto& t : ins) {
          TORCH_CHECK(t.is_contiguous() && t.scalar_type() == out.scalar_type() && t.numel() == out.numel(),
                      "inputs must be contiguous and match the output");
          ptrs.push_back(t.data_ptr());
        }
        TORCH_CHECK(out.is_contiguous(), "output must be contiguous");
        myccl::ReduceSpec spec{reducibleDtype(out.scalar_type()), parseRedOp(op), divisor, scale};
        py::gil_scoped_release nogil;
        myccl::cpu::reduceInto(spec, out.data_ptr(), ptrs.data(), static_cast<int>(ptrs.size()), out.numel());
      },
      py::arg("inputs"), py::arg("out"), py::arg("op"), py::arg("divisor") = 0, py::arg("scale") = 0.0);

  // Test hook: streaming-store copy between byte tensors (any alignment), and the size from
  // which MYCCL_STREAM_STORE_BYTES=auto uses it.
  m.def(
      "_stream_copy",
      [](at::Tensor dst, const at::Tensor& src) {
        TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
                    "need contiguous tensors of equal size");
        py::gil_scoped_release nogil;
        myccl::cpu::streamCopy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
      },
      py::arg("dst"), py::arg("src"));
  m.def("_stream_copy_min_bytes", &myccl::cpu::streamCopyMinBytes);

  // Whole-memory rows (c10d_ext.wholememory): out[i] = row idx[i] / row idx[i] = in[i] of a table
  // whose part p (a flat CPU tensor) holds rows [p * per_part, ...), row_stride elements apart.
  auto rowParts = [](const std::vector<at::Tensor>& parts, int64_t perPart, int64_t rows, int64_t rowStride,
                     const at::Tensor& rowsTensor, const at::Tensor& idx) {
    TORCH_CHECK(idx.dim() == 1 && idx.is_contiguous() && idx.device().is_cpu() &&
                    (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong),
                "indices must be a contiguous 1-D int32/int64 CPU tensor");
    TORCH_CHECK(rowsTensor.is_contiguous() && rowsTensor.device().is_cpu() && rowsTensor.dim() >= 1 &&
                    rowsTensor.size(0) == idx.numel(),
                "rows must be a contiguous CPU tensor with one row per index");
    myccl::cpu::RowParts t;
    for (auto& p : parts) {
      TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == rowsTensor.scalar_type(), "parts must match the rows");
      t.parts.push_back(static_cast<char*>(p.data_ptr()));
    }
    t.perPart = perPart;
    t.rows = rows;
    t.rowBytes = idx.numel() ? rowsTensor.nbytes() / idx.numel() : 0;
    t.strideBytes = static_cast<size_t>(rowStride) * rowsTensor.element_size();
    return t;
  };
  m.def(
      "_wm_gather_rows",
      [rowParts](const std::vector<at::Tensor>& parts, int64_t perPart, int64_t rows, int64_t rowStride,
                 const at::Tensor& idx, at::Tensor out) {
        auto t = rowParts(parts, perPart, rows, rowStride, out, idx);
        py::gil_scoped_release nogil;
        if (idx.scalar_type() == at::kInt)
          myccl::cpu::gatherRows(t, idx.data_ptr<int32_t>(), idx.numel(), static_cast<char*>(out.data_ptr()));
        else
          myccl::cpu::gatherRows(t, idx.data_ptr<int64_t>(), idx.numel(), static_cast<char*>(out.data_ptr()));
      },
      py::arg("parts"), py::arg("per_part"), py::arg("rows"), py::arg("row_stride"), py::arg("indices"), py::arg("out"));
  m.def(
      "_wm_scatter_rows",
      [rowParts](const std::vector<at::Tensor>& parts, int64_t perPart, int64_t rows, int64_t rowStride,
                 const at::Tensor& idx, const at::Tensor& values) {
        auto t = rowParts(parts, perPart, rows, rowStride, values, idx);
        py::gil_scoped_release nogil;
        if (idx.scalar_type() == at::kInt)
          myccl::cpu::scatterRows(t, idx.data_ptr<int32_t>(), idx.numel(), static_cast<const char*>(values.data_ptr()));
        else
          myccl::cpu::scatterRows(t, idx.data_ptr<int64_t>(), idx.numel(), static_cast<const char*>(values.data_ptr()));
      },
      py::arg("parts"), py::arg("per_part"), py::arg("rows"), py::arg("row_stride"), py::arg("indices"), py::arg("values"));

  bindReducer(m);
  bindMemory(m);
  bindHorovod(m);
  bindHorovodHeld(m);
  bindDevice(m);
  // The CUDA seam's installer (Engine.hpp, CudaPlatform): a platform another extension made
  // serves every CUDA engine of this process from now on.
  m.def("_install_cuda_platform", [](py::object capsule) {
    void* p = PyCapsule_GetPointer(capsule.ptr(), myccl::kCudaPlatformCapsule);
    if (p == nullptr) throw py::error_already_set();
    myccl::installCudaPlatform(*static_cast<std::shared_ptr<myccl::CudaPlatform>*>(p));
  });
}
