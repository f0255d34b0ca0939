// The module's part for c10d_ext.horovod: its one-step path, the agreed all_reduce (an op of the
// CPU engine's extension point, cpu/extensions/AgreedAllreduce.hpp) run through the backend and
// waited for on the caller's thread, of one tensor or of a list
// (fused as Horovod fuses, the agreement riding on the first buffer). What Python would pay per
// tensor (checks, views, the key's shapes) is paid here once per op.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "Bindings.hpp"
#include "Horovod.hpp"
#include "myccl/Arguments.hpp"
#include "myccl/backend/Engines.hpp"
#include "myccl/cpu/extensions/AgreedAllreduce.hpp"

namespace py = pybind11;

namespace myccl::horovod {

c10::intrusive_ptr<c10d::Work> agreedAllreduce(MycclBackend& b, at::Tensor& t, at::Tensor& agreed, int64_t key,
                                               const c10d::ReduceOp& op) {
  const Where w{"agreed all_reduce", b.getRank()};
  auto run = cpu::agreedAllreduce(w, t, agreed, key, op, b.getSize());
  MYCCL_CHECK_ARG(!b.onDevice(t), w, ": runs on the CPU engine only, and this group sends ", describe(t),
                  " to the CUDA engine");
  return b.runExtension(std::move(run), {t}, {t, agreed});
}

bool agreedAvailable(MycclBackend& b) {
  // The same answer on every rank: where the CUDA engine takes CPU tensors too, no CPU op has them.
  if (b.onDevice(at::Device(at::kCPU))) return false;
  return cpu::agreedApplies(b.topology(), b.usesSharedMemory());
}

namespace {

bool agreedWait(myccl::MycclBackend& b, at::Tensor& t, at::Tensor& agreed, int64_t key, const c10d::ReduceOp& op) {
  agreedAllreduce(b, t, agreed, key, op)->wait();
  return *static_cast<const uint8_t*>(agreed.data_ptr()) != 0;
}

}  // namespace

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

namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h * 0x100000001B3ull;
}

// One collective of an agreed list: a fusion buffer of tensors of one dtype, or one tensor alone.
struct Chunk {
  std::vector<size_t> members;
  int64_t numel = 0;
  int64_t bytes = 0;
  bool fused = false;
};

// Horovod's fusion, the same on every rank for the same list: a tensor of `aloneBytes` or more (or
// every tensor, with no fusion threshold) goes alone; smaller ones join the open buffer of their
// dtype until it would pass `fuseBytes`. Buffers run in the order they were opened.
std::vector<Chunk> plan(const std::vector<at::Tensor>& tensors, int64_t fuseBytes, int64_t aloneBytes) {
  std::vector<Chunk> chunks;
  std::vector<std::pair<at::ScalarType, size_t>> open;  // dtype -> its open buffer
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const int64_t n = t.numel() * static_cast<int64_t>(t.element_size());
    if (fuseBytes <= 0 || n >= aloneBytes || n > fuseBytes) {
      chunks.push_back(Chunk{{i}, t.numel(), n, false});
      continue;
    }
    auto it = std::find_if(open.begin(), open.end(), [&](const auto& o) { return o.first == t.scalar_type(); });
    if (it != open.end() && chunks[it->second].bytes + n > fuseBytes) {
      open.erase(it);
      it = open.end();
    }
    if (it == open.end()) {
      open.emplace_back(t.scalar_type(), chunks.size());
      chunks.push_back(Chunk{{}, 0, 0, true});
      it = std::prev(open.end());
    }
    Chunk& c = chunks[it->second];
    c.members.push_back(i);
    c.numel += t.numel();
    c.bytes += n;
  }
  return chunks;
}

}  // namespace

uint64_t keyOfTensors(uint64_t key, const std::vector<at::Tensor>& tensors) {
  uint64_t h = key;
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cpu() || myccl::onCudaEngine(t) || t.layout() != at::kStrided || !offerable(t.scalar_type()) ||
        !t.is_contiguous())
      return 0;
    h = mix(mix(h, static_cast<uint64_t>(t.scalar_type())), static_cast<uint64_t>(t.dim()));
    for (int64_t s : t.sizes()) h = mix(h, static_cast<uint64_t>(s));
  }
  return h ? h : 1;  // 0 means "no offer"
}

int agreedMany(MycclBackend* b, const std::vector<at::Tensor>& tensors, const std::vector<bool>& inplace,
               at::Tensor& agreed, int64_t key, const c10d::ReduceOp& op, double scale, int64_t fuseBytes,
                  int64_t aloneBytes, int64_t agreeBytes, std::vector<at::Tensor>& out) {
  if (tensors.empty() || inplace.size() != tensors.size()) return -1;
  const uint64_t h = keyOfTensors(static_cast<uint64_t>(key), tensors);
  if (h == 0) return -1;
  const bool agreeHere = agreeBytes >= 0;  // else the ranks agreed already: plain all_reduces only
  out.assign(tensors.size(), at::Tensor());
  bool ok = true;
  const auto chunks = plan(tensors, fuseBytes, aloneBytes);
  // The carrier of the agreement (the first chunk small enough) runs first, then the plan's order.
  const auto carrier = std::find_if(chunks.begin(), chunks.end(),
                                    [&](const Chunk& ch) { return ch.bytes <= agreeBytes; });
  const bool carried = agreeHere && carrier != chunks.end();
  std::vector<size_t> order;
  if (carried) order.push_back(static_cast<size_t>(carrier - chunks.begin()));
  for (size_t c = 0; c < chunks.size(); ++c)
    if (!carried || c != order[0]) order.push_back(c);
  if (b != nullptr && agreeHere && !carried) {
    at::Tensor probe = at::zeros({1}, at::kFloat);
    ok = agreedWait(*b, probe, agreed, static_cast<int64_t>(h), op);
  }
  for (size_t k = 0; k < order.size() && ok; ++k) {
    const size_t c = order[k];
    const Chunk& ch = chunks[c];
    const bool alone = ch.members.size() == 1 && !ch.fused;
    const at::Tensor& first = tensors[ch.members[0]];
    at::Tensor buf;
    if (alone)
      buf = inplace[ch.members[0]] ? first : first.clone();
    else
      buf = at::empty({ch.numel}, first.options());
    char* base = static_cast<char*>(buf.data_ptr());
    const size_t item = buf.element_size();
    if (!alone) {
      size_t off = 0;
      for (size_t i : ch.members) {
        const size_t n = tensors[i].numel() * item;
        if (n) std::memcpy(base + off, tensors[i].data_ptr(), n);
        off += n;
      }
    }
    if (b != nullptr) {
      if (k == 0 && carried) {
        ok = agreedWait(*b, buf, agreed, static_cast<int64_t>(h), op);
        if (!ok) break;
      } else {
        std::vector<at::Tensor> one{buf};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        opts.asyncOp = false;
        b->allreduce(one, opts)->wait();
      }
    }
    if (scale != 1.0) {
      if (at::isFloatingType(buf.scalar_type()))
        buf.mul_(scale);
      else
        buf.copy_((buf.to(at::kDouble) * scale).trunc());
    }
    if (alone) {
      out[ch.members[0]] = buf;
      continue;
    }
    size_t off = 0;
    for (size_t i : ch.members) {
      const at::Tensor& t = tensors[i];
      // (empty_cpu: the allocation without a trip through the dispatcher per tensor)
      at::Tensor dst = inplace[i] ? t : at::Tensor(at::detail::empty_cpu(t.sizes(), t.scalar_type()));
      const size_t n = t.numel() * item;
      if (n) std::memcpy(dst.data_ptr(), base + off, n);
      off += n;
      out[i] = std::move(dst);
    }
  }
  return ok ? 1 : 0;
}

uint64_t keyOfNames(const std::vector<std::string>& names, int64_t op, double post) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the names, each ended by a zero byte
  for (const auto& nm : names) {
    for (unsigned char c : nm) h = (h ^ c) * 0x100000001B3ull;
    h *= 0x100000001B3ull;
  }
  uint64_t bits = 0;
  std::memcpy(&bits, &post, sizeof bits);
  h = mix(mix(h, static_cast<uint64_t>(op)), bits);
  return h ? h : 1;  // 0 means "no offer"
}

}  // namespace myccl::horovod

namespace hvd = myccl::horovod;

void bindHorovod(py::module& m) {
  // The key of a list of names with its op and postscale (_HeldList.run, agreed._key_many).
  m.def("_hvd_key", [](const std::vector<std::string>& names, int64_t op, double post) {
    return static_cast<int64_t>(hvd::keyOfNames(names, op, post));
  });

  // One tensor: whether every rank agreed (the tensor then holds the result).
  m.def("_agreed_all_reduce_wait", &hvd::agreedWait, py::arg("backend"), py::arg("tensor"), py::arg("agreed"),
        py::arg("key"), py::arg("op"), py::call_guard<py::gil_scoped_release>());

  // Many tensors as one agreed step: the key (their names and what else must agree, with every
  // tensor's dtype and shape folded in here) goes with the first collective, so the rest run
  // only where every rank offered the same list. The first is a buffer of at most `agree_bytes`
  // (the agreed op is a one-step reduction of what shared memory stages at once), else a
  // one-element step that carries the key alone. Tensors under `alone_bytes` are fused, per
  // dtype, into buffers of at most `fuse_bytes` (Horovod's fusion threshold; 0: no fusion);
  // larger ones are reduced where they lie (in place) or in a copy. Returns None when one of
  // them is not what the op offers (not a dense contiguous CPU tensor of a reducible dtype):
  // nothing ran. False when the ranks did not all agree: nothing was written. Otherwise the
  // results, scaled by `scale` as Horovod scales (integers through a double, truncated): each
  // tensor itself where `inplace` says so, else a new one. Without a backend (a set of one)
  // nothing is reduced.
  m.def(
      "_agreed_all_reduce_many",
      [](myccl::MycclBackend* b, const std::vector<at::Tensor>& tensors, const std::vector<bool>& inplace,
         at::Tensor& agreed, int64_t key, const c10d::ReduceOp& op, double scale, int64_t fuseBytes,
         int64_t aloneBytes, int64_t agreeBytes) -> py::object {
        std::vector<at::Tensor> out;
        int got;
        {
          py::gil_scoped_release nogil;
          got = hvd::agreedMany(b, tensors, inplace, agreed, key, op, scale, fuseBytes, aloneBytes, agreeBytes, out);
        }
        if (got < 0) return py::none();
        if (got == 0) return py::bool_(false);  // declined (a list of none is never offered)
        return py::cast(out);
      },
      py::arg("backend"), py::arg("tensors"), py::arg("inplace"), py::arg("agreed"), py::arg("key"), py::arg("op"),
      py::arg("scale"), py::arg("fuse_bytes"), py::arg("alone_bytes"), py::arg("agree_bytes"));
}
