// Element types and reduction operators for NCCL; the one place that knows what NCCL lacks
// (bitwise ops, int16, complex products) and how the rest is expressed with what it has.
#include "myccl/cuda/NcclTypes.hpp"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#include "myccl/Errors.hpp"

namespace myccl::cuda {

NcclReduce planReduce(const Reduction& red, const Where& where) {
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
    case DType::U32: p.type = NcclType::Uint32; p.stage = at::kUInt32; break;
    case DType::U64: p.type = NcclType::Uint64; p.stage = at::kUInt64; break;
    case DType::F8E4M3: p.type = NcclType::Float8e4m3; p.stage = at::kFloat8_e4m3fn; break;
    case DType::F8E5M2: p.type = NcclType::Float8e5m2; p.stage = at::kFloat8_e5m2; break;
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
                    where, ": ReduceOp.PREMUL_SUM on CUDA tensors needs float32, float64, float16, bfloat16 or a "
                    "complex dtype, got ", dtypeName(dt));
    p.premul = true;
    p.factor = red.factor;
    p.factorTensor = red.factorTensor;
  }
  return p;
}

bool isFloat8(DType dt) {
  return dt == DType::F8E4M3 || dt == DType::F8E5M2;
}

void checkFloat8(DType dt, const Where& where, int ncclVersion, int computeCapability) {
  // NCCL reduces float8 from 2.24 on, and only on Hopper (compute capability 9.0) or newer.
  MYCCL_CHECK_ARG(ncclVersion >= kNcclFloat8Version, where, ": reductions of ", dtypeName(dt),
                  " need NCCL 2.24 or newer, this process loaded NCCL ", ncclVersionText(ncclVersion),
                  "; reduce in bfloat16 or float16 instead");
  MYCCL_CHECK_ARG(computeCapability >= 90, where, ": NCCL reduces ", dtypeName(dt),
                  " only on GPUs of compute capability 9.0 or newer, this one has ", computeCapability / 10, ".",
                  computeCapability % 10, "; reduce in bfloat16 or float16 instead");
}

std::string ncclVersionText(int code) {
  // NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z from 2.9 on.
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
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
