// NCCL's element types and reductions, for the double: ranks' contributions combined in rank
// order with plain ATen ops, rounding to the element type at every step as NCCL does. Types
// ATen cannot do arithmetic on (float8, uint32, uint64) go through a wider type or a loop.
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>

#include <algorithm>
#include <cstring>

#include "Nccl.hpp"

namespace myccl::cuda::testdouble {

bool validType(NcclType t) {
  const int v = static_cast<int>(t);
  return v >= static_cast<int>(NcclType::Int8) && v <= static_cast<int>(NcclType::Float8e5m2);
}

size_t typeBytes(NcclType t) { return ncclTypeSize(t); }

const char* typeName(NcclType t) {
  static const char* const names[] = {"int8",    "uint8",   "int32",    "uint32",     "int64",     "uint64",
                                      "float16", "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
  return validType(t) ? names[static_cast<int>(t)] : "invalid-type";
}

const char* kindName(OpKind k) {
  switch (k) {
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Reduce: return "reduce";
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::Send: return "send";
    case OpKind::Recv: return "recv";
  }
  return "op";
}

namespace {

const char* redOpName(const Op& op) {
  if (op.premul) return "premul_sum";
  switch (op.op) {
    case kNcclSum: return "sum";
    case kNcclProd: return "prod";
    case kNcclMax: return "max";
    case kNcclMin: return "min";
    case kNcclAvg: return "avg";
    default: return "op?";
  }
}

bool reduces(OpKind k) { return k == OpKind::AllReduce || k == OpKind::Reduce || k == OpKind::ReduceScatter; }

at::Tensor load(const void* p, size_t n, at::ScalarType st) {
  at::Tensor t = at::empty({static_cast<int64_t>(n)}, at::TensorOptions(at::kCPU).dtype(st));
  if (n != 0) std::memcpy(t.data_ptr(), p, n * c10::elementSize(st));
  return t;
}

// The arithmetic type for `st`: the type itself where ATen computes in it, else a wider one
// (results are rounded back to `st` after every step).
at::ScalarType computeType(at::ScalarType st) {
  if (st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2) return at::kFloat;
  if (st == at::kUInt32) return at::kLong;
  return st;
}

void combine(at::Tensor& acc, const at::Tensor& x, NcclRedOp op) {
  switch (op) {
    case kNcclSum:
    case kNcclAvg: acc.add_(x); break;
    case kNcclProd: acc.mul_(x); break;
    case kNcclMax: acc = at::maximum(acc, x); break;
    case kNcclMin: acc = at::minimum(acc, x); break;
    default: TORCH_CHECK(false, "myccl: cuda double: no such reduction operator ", op);
  }
}

// uint64 has no ATen arithmetic: a plain loop (unsigned arithmetic wraps, as on the GPU).
void reduceU64(const std::vector<const unsigned char*>& parts, size_t n, NcclRedOp op, void* out) {
  std::vector<uint64_t> acc(n), x(n);
  std::memcpy(acc.data(), parts[0], n * sizeof(uint64_t));
  for (size_t r = 1; r < parts.size(); ++r) {
    std::memcpy(x.data(), parts[r], n * sizeof(uint64_t));
    for (size_t i = 0; i < n; ++i) {
      switch (op) {
        case kNcclSum:
        case kNcclAvg: acc[i] += x[i]; break;
        case kNcclProd: acc[i] *= x[i]; break;
        case kNcclMax: acc[i] = std::max(acc[i], x[i]); break;
        case kNcclMin: acc[i] = std::min(acc[i], x[i]); break;
        default: TORCH_CHECK(false, "myccl: cuda double: no such reduction operator ", op);
      }
    }
  }
  if (op == kNcclAvg) {
    for (auto& v : acc) v /= parts.size();
  }
  std::memcpy(out, acc.data(), n * sizeof(uint64_t));
}

}  // namespace

std::string describe(const Op& op) {
  std::string s = std::string(kindName(op.kind)) + " " + std::to_string(op.count) + " x " + typeName(op.type);
  if (reduces(op.kind)) s += std::string(" ") + redOpName(op);
  if (op.kind == OpKind::Broadcast || op.kind == OpKind::Reduce) s += " root " + std::to_string(op.peer);
  return s;
}

void applyPremul(void* data, size_t n, const Premul& p) {
  const at::ScalarType st = scalarTypeOf(p.type);
  // Device residence: the factor is read now, when the op runs, not when it was enqueued.
  const void* factor = p.residence == ScalarResidence::Device ? p.ptr : p.value.data();
  if (p.type == NcclType::Uint64) {
    // Payloads sit at any offset of a store value: memcpy, never a misaligned uint64_t*.
    uint64_t f = 0, v = 0;
    std::memcpy(&f, factor, sizeof f);
    auto* bytes = static_cast<unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(&v, bytes + i * sizeof v, sizeof v);
      v *= f;
      std::memcpy(bytes + i * sizeof v, &v, sizeof v);
    }
    return;
  }
  const at::ScalarType ct = computeType(st);
  at::Tensor x = load(data, n, st).to(ct);
  x.mul_(load(factor, 1, st).to(ct));
  at::Tensor back = x.to(st);
  if (n != 0) std::memcpy(data, back.data_ptr(), n * c10::elementSize(st));
}

void reduceParts(const std::vector<const unsigned char*>& parts, size_t n, NcclType type, NcclRedOp op, void* out) {
  TORCH_CHECK(!parts.empty(), "myccl: cuda double: a reduction over no ranks");
  if (n == 0) return;
  if (type == NcclType::Uint64) return reduceU64(parts, n, op, out);
  const at::ScalarType st = scalarTypeOf(type);
  const at::ScalarType ct = computeType(st);
  at::Tensor acc = load(parts[0], n, st);
  for (size_t r = 1; r < parts.size(); ++r) {
    at::Tensor x = load(parts[r], n, st);
    if (ct == st) {
      combine(acc, x, op);
    } else {
      at::Tensor wide = acc.to(ct);
      combine(wide, x.to(ct), op);
      acc = wide.to(st);  // rounded to the element type at every step
    }
  }
  if (op == kNcclAvg) {
    const auto ranks = static_cast<int64_t>(parts.size());
    if (at::isIntegralType(st, /*includeBool=*/false)) {
      acc = at::div(acc.to(ct), ranks, "trunc").to(st);  // integer division truncates
    } else {
      acc = acc.to(at::kDouble).div(ranks).to(st);  // one rounding of the exact quotient
    }
  }
  std::memcpy(out, acc.data_ptr(), n * c10::elementSize(st));
}

}  // namespace myccl::cuda::testdouble
