// The Python module c10d_ext._C: the backend class, its Config, build facts and a few hooks
// for tests. The only file that includes pybind11 (torch's bundled copy, so the c10d::Backend
// holder type matches torch's).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/ProcessGroupMyccl.hpp"
#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/transport/Net.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <sys/stat.h>
#ifdef MYCCL_WITH_NCCL
#include "myccl/cuda/NcclEngine.hpp"
#endif

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

std::string torchMinor(const std::string& v) {
  auto plus = v.find('+');
  std::string core = v.substr(0, plus);
  auto dot1 = core.find('.');
  auto dot2 = core.find('.', dot1 + 1);
  return core.substr(0, dot2);
}

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

myccl::DType dtypeOf(at::ScalarType st) {
  using myccl::DType;
  switch (st) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kShort: return DType::I16;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kBool: return DType::Bool;
    case at::kComplexFloat: return DType::C64;
    case at::kComplexDouble: return DType::C128;
    default: throw py::value_error(std::string("unsupported dtype ") + c10::toString(st));
  }
}

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true);

PYBIND11_MODULE(_C, m) {
  // c10d's C++ classes have no stable ABI: refuse to run against another torch minor version.
  const std::string runtime = py::module::import("torch").attr("__version__").cast<std::string>();
  if (torchMinor(runtime) != MYCCL_TORCH_MINOR) {
    throw py::import_error(std::string("c10d_ext was built for torch ") + MYCCL_TORCH_VERSION + " but torch " + runtime +
                           " is loaded; rebuild it against this torch: pip install --no-build-isolation "
                           "--force-reinstall --no-deps .  (from the c10d_ext source tree)");
  }
  py::module::import("torch.distributed");

  py::class_<myccl::Config>(m, "Config")
      .def(py::init<>())
      .def_readwrite("transport", &myccl::Config::transport)
      .def_readwrite("socket_ifname", &myccl::Config::socketIfname)
      .def_readwrite("master_addr", &myccl::Config::masterAddr)
      .def_readwrite("host_id", &myccl::Config::hostId)
      .def_readwrite("num_threads", &myccl::Config::numThreads)
      .def_readwrite("hierarchical", &myccl::Config::hierarchical)
      .def_readwrite("debug_detail", &myccl::Config::debugDetail)
      .def_readwrite("tcp_eager_bytes", &myccl::Config::tcpEagerBytes)
      .def_readwrite("tcp_chunk_bytes", &myccl::Config::tcpChunkBytes)
      .def_readwrite("spin_us", &myccl::Config::spinUs)
      .def_readwrite("shm_buffer_bytes", &myccl::Config::shmBufferBytes)
      .def_readwrite("blocking_wait", &myccl::Config::blockingWait)
      .def_readwrite("avoid_record_streams", &myccl::Config::avoidRecordStreams)
      .def_readwrite("high_priority_stream", &myccl::Config::highPriorityStream)
      .def_readwrite("test_connect_delay_ms", &myccl::Config::testConnectDelayMs)
      .def_readwrite("flight_recorder_entries", &myccl::Config::flightRecorderEntries)
      .def_readwrite("flight_recorder_dump", &myccl::Config::flightRecorderDump);

  py::class_<myccl::MycclBackend, c10d::Backend, NoGilHolder<myccl::MycclBackend>>(m, "MycclBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string group, std::vector<int64_t> globalRanks,
                       myccl::Config cfg) {
             return c10::make_intrusive<myccl::MycclBackend>(store, rank, size, timeout, std::move(group),
                                                             std::move(globalRanks), std::move(cfg));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
           py::arg("global_ranks"), py::arg("config"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("group_name", &myccl::MycclBackend::groupName)
      .def_property_readonly("timeout", &myccl::MycclBackend::timeout)
      .def_property_readonly("local_rank", [](const myccl::MycclBackend& b) { return b.topology().localRank; })
      .def_property_readonly("local_size", [](const myccl::MycclBackend& b) { return b.topology().localSize; })
      .def_property_readonly("cross_rank", [](const myccl::MycclBackend& b) { return b.topology().crossRank; })
      .def_property_readonly("cross_size", [](const myccl::MycclBackend& b) { return b.topology().crossSize; })
      .def_property_readonly("local_ranks", [](const myccl::MycclBackend& b) { return b.topology().localRanks; })
      .def_property_readonly("host_of_rank", [](const myccl::MycclBackend& b) { return b.topology().hostOfRank; })
      .def_property_readonly("uses_shared_memory", &myccl::MycclBackend::usesSharedMemory)
      .def_property_readonly("rejected_connections", &myccl::MycclBackend::rejectedConnections)
      .def("describe_links", &myccl::MycclBackend::describeLinks)
      .def("shared_tensor", &myccl::MycclBackend::sharedTensor, py::arg("shape"), py::arg("dtype"),
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
      .def("stats", &myccl::MycclBackend::stats)
      .def("reset_stats", &myccl::MycclBackend::resetStats);

  m.def("build_info", []() {
    py::dict d;
    d["torch_version"] = MYCCL_TORCH_VERSION;
#ifdef MYCCL_WITH_NCCL
    d["with_nccl"] = true;
    d["nccl_runtime_version"] = myccl::cuda::NcclEngine::version();
#else
    d["with_nccl"] = false;
    d["nccl_runtime_version"] = py::none();
#endif
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
      [](std::vector<at::Tensor> ins, at::Tensor out, const std::string& op, int64_t divisor) {
        TORCH_CHECK(!ins.empty(), "need inputs");
        std::vector<const void*> ptrs;
        for (auto& t : ins) {
          TORCH_CHECK(t.is_contiguous() && t.scalar_type() == out.scalar_type() && t.numel() == out.numel(),
                      "inputs must be contiguous and match the output");
          ptrs.push_back(t.data_ptr());
        }
        TORCH_CHECK(out.is_contiguous(), "output must be contiguous");
        myccl::ReduceSpec spec{dtypeOf(out.scalar_type()), parseRedOp(op), divisor};
        py::gil_scoped_release nogil;
        myccl::cpu::reduceInto(spec, out.data_ptr(), ptrs.data(), static_cast<int>(ptrs.size()), out.numel());
      },
      py::arg("inputs"), py::arg("out"), py::arg("op"), py::arg("divisor") = 0);
}
