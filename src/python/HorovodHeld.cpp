// The held asynchronous allreduces of c10d_ext.horovod (agreed.py): each process set's pending
// list, and the handle numbers of every op, kept here so that an `allreduce_async` of a small
// CPU tensor is one call (the checks, its name, its handle, the fusion threshold) and its
// `synchronize` one more. What runs a list (the agreed step, or the negotiation when the ranks'
// lists differ) stays in Python; a list only holds the ops and, once run, their results.
//
// One mutex guards every set, list and handle: each call holds it only for its bookkeeping,
// and never while it makes or drops a Python object (an allocation may run the garbage collector,
// whose finalizers may switch threads, and the next thread's call would wait on the mutex while
// holding the GIL that this one needs).
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include <time.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "Bindings.hpp"
#include "Horovod.hpp"
#include "myccl/backend/Engines.hpp"

namespace py = pybind11;
namespace hvd = myccl::horovod;

namespace {

// A list's life: ops join it while it is open; it is sealed (closed to ops) once its bytes reach
// the fusion threshold or when it is taken to run; then it is done (results), failed (an error),
// or handed to the negotiation (its handles are Python's from then on).
enum State : int { kOpen = 0, kSealed = 1, kDone = 2, kFailed = 3, kHanded = 4 };

struct HeldOp {
  int64_t handle;
  int32_t first;
  int32_t count;
  bool single;  // an allreduce (its tensor), not a grouped one (a tuple)
};

struct HeldSet;

struct HeldList {
  int64_t owner = 0;  // the set's id
  std::weak_ptr<HeldSet> set;
  std::vector<at::Tensor> tensors;
  std::vector<bool> inplace;
  std::vector<std::string> names;
  std::vector<HeldOp> ops;
  std::vector<at::Tensor> results;
  int64_t op = 0;
  double post = 1.0;
  int64_t bytes = 0;
  double first = 0, last = 0;  // CLOCK_MONOTONIC seconds (Python's time.monotonic) of timed ops
  int state = kOpen;
  std::string error;
};

struct HeldSet {
  int64_t id = 0;
  int64_t threshold = 0;
  bool accepting = false;
  std::shared_ptr<HeldList> open;
  std::deque<std::shared_ptr<HeldList>> sealed;
  std::unordered_set<std::string> names;  // of the ops held and not yet finished
};

std::mutex gMu;
std::condition_variable gCv;  // a list finished, failed or was handed on
std::unordered_map<int64_t, std::pair<std::shared_ptr<HeldList>, int32_t>> gHandles;
std::unordered_map<int64_t, std::shared_ptr<HeldSet>> gSets;  // by process set id, while its thread runs
int64_t gNext = 0;  // the last handle number given (every op's, held or not)

double monotonic() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

bool holdable(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && !myccl::onCudaEngine(t) && t.layout() == at::kStrided && hvd::offerable(t.scalar_type()) &&
         t.is_contiguous();
}

// Called with gMu held. Whether the set takes an op of Horovod's op code `op` and `post` now.
bool takes(const HeldSet& s, int64_t op, double post) {
  const bool heldOp = op == 0 || op == 1 || (op >= 3 && op <= 5);  // Average Sum Min Max Product (agreed.OPS)
  return heldOp && s.accepting && (!s.open || (s.open->op == op && s.open->post == post));
}

// Called with gMu held, after the names were checked: the op joins the set's open list. Returns
// its handle shifted left by two, with bit 0 set when it is the list's first timed op (the set's
// thread starts timing the list) and bit 1 when the list reached the fusion threshold (sealed:
// it runs at once).
int64_t join(const std::shared_ptr<HeldSet>& sp, std::vector<at::Tensor>&& tensors, std::vector<std::string>&& names,
             bool inplace, int64_t op, double post, bool timed, bool single, int64_t handle) {
  HeldSet& s = *sp;
  if (!s.open) {
    s.open = std::make_shared<HeldList>();
    s.open->owner = s.id;
    s.open->set = sp;
    s.open->op = op;
    s.open->post = post;
  }
  HeldList& l = *s.open;
  gNext = std::max(gNext, handle);  // (add's handle was taken before, maybe with others since)
  const auto opIndex = static_cast<int32_t>(l.ops.size());
  l.ops.push_back(HeldOp{handle, static_cast<int32_t>(l.tensors.size()), static_cast<int32_t>(tensors.size()), single});
  for (auto& t : tensors) {
    l.bytes += t.numel() * static_cast<int64_t>(t.element_size());
    l.tensors.push_back(std::move(t));
    l.inplace.push_back(inplace);
  }
  for (auto& nm : names) {
    s.names.insert(nm);
    l.names.push_back(std::move(nm));
  }
  gHandles[handle] = {s.open, opIndex};
  int64_t flags = 0;
  if (timed) {
    l.last = monotonic();
    if (l.first == 0) {
      l.first = l.last;
      flags |= 1;
    }
  }
  if (s.threshold > 0 && l.bytes >= s.threshold) {
    l.state = kSealed;
    s.sealed.push_back(std::move(s.open));
    s.open.reset();
    flags |= 2;
  }
  return (handle << 2) | flags;
}

// Called with gMu held: the list is over (done, failed or handed on): its names may be used again.
void finishNames(HeldList& l) {
  if (auto s = l.set.lock())
    for (const auto& nm : l.names) s->names.erase(nm);
  gCv.notify_all();
}

// One allreduce of one tensor (allreduce_async / allreduce_async_, a timed op): its handle and
// flags (join above), 0 when the set does not hold it now or the tensor is not one it holds (the
// op goes the general way, which also gives Horovod's errors), -1 when its name is held.
int64_t addOne(const std::shared_ptr<HeldSet>& sp, const at::Tensor& tensor, PyObject* name, bool inplace,
               int64_t op, double post) {
  if (!holdable(tensor)) return 0;
  const bool named = PyObject_IsTrue(name) == 1;
  std::string nm = named ? "allreduce." + py::str(name).cast<std::string>() : std::string();
  std::lock_guard<std::mutex> g(gMu);
  if (!takes(*sp, op, post)) return 0;
  const int64_t h = gNext + 1;
  if (!named) nm = "allreduce.noname." + std::to_string(h);
  if (sp->names.count(nm)) return -1;
  std::vector<at::Tensor> ts{tensor};
  std::vector<std::string> ns{std::move(nm)};
  return join(sp, std::move(ts), std::move(ns), inplace, op, post, /*timed=*/true, /*single=*/true, h);
}

// The two calls an allreduce_async and its synchronize cost, as plain CPython functions (a
// pybind11 call costs as much again as their work).
//
// _hvd_hold(set_id, tensor, name, inplace, op, postscale) -> addOne's answer for the set of that
// id (0 for a set this process runs no thread of, or any argument of another type).
PyObject* holdOne(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 6 || !PyLong_Check(args[0]) || !THPVariable_Check(args[1]) || !PyLong_Check(args[4]) ||
      !(PyFloat_Check(args[5]) || PyLong_Check(args[5])))
    return PyLong_FromLong(0);
  const int64_t id = PyLong_AsLongLong(args[0]);
  const int64_t op = PyLong_AsLongLong(args[4]);
  const double post = PyFloat_AsDouble(args[5]);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return PyLong_FromLong(0);
  }
  std::shared_ptr<HeldSet> sp;
  {
    std::lock_guard<std::mutex> g(gMu);
    auto it = gSets.find(id);
    if (it == gSets.end()) return PyLong_FromLong(0);
    sp = it->second;
  }
  try {
    return PyLong_FromLongLong(addOne(sp, THPVariable_Unpack(args[1]), args[2], args[3] == Py_True, op, post));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

py::object resultOf(const HeldList& l, const HeldOp& o);

// _hvd_result(handle), synchronize's first step: the result of a held op that is done (its
// handle is then gone), its list while it is not (or failed: the handle is then gone too), None
// for any other handle.
PyObject* resultFast(PyObject*, PyObject* arg) {
  const int64_t handle = PyLong_AsLongLong(arg);
  if (handle == -1 && PyErr_Occurred()) return nullptr;
  std::shared_ptr<HeldList> l;
  HeldOp o{};
  bool done = false;
  {
    std::lock_guard<std::mutex> g(gMu);
    auto it = gHandles.find(handle);
    if (it == gHandles.end()) Py_RETURN_NONE;
    l = it->second.first;
    o = l->ops[it->second.second];
    done = l->state == kDone;
    if (done || l->state == kFailed) gHandles.erase(it);
  }
  // A done list's results are not written again: read without the mutex.
  if (done && o.single) return THPVariable_Wrap(l->results[o.first]);
  try {
    return (done ? resultOf(*l, o) : py::cast(l)).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyMethodDef gFast[] = {
    {"_hvd_hold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(holdOne)), METH_FASTCALL, nullptr},
    {"_hvd_result", resultFast, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};

py::object resultOf(const HeldList& l, const HeldOp& o) {
  if (o.single) return py::cast(l.results[o.first]);
  py::tuple t(o.count);
  for (int32_t i = 0; i < o.count; ++i) t[i] = py::cast(l.results[o.first + i]);
  return std::move(t);
}

std::vector<std::shared_ptr<HeldList>> takeAll(HeldSet& s) {
  std::vector<std::shared_ptr<HeldList>> all(s.sealed.begin(), s.sealed.end());
  s.sealed.clear();
  if (s.open) all.push_back(std::move(s.open));
  s.open.reset();
  for (auto& l : all) l->state = kSealed;
  return all;
}

}  // namespace

void bindHorovodHeld(py::module& m) {
  py::class_<HeldList, std::shared_ptr<HeldList>>(m, "_HeldList")
      .def_property_readonly("owner", [](const HeldList& l) { return l.owner; })
      .def_property_readonly("state", [](const HeldList& l) {
        std::lock_guard<std::mutex> g(gMu);
        return l.state;
      })
      .def_property_readonly("error", [](const HeldList& l) {
        std::lock_guard<std::mutex> g(gMu);
        return l.error;
      })
      // (tensors, inplace, names, op, postscale) of a taken list, for the agreed step
      .def("contents",
           [](const HeldList& l) {
             py::tuple names(l.names.size());
             for (size_t i = 0; i < l.names.size(); ++i) names[i] = py::str(l.names[i]);
             return py::make_tuple(py::cast(l.tensors), py::cast(l.inplace), names, l.op, l.post);
           })
      // [(handle, first tensor, tensor count, single)] of every op, in order
      .def("ops",
           [](const HeldList& l) {
             std::vector<std::tuple<int64_t, int32_t, int32_t, bool>> out;
             for (const auto& o : l.ops) out.emplace_back(o.handle, o.first, o.count, o.single);
             return out;
           })
      .def_property_readonly("op", [](const HeldList& l) { return l.op; })
      .def_property_readonly("post", [](const HeldList& l) { return l.post; })
      // Runs a taken list as one agreed step (the key of its names, op and postscale riding on
      // it; horovod::agreedMany): 1 done, 0 the ranks' lists differed (nothing written), -1 a tensor
      // it cannot offer, -2 one tensor the agreed op carries itself (the caller offers it with the
      // key a queued cycle would: agreed.run_list). No backend: a set of one, nothing reduced. A
      // negative `agree_bytes`: the ranks agreed already (key), every buffer a plain all_reduce.
      .def(
          "run",
          [](HeldList& l, myccl::MycclBackend* b, at::Tensor& agreed, const c10d::ReduceOp& op, double scale,
             int64_t fuseBytes, int64_t aloneBytes, int64_t agreeBytes) {
            if (l.tensors.size() == 1 && l.bytes <= agreeBytes) return -2;  // (never when agreed already)
            const int64_t key = b != nullptr ? static_cast<int64_t>(hvd::keyOfNames(l.names, l.op, l.post)) : 0;
            std::vector<at::Tensor> out;
            const int got = hvd::agreedMany(b, l.tensors, l.inplace, agreed, key, op, scale, fuseBytes, aloneBytes,
                                          agreeBytes, out);
            if (got == 1) {
              std::lock_guard<std::mutex> g(gMu);
              l.results = std::move(out);
              l.state = kDone;
              finishNames(l);
            }
            return got;
          },
          py::call_guard<py::gil_scoped_release>())
      // The key of a taken list (its names, op, postscale, every dtype and shape), as a signed
      // 64-bit number: what a member announces when the list's agreement rides on the
      // negotiation (sets across hosts, agreed.flush).
      .def("key",
           [](const HeldList& l) {
             return static_cast<int64_t>(hvd::keyOfTensors(hvd::keyOfNames(l.names, l.op, l.post), l.tensors));
           })
      .def("complete",
           [](HeldList& l, std::vector<at::Tensor> results) {
             if (results.size() != l.tensors.size())
               throw std::invalid_argument("myccl: hvd held list: " + std::to_string(results.size()) +
                                           " results for " + std::to_string(l.tensors.size()) + " tensors");
             std::lock_guard<std::mutex> g(gMu);
             l.results = std::move(results);
             l.state = kDone;
             finishNames(l);
           })
      .def("fail",
           [](HeldList& l, const std::string& error) {
             std::lock_guard<std::mutex> g(gMu);
             if (l.state == kDone || l.state == kFailed || l.state == kHanded) return;
             l.error = error;
             l.state = kFailed;
             finishNames(l);
           })
      // The ranks' lists differed: every op's handle is Python's from here (the caller made an
      // op of the negotiation for each first); the names go into the negotiation's table.
      .def("handoff",
           [](HeldList& l) {
             std::lock_guard<std::mutex> g(gMu);
             for (const auto& o : l.ops) gHandles.erase(o.handle);
             l.state = kHanded;
             finishNames(l);
           })
      // Waits up to `seconds` for the list to be over; whether it is.
      .def(
          "wait",
          [](HeldList& l, double seconds) {
            std::unique_lock<std::mutex> g(gMu);
            return gCv.wait_for(g, std::chrono::duration<double>(seconds), [&] { return l.state >= kDone; });
          },
          py::call_guard<py::gil_scoped_release>());

  py::class_<HeldSet, std::shared_ptr<HeldSet>>(m, "_HeldSet")
      .def(py::init([](int64_t id, int64_t threshold) {
        auto s = std::make_shared<HeldSet>();
        s->id = id;
        s->threshold = threshold;
        std::lock_guard<std::mutex> g(gMu);
        gSets[id] = s;  // _hvd_hold finds it by the set's id
        return s;
      }))
      .def("close",  // the set's thread stopped: _hvd_hold no longer finds it
           [](const std::shared_ptr<HeldSet>& sp) {
             std::lock_guard<std::mutex> g(gMu);
             auto it = gSets.find(sp->id);
             if (it != gSets.end() && it->second == sp) gSets.erase(it);
           })
      .def_property(  // the fusion threshold at which a list is sealed (agreed by the set's members)
          "threshold",
          [](const HeldSet& s) {
            std::lock_guard<std::mutex> g(gMu);
            return s.threshold;
          },
          [](HeldSet& s, int64_t v) {
            std::lock_guard<std::mutex> g(gMu);
            s.threshold = v;
          })
      .def_property(
          "accepting",
          [](const HeldSet& s) {
            std::lock_guard<std::mutex> g(gMu);
            return s.accepting;
          },
          [](HeldSet& s, bool v) {
            std::lock_guard<std::mutex> g(gMu);
            s.accepting = v;
          })
      // Any allreduce (agreed.defer), each tensor's full name and the op's handle number (taken
      // before it was named: _hvd_next_handle) given: as addOne, `timed` False for ops whose
      // caller always waits on them (DistributedOptimizer's).
      .def("add",
           [](const std::shared_ptr<HeldSet>& sp, std::vector<at::Tensor> tensors, std::vector<std::string> names,
              bool inplace, int64_t op, double post, bool timed, bool single, int64_t handle) -> int64_t {
             if (tensors.empty() || names.size() != tensors.size()) return 0;
             for (const auto& t : tensors)
               if (!holdable(t)) return 0;
             std::lock_guard<std::mutex> g(gMu);
             if (!takes(*sp, op, post)) return 0;
             for (const auto& nm : names)
               if (sp->names.count(nm)) return -1;
             return join(sp, std::move(tensors), std::move(names), inplace, op, post, timed, single, handle);
           })
      .def_property_readonly("held_ops",  // ops in the open and sealed lists
                             [](const HeldSet& s) {
                               std::lock_guard<std::mutex> g(gMu);
                               size_t n = s.open ? s.open->ops.size() : 0;
                               for (const auto& l : s.sealed) n += l->ops.size();
                               return n;
                             })
      .def("holds",
           [](const HeldSet& s, const std::string& name) {
             std::lock_guard<std::mutex> g(gMu);
             return s.names.count(name) > 0;
           })
      .def_property_readonly("has_open",
                             [](const HeldSet& s) {
                               std::lock_guard<std::mutex> g(gMu);
                               return static_cast<bool>(s.open);
                             })
      .def_property_readonly("has_sealed",
                             [](const HeldSet& s) {
                               std::lock_guard<std::mutex> g(gMu);
                               return !s.sealed.empty();
                             })
      // When the open list is due to run on the set's thread (monotonic seconds): `idle` after
      // its last timed op, at most `cap` after its first; infinity when it holds untimed ops only.
      .def("due",
           [](const HeldSet& s, double idle, double cap) {
             std::lock_guard<std::mutex> g(gMu);
             if (!s.open || s.open->first == 0) return std::numeric_limits<double>::infinity();
             return std::min(s.open->last + idle, s.open->first + cap);
           })
      // The next list to run: the oldest sealed one, else (`open` True) the open one; None if none.
      .def("take",
           [](HeldSet& s, bool open) -> std::shared_ptr<HeldList> {
             std::lock_guard<std::mutex> g(gMu);
             std::shared_ptr<HeldList> l;
             if (!s.sealed.empty()) {
               l = std::move(s.sealed.front());
               s.sealed.pop_front();
             } else if (open && s.open) {
               l = std::move(s.open);
               s.open.reset();
               l->state = kSealed;
             }
             return l;  // (None when empty)
           })
      .def("take_all", [](HeldSet& s) {
        std::lock_guard<std::mutex> g(gMu);
        s.accepting = false;
        return takeAll(s);
      });

  PyModule_AddFunctions(m.ptr(), gFast);  // _hvd_hold, _hvd_result
  // poll: 1 done (or failed), 0 not yet, -1 not a held op's handle, 2 not yet and its list was
  // untimed (only a synchronize would have run it): from now on it is timed like any other, and
  // the caller wakes the set's thread to time it. A job that only polls still sees it finish.
  m.def("_hvd_poll", [](int64_t handle) {
    std::lock_guard<std::mutex> g(gMu);
    auto it = gHandles.find(handle);
    if (it == gHandles.end()) return -1;
    HeldList& l = *it->second.first;
    if (l.state >= kDone) return 1;
    if (l.state == kOpen && l.first == 0) {
      l.first = l.last = monotonic();
      return 2;
    }
    return 0;
  });
  m.def("_hvd_next_handle", [] {
    std::lock_guard<std::mutex> g(gMu);
    return ++gNext;
  });
  m.def("_hvd_reset_handles", [] {
    std::lock_guard<std::mutex> g(gMu);
    gHandles.clear();
    gNext = 0;
  });
}
