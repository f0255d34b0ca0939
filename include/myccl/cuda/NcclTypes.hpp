// How elements and reductions map onto NCCL: which NCCL type a buffer travels as, in which
// dtype it is staged (int16 has no NCCL type and is reduced as int32; complex travels as pairs
// of reals), and which NCCL operator (bool SUM is MAX, PREMUL_SUM is a per-launch operator).
// Unsupported combinations raise ValueError before anything is issued.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <string>

#include "myccl/Errors.hpp"
#include "myccl/Reduction.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

struct NcclReduce {
  NcclType type = NcclType::Float32;  // element type NCCL sees
  at::ScalarType stage = at::kFloat;  // dtype of the contiguous buffer handed to NCCL
  int64_t perElement = 1;             // NCCL elements per tensor element (2 for complex)
  NcclRedOp op = kNcclSum;            // built-in operator, unless premul
  bool premul = false;                // redOpCreatePreMulSum per launch
  double factor = 1.0;                // the premul factor, when given as a number
  at::Tensor factorTensor;            // ... or as a tensor: passed to NCCL on the device
};

// NCCL_VERSION(2, 24, 0): the first NCCL with float8 reductions.
inline constexpr int kNcclFloat8Version = 22400;

// `where` is "<op> (rank R)". Raises ValueError (MYCCL_CHECK_ARG) for what NCCL cannot do.
NcclReduce planReduce(const Reduction& red, const Where& where);
bool isFloat8(DType dt);
// Float8 reductions need more than the type: this NCCL (`ncclVersion`, as ncclGetVersion) and this
// GPU (`computeCapability`, 90 for 9.0) must reduce it. Raises ValueError naming what is missing.
void checkFloat8(DType dt, const Where& where, int ncclVersion, int computeCapability);
// "2.28.9" for NCCL's version code 22809.
std::string ncclVersionText(int code);

// The premul factor as NCCL wants it for `type`, written into `out` (at least 8 bytes).
void premulScalar(NcclType type, double factor, void* out);

}  // namespace myccl::cuda
