// Argument vocabulary of the backend (see Arguments.hpp).
#include "myccl/Arguments.hpp"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <typeinfo>

#include "myccl/Errors.hpp"
#include "myccl/TorchCompat.hpp"

namespace myccl {

// Only the types the kernels cannot reduce are named here; the others by dtypeName(DType).
std::string scalarTypeName(at::ScalarType st) {
  if (auto dt = dtypeOf(st)) return dtypeName(*dt);
  switch (st) {
    case at::kComplexHalf: return "complex32";
    case at::kUInt16: return "uint16";
    default: return c10::toString(st);
  }
}

std::string shapeOf(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d) s += ", ";
    s += std::to_string(t.size(d));
  }
  return s + "]";
}

std::string describe(const at::Tensor& t) {
  return scalarTypeName(t.scalar_type()) + shapeOf(t) + " on " + t.device().str();
}

std::optional<DType> dtypeOf(at::ScalarType st) {
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
    case at::kUInt32: return DType::U32;
    case at::kUInt64: return DType::U64;
    case at::kFloat8_e4m3fn: return DType::F8E4M3;
    case at::kFloat8_e5m2: return DType::F8E5M2;
    default: return std::nullopt;
  }
}

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

void annotate(OpInfo& i, const at::Tensor& t, int64_t root, const char* redop) {
  i.dtype = scalarTypeName(t.scalar_type());
  i.shape = shapeOf(t);
  i.bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
  i.root = root;
  if (redop) i.redop = redop;
}

Reduction toReduction(const Where& w, const at::Tensor& t, const c10d::ReduceOp& rop, int size, bool onDevice) {
  Reduction r;
  const auto dtype = dtypeOf(t.scalar_type());
  MYCCL_CHECK_ARG(dtype.has_value(), w, ": reductions are not supported for dtype ", scalarTypeName(t.scalar_type()),
                  " (supported: float32, float64, float16, bfloat16, int8, int16, int32, int64, uint8, bool, "
                  "complex64, complex128; on CUDA tensors also uint32, uint64, float8_e4m3fn, float8_e5m2)");
  MYCCL_CHECK_ARG(onDevice || cpuReducible(*dtype), w, ": reductions of dtype ", scalarTypeName(t.scalar_type()),
                  " are supported for CUDA tensors only (NCCL reduces them); CPU tensors: float32, float64, float16, "
                  "bfloat16, int8, int16, int32, int64, uint8, bool, complex64, complex128");
  r.spec.dtype = *dtype;
  const DType dt = r.spec.dtype;
  const bool floating = isFloating(dt), complex = isComplex(dt), boolean = dt == DType::Bool;
  const char* name = reduceOpName(rop.op_);
  auto reject = [&](const char* why) {
    MYCCL_CHECK_ARG(false, w, ": ReduceOp.", name, " is not defined for dtype ", scalarTypeName(t.scalar_type()), " (",
                    why, ")");
  };
  switch (rop.op_) {
    case c10d::ReduceOp::SUM: r.spec.op = RedOp::Sum; break;
    case c10d::ReduceOp::PRODUCT: r.spec.op = RedOp::Prod; break;
    case c10d::ReduceOp::AVG:
      if (boolean) reject("averaging booleans has no meaning; use SUM (logical or) or MIN (logical and)");
      r.spec.op = RedOp::Sum;
      r.spec.divisor = size;
      break;
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      if (complex) reject("complex numbers are not ordered");
      r.spec.op = rop.op_ == c10d::ReduceOp::MIN ? RedOp::Min : RedOp::Max;
      break;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (floating || complex) reject("bitwise operators need an integer or bool dtype");
      r.spec.op = rop.op_ == c10d::ReduceOp::BAND ? RedOp::BAnd : rop.op_ == c10d::ReduceOp::BOR ? RedOp::BOr : RedOp::BXor;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!floating && !complex) reject("the pre-multiplication factor is a float");
      auto* sup = dynamic_cast<compat::PreMulSumSupplement*>(rop.supplement_.get());
      MYCCL_CHECK_ARG(sup != nullptr, w, ": ReduceOp.PREMUL_SUM without a factor; build it with "
                                       "torch.distributed._make_nccl_premul_sum(factor)");
      r.spec.op = RedOp::Sum;
      r.premul = true;
      if (sup->tensor_factor.defined()) {
        MYCCL_CHECK_ARG(sup->tensor_factor.numel() == 1, w, ": PREMUL_SUM factor must have one element, got ",
                        shapeOf(sup->tensor_factor));
        r.factorTensor = sup->tensor_factor;
        // Only a CPU op needs the value on the host; reading a device factor here would
        // synchronise with its device, which a CUDA op must never do while being issued.
        if (t.device().is_cpu()) r.factor = sup->tensor_factor.to(at::kCPU).to(at::kDouble).item<double>();
      } else {
        r.factor = sup->double_factor;
      }
      break;
    }
    default:
      MYCCL_CHECK_ARG(false, w, ": unknown ReduceOp ", static_cast<int>(rop.op_));
  }
  return r;
}

void checkRoot(const Where& w, int64_t root, int size) {
  MYCCL_CHECK_ARG(root >= 0 && root < size, w, ": root ", root, " is not a rank of this group (size ", size, ")");
}

void checkPeer(const Where& w, int peer, int rank, int size, bool selfAllowed) {
  MYCCL_CHECK_ARG(peer >= 0 && peer < size, w, ": peer rank ", peer, " is not a rank of this group (size ", size, ")");
  MYCCL_CHECK_ARG(selfAllowed || peer != rank, w, ": peer rank ", peer,
                  " is this rank; myccl does not send to itself for CPU tensors (CUDA tensors can)");
}

const at::Tensor& single(const Where& w, const std::vector<at::Tensor>& ts, const char* what) {
  MYCCL_CHECK_ARG(ts.size() == 1, w, ": expected exactly one ", what, ", got ", ts.size());
  return ts[0];
}

void checkWritable(const Where& w, const at::Tensor& t, const char* what) {
  MYCCL_CHECK_ARG(at::has_internal_overlap(t) != at::MemOverlap::Yes, w, ": ", what, " ", shapeOf(t),
                  " has elements that share memory (e.g. from expand()); it cannot receive data");
}

void checkSameDtype(const Where& w, const at::Tensor& ref, const at::Tensor& t, const char* what) {
  MYCCL_CHECK_ARG(t.scalar_type() == ref.scalar_type(), w, ": ", what, " has dtype ", scalarTypeName(t.scalar_type()),
                  " but the input has ", scalarTypeName(ref.scalar_type()), "; all tensors of one op must share a dtype");
}

namespace {

// rowSlice(t, first, count) for a contiguous plain CPU tensor builds the alias directly on the
// same storage: narrow() and view() go through the dispatcher and autograd's view bookkeeping
// for every block of every call, a large share of a small op's CPU time (docs/DECISIONS.md,
// "Row blocks without narrow()"). The alias carries no autograd history; the engine only reads
// its memory. Anything else (CUDA, subclasses, strided tensors) keeps narrow().
bool aliasable(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  return t.is_cpu() && t.layout() == at::kStrided && t.dim() > 0 && t.is_contiguous() &&
         typeid(*impl) == typeid(c10::TensorImpl) && !impl->is_python_dispatch() && t.has_storage();
}

// A contiguous tensor of `sizes` starting `offset` elements into contiguous `t` (aliasable).
at::Tensor alias(const at::Tensor& t, int64_t offset, at::IntArrayRef sizes) {
  auto a = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(), t.dtype());
  a->set_storage_offset(t.storage_offset() + offset);
  a->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(a));
}

}  // namespace

at::Tensor rowSlice(const at::Tensor& t, int64_t first, int64_t count) {
  if (!aliasable(t)) return t.narrow(0, first, count);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= t.size(0), "rows [", first, ", ", first + count,
              ") out of range for ", t.size(0));
  std::vector<int64_t> sizes = t.sizes().vec();
  int64_t rowNumel = 1;
  for (size_t d = 1; d < sizes.size(); ++d) rowNumel *= sizes[d];
  sizes[0] = count;
  return alias(t, first * rowNumel, sizes);
}

// Row-major blocks of `t` for each rank: block r holds elements [r*n, (r+1)*n).
std::vector<at::Tensor> blocks(const Where& w, const at::Tensor& t, int size, int64_t n, const char* what) {
  std::vector<at::Tensor> out;
  out.reserve(size);
  if (aliasable(t) && t.numel() >= static_cast<int64_t>(size) * n) {
    for (int r = 0; r < size; ++r) out.push_back(alias(t, r * n, {n}));
    return out;
  }
  if (t.is_contiguous() || t.dim() <= 1) {
    at::Tensor flat = t.is_contiguous() ? t.view({-1}) : t;
    for (int r = 0; r < size; ++r) out.push_back(rowSlice(flat, r * n, n));
    return out;
  }
  MYCCL_CHECK_ARG(t.size(0) % size == 0, w, ": non-contiguous ", what, " ", shapeOf(t),
                  " must have its first dimension divisible by the group size ", size);
  int64_t per = t.size(0) / size;
  for (int r = 0; r < size; ++r) out.push_back(t.narrow(0, r * per, per));
  return out;
}

std::vector<at::Tensor> rootList(const Where& w, const std::vector<std::vector<at::Tensor>>& lists,
                                 const char* what, const char* other, const at::Tensor& mine, bool writable, int root,
                                 int rank, int size) {
  if (rank != root) {
    MYCCL_CHECK_ARG(lists.empty() || (lists.size() == 1 && lists[0].empty()), w, ": only the root (rank ", root,
                    ") may pass ", what, " tensors");
    return {};
  }
  MYCCL_CHECK_ARG(lists.size() == 1, w, ": the root needs one ", what, " list, got ", lists.size());
  const auto& list = lists[0];
  MYCCL_CHECK_ARG(static_cast<int>(list.size()) == size, w, ": the ", what, " list has ", list.size(),
                  " tensors but the group has ", size, " ranks");
  for (int r = 0; r < size; ++r) {
    checkSameDtype(w, mine, list[r], what);
    if (writable) checkWritable(w, list[r], what);
  }
  MYCCL_CHECK_ARG(list[rank].numel() == mine.numel(), w, ": ", what, " ", rank, " has ", list[rank].numel(),
                  " elements but the ", other, " has ", mine.numel());
  return list;
}

}  // namespace myccl
