// Element types and reduction operators for NCCL; the one place that knows what NCCL lacks
// (bitwise ops, int16, complex products) and how the rest is expressed with what it has.
#include "myccl/cuda/NcclTypes.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "myccl/Errors.hpp"

namespace myccl::cuda {

NcclReduce planReduce(const Reduction& red, const std::string& where) {
  NcclReduce p;
  const DType dt = red.spec.dtype;
  const RedOp op = red.spec.op;
  MYCCL_CHECK_ARG(op != RedOp::BAnd && op != RedOp::BOr && op != RedOp::BXor, where, ": ReduceOp.", redOpName(op),
                  " is not supported for CUDA tensors (NCCL has no bitwise reductions); dtype ", dtypeName(dt));
  switch (dt) {
    case DType::F32: p.type = NcclType::Float32; p.stage = at::kFloat; break;
    case DType::F64: p.type = NcclType::Float64; p.stage = at::kDouble; break;
    case DType::F16: p.type = NcclType::Float16; p.stage = at::kHalf; break;
    case DType::BF16: p.type = NcclType::BFloat16; p.stage = at::kBFloat16; break;
    case DType::I8: p.type = NcclType::Int8; p.stage = at::kChar; break;
    case DType::U8: p.type = NcclType::Uint8; p.stage = at::kByte; break;
    // NCCL has no 16-bit integer type: reduce in int32 and narrow back. SUM/PROD wrap the same
    // way modulo 2^16; MIN/MAX are exact.
    case DType::I16: p.type = NcclType::Int32; p.stage = at::kInt; break;
    case DType::I32: p.type = NcclType::Int32; p.stage = at::kInt; break;
    case DType::I64: p.type = NcclType::Int64; p.stage = at::kLong; break;
    case DType::Bool: p.type = NcclType::Uint8; p.stage = at::kBool; break;
    // Complex sums (and averages, and sums of scaled values) are sums of real and imaginary
    // parts taken separately: reduce the interleaved reals.
    case DType::C64: p.type = NcclType::Float32; p.stage = at::kComplexFloat; p.perElement = 2; break;
    case DType::C128: p.type = NcclType::Float64; p.stage = at::kComplexDouble; p.perElement = 2; break;
  }
  if (isComplex(dt)) {
    MYCCL_CHECK_ARG(op == RedOp::Sum, where, ": ReduceOp.", (op == RedOp::Prod ? "PRODUCT" : redOpName(op)),
                    " is not supported for complex CUDA tensors (NCCL reduces the real and imaginary parts "
                    "independently); dtype ", dtypeName(dt));
  }
  if (dt == DType::Bool) {
    // Bytes 0/1: logical or is the maximum, logical and the minimum.
    p.op = (op == RedOp::Sum || op == RedOp::Max) ? kNcclMax : kNcclMin;
    return p;
  }
  switch (op) {
    case RedOp::Sum: p.op = red.spec.divisor != 0 ? kNcclAvg : kNcclSum; break;
    case RedOp::Prod: p.op = kNcclProd; break;
    case RedOp::Min: p.op = kNcclMin; break;
    case RedOp::Max: p.op = kNcclMax; break;
    default: break;
  }
  if (red.premul) {
    MYCCL_CHECK_ARG(p.type == NcclType::Float32 || p.type == NcclType::Float64 || p.type == NcclType::Float16 ||
                        p.type == NcclType::BFloat16,
                    where, ": ReduceOp.PREMUL_SUM needs a floating point or complex dtype, got ", dtypeName(dt));
    p.premul = true;
    p.factor = red.factor;
    p.factorTensor = red.factorTensor;
  }
  return p;
}

void premulScalar(NcclType type, double factor, void* out) {
  switch (type) {
    case NcclType::Float64: {
      double v = factor;
      std::memcpy(out, &v, sizeof v);
      break;
    }
    case NcclType::Float16: {
      c10::Half v(static_cast<float>(factor));
      std::memcpy(out, &v.x, sizeof v.x);
      break;
    }
    case NcclType::BFloat16: {
      c10::BFloat16 v(static_cast<float>(factor));
      std::memcpy(out, &v.x, sizeof v.x);
      break;
    }
    default: {
      float v = static_cast<float>(factor);
      std::memcpy(out, &v, sizeof v);
      break;
    }
  }
}

}  // namespace myccl::cuda
