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
#include "myccl/cpu/Copy.hpp"
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

// ==== DDP Reducer bindings (c10d_ext.DistributedDataParallel, src/reducer) ====================
// One block for the Reducer: the Python comm-hook adapter, GradBucket, Reducer and the model
// state helpers. Called once, as the last line of PYBIND11_MODULE.
#include <torch/csrc/jit/python/pybind_utils.h>

#include "myccl/reducer/Reducer.hpp"

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
    d["ready_us"] = b.readyUs;
    d["launch_us"] = b.launchUs;
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
// ==== end of DDP Reducer bindings =============================================================

PYBIND11_DECLARE_HOLDER_TYPE(T, NoGilHolder<T>, true);

PYBIND11_MODULE(_C, m) {
  // The torch-version guard runs in c10d_ext/__init__.py, before this module is loaded: a build
  // for another torch may not even link against the torch in this process.
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
      .def_readwrite("local_eager_bytes", &myccl::Config::localEagerBytes)
      .def_readwrite("copy_threads", &myccl::Config::copyThreads)
      .def_readwrite("sockets_per_peer", &myccl::Config::socketsPerPeer)
      .def_readwrite("tcp_chunk_bytes", &myccl::Config::tcpChunkBytes)
      .def_readwrite("spin_us", &myccl::Config::spinUs)
      .def_readwrite("stream_store_bytes", &myccl::Config::streamStoreBytes)
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
      [](std::vector<at::Tensor> ins, at::Tensor out, const std::string& op, int64_t divisor, double scale) {
        TORCH_CHECK(!ins.empty(), "need inputs");
        std::vector<const void*> ptrs;
        for (auto& t : ins) {
          TORCH_CHECK(t.is_contiguous() && t.scalar_type() == out.scalar_type() && t.numel() == out.numel(),
                      "inputs must be contiguous and match the output");
          ptrs.push_back(t.data_ptr());
        }
        TORCH_CHECK(out.is_contiguous(), "output must be contiguous");
        myccl::ReduceSpec spec{dtypeOf(out.scalar_type()), parseRedOp(op), divisor, scale};
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

  bindReducer(m);
}
