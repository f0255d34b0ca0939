// Model-state agreement for DDP: the construction-time check that every rank built the same
// parameters (naming the first that differs), and coalesced broadcasts of parameters and
// buffers from one rank.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>

#include <map>
#include <sstream>
#include <tuple>

#include "myccl/Errors.hpp"
#include "myccl/reducer/Reducer.hpp"

namespace myccl::reducer {

namespace {

// Per parameter: dtype, layout, ndim, then sizes and strides (kMaxDims each, -1 padded; a
// deeper tensor folds the rest into the last slot).
constexpr int kMaxDims = 8;
constexpr int kSigLen = 3 + 2 * kMaxDims;

void signature(const at::Tensor& t, int64_t* out) {
  out[0] = static_cast<int64_t>(t.scalar_type());
  out[1] = static_cast<int64_t>(t.layout());
  out[2] = t.dim();
  const bool strided = t.layout() == at::kStrided;
  for (int d = 0; d < kMaxDims; ++d) {
    out[3 + d] = -1;
    out[3 + kMaxDims + d] = -1;
  }
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int slot = static_cast<int>(std::min<int64_t>(d, kMaxDims - 1));
    const int64_t size = t.size(d), stride = strided ? t.stride(d) : 0;
    out[3 + slot] = d < kMaxDims - 1 ? size : out[3 + slot] * 31 + size;
    out[3 + kMaxDims + slot] = d < kMaxDims - 1 ? stride : out[3 + kMaxDims + slot] * 31 + stride;
  }
}

std::string describeSig(const int64_t* s) {
  if (s[0] < 0) return "no such parameter";
  std::ostringstream os;
  os << c10::toString(static_cast<at::ScalarType>(s[0])) << " [";
  for (int64_t d = 0; d < std::min<int64_t>(s[2], kMaxDims); ++d) os << (d ? ", " : "") << s[3 + d];
  if (s[2] > kMaxDims) os << ", ...";
  os << "] strides [";
  for (int64_t d = 0; d < std::min<int64_t>(s[2], kMaxDims); ++d) os << (d ? ", " : "") << s[3 + kMaxDims + d];
  os << "]" << (s[1] == static_cast<int64_t>(at::kStrided) ? "" : " sparse");
  return os.str();
}

std::vector<at::Tensor> allgather(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const at::Tensor& in) {
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int r = 0; r < pg->getSize(); ++r) outs[0].push_back(at::empty_like(in));
  std::vector<at::Tensor> ins{in};
  pg->allgather(outs, ins)->wait();
  std::vector<at::Tensor> host;
  for (auto& t : outs[0]) host.push_back(t.cpu());
  return host;
}

}  // namespace

void verifyParamsAcrossRanks(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::vector<at::Tensor>& params,
                             const std::vector<std::string>& names) {
  const int size = pg->getSize(), rank = pg->getRank();
  if (size == 1) return;
  const auto device = params.empty() ? c10::Device(at::kCPU) : params[0].device();
  const auto onDevice = [&](const at::Tensor& t) { return device.is_cpu() ? t : t.to(device); };
  // Counts first: the signature exchange needs equal sizes everywhere.
  auto counts = allgather(pg, onDevice(at::full({1}, static_cast<int64_t>(params.size()), at::kLong)));
  int64_t maxCount = 0;
  for (auto& c : counts) maxCount = std::max(maxCount, c.item<int64_t>());
  at::Tensor mine = at::full({std::max<int64_t>(maxCount, 1), kSigLen}, -1, at::kLong);
  for (size_t i = 0; i < params.size(); ++i) signature(params[i], mine.data_ptr<int64_t>() + i * kSigLen);
  auto sigs = allgather(pg, onDevice(mine));
  for (int64_t i = 0; i < maxCount; ++i) {
    const int64_t* ref = sigs[0].data_ptr<int64_t>() + i * kSigLen;
    bool same = true;
    for (int r = 1; r < size && same; ++r)
      same = std::equal(ref, ref + kSigLen, sigs[r].data_ptr<int64_t>() + i * kSigLen);
    if (same) continue;
    std::ostringstream os;
    for (int r = 0; r < size; ++r)
      os << (r ? "; " : "") << "rank " << r << ": " << describeSig(sigs[r].data_ptr<int64_t>() + i * kSigLen);
    const std::string name = i < static_cast<int64_t>(names.size()) ? names[i] : std::string("(beyond this rank's ") +
                                                                                  std::to_string(names.size()) +
                                                                                  " parameters)";
    std::ostringstream cs;
    for (int r = 0; r < size; ++r) cs << (r ? ", " : "") << counts[r].item<int64_t>();
    MYCCL_CHECK(false, "ddp: rank ", rank, ": parameter '", name, "' (index ", i,
                ") differs across ranks: ", os.str(), ". Parameters per rank: ", cs.str(),
                ". Every rank must build the same model before wrapping it in DistributedDataParallel.");
  }
}

void broadcastCoalesced(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::vector<at::Tensor>& tensors,
                        int64_t chunkBytes, int root) {
  if (pg->getSize() == 1 || tensors.empty()) return;
  at::NoGradGuard noGrad;
  // Chunks per (dtype, device) in first-appearance order; every rank builds the same ones.
  using Key = std::tuple<int, int, int>;
  std::vector<Key> keys;
  std::map<Key, std::vector<std::vector<size_t>>> chunks;
  std::map<Key, int64_t> fill;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    MYCCL_CHECK(t.layout() == at::kStrided, "ddp: broadcast of model state: tensor ", i, " is not dense");
    const Key k{static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
                static_cast<int>(t.device().index())};
    auto& cs = chunks[k];
    if (cs.empty()) keys.push_back(k);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (cs.empty() || (fill[k] > 0 && fill[k] + nbytes > chunkBytes)) {
      cs.emplace_back();
      fill[k] = 0;
    }
    cs.back().push_back(i);
    fill[k] += nbytes;
  }
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  for (const auto& k : keys) {
    for (const auto& members : chunks[k]) {
      std::vector<at::Tensor> parts;
      for (size_t i : members) parts.push_back(tensors[i].detach().reshape({-1}));
      std::vector<at::Tensor> flat{at::cat(parts)};
      pg->broadcast(flat, opts)->wait();
      if (pg->getRank() == root) continue;
      int64_t off = 0;
      for (size_t i : members) {
        const auto n = tensors[i].numel();
        tensors[i].detach().copy_(flat[0].narrow(0, off, n).view(tensors[i].sizes()));
        off += n;
      }
    }
  }
}

}  // namespace myccl::reducer
