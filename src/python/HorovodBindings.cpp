// The module's part for c10d_ext.horovod: its one-step path, the agreed all_reduce
// (MycclBackend::agreedAllreduce) waited for on the caller's thread, of one tensor or of many
// fused into one buffer. What Python would pay per tensor (checks, views, the key's shapes) is
// paid here once per op.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include <cstring>

#include "Bindings.hpp"
#include "myccl/ProcessGroupMyccl.hpp"

namespace py = pybind11;

namespace {

bool agreedWait(myccl::MycclBackend& b, at::Tensor& t, at::Tensor& agreed, int64_t key, const c10d::ReduceOp& op) {
  b.agreedAllreduce(t, agreed, key, op)->wait();
  return *static_cast<const uint8_t*>(agreed.data_ptr()) != 0;
}

bool offerable(at::ScalarType s) {
  switch (s) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kInt:
    case at::kLong: return true;
    default: return false;
  }
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0x100000001B3ull;
}

}  // namespace

void bindHorovod(py::module& m) {
  // One tensor: whether every rank agreed (the tensor then holds the result).
  m.def("_agreed_all_reduce_wait", &agreedWait, py::arg("backend"), py::arg("tensor"), py::arg("agreed"),
        py::arg("key"), py::arg("op"), py::call_guard<py::gil_scoped_release>());

  // Many tensors of one dtype as one fused buffer. `key` stands for their names and what else
  // must agree; their shapes and dtype are folded in here. Returns None when one of them is not
  // what the op offers (not a dense contiguous CPU tensor of a reducible dtype, or dtypes
  // differ) or when they come to more than `max_bytes` (Horovod's fusion threshold: its fusion
  // would split them): nothing ran. False when the ranks did not all agree: nothing was written. Otherwise
  // the results, scaled by `scale` as Horovod scales (integers through a double, truncated): the
  // tensors themselves (`inplace`) or new ones. Without a backend (a set of one) nothing is
  // reduced. Per tensor, no view and no Python object is made beyond the results.
  m.def(
      "_agreed_all_reduce_many",
      [](myccl::MycclBackend* b, const std::vector<at::Tensor>& tensors, at::Tensor& agreed, int64_t key,
         const c10d::ReduceOp& op, double scale, bool inplace, int64_t maxBytes) -> py::object {
        if (tensors.empty()) return py::none();
        const auto dtype = tensors[0].scalar_type();
        if (!offerable(dtype)) return py::none();
        uint64_t h = mix(static_cast<uint64_t>(key), static_cast<uint64_t>(dtype));
        int64_t total = 0;
        for (const auto& t : tensors) {
          if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || t.scalar_type() != dtype ||
              !t.is_contiguous())
            return py::none();
          h = mix(h, static_cast<uint64_t>(t.dim()));
          for (int64_t s : t.sizes()) h = mix(h, static_cast<uint64_t>(s));
          total += t.numel();
        }
        if (total * static_cast<int64_t>(c10::elementSize(dtype)) > maxBytes) return py::none();
        if (h == 0) h = 1;  // 0 means "no offer"
        at::Tensor buf = at::empty({total}, tensors[0].options());
        const size_t item = buf.element_size();
        char* base = static_cast<char*>(buf.data_ptr());
        std::vector<at::Tensor> out;
        {
          py::gil_scoped_release nogil;
          size_t off = 0;
          for (const auto& t : tensors) {
            const size_t n = t.numel() * item;
            if (n) std::memcpy(base + off, t.data_ptr(), n);
            off += n;
          }
          if (b == nullptr || agreedWait(*b, buf, agreed, static_cast<int64_t>(h), op)) {
            if (scale != 1.0) {
              if (at::isFloatingType(dtype))
                buf.mul_(scale);
              else
                buf.copy_((buf.to(at::kDouble) * scale).trunc());
            }
            out.reserve(tensors.size());
            off = 0;
            for (const auto& t : tensors) {
              at::Tensor dst = inplace ? t : at::empty(t.sizes(), t.options());
              const size_t n = t.numel() * item;
              if (n) std::memcpy(dst.data_ptr(), base + off, n);
              off += n;
              out.push_back(std::move(dst));
            }
          }
        }
        if (out.empty()) return py::bool_(false);  // declined (a list of none is never offered)
        return py::cast(out);
      },
      py::arg("backend"), py::arg("tensors"), py::arg("agreed"), py::arg("key"), py::arg("op"), py::arg("scale"),
      py::arg("inplace"), py::arg("max_bytes"));
}
