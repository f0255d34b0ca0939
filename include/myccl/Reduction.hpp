// What a reduction means, independent of where it runs: element type, operator, the AVG
// divisor and PREMUL_SUM's local factor. The backend builds it (and rejects combinations that
// make no sense); the CPU kernels and the NCCL engine both consume it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

namespace myccl {

// The last four are reduced by NCCL only (CUDA tensors); the CPU kernels refuse them.
enum class DType : uint8_t { F32, F64, F16, BF16, I8, U8, I16, I32, I64, Bool, C64, C128, U32, U64, F8E4M3, F8E5M2 };
enum class RedOp : uint8_t { Sum, Prod, Min, Max, BAnd, BOr, BXor };

size_t dtypeSize(DType dt);
const char* dtypeName(DType dt);
const char* redOpName(RedOp op);
bool isFloating(DType dt);
bool isComplex(DType dt);
// Whether the CPU engine's kernels reduce this type (all but the NCCL-only ones).
bool cpuReducible(DType dt);

struct ReduceSpec {
  DType dtype = DType::F32;
  RedOp op = RedOp::Sum;
  // Non-zero: divide the final result by this (ReduceOp.AVG). Integers truncate toward zero.
  int64_t divisor = 0;
  // Non-zero (SUM of float32/float64 only): this rank's input is multiplied by this, rounded in
  // the element type, as it is summed: sum(round(x_q * scale)), bit for bit what scaling each
  // input first and summing gives, without the separate pass. The CPU engine sets it for a
  // PREMUL_SUM all_reduce (each rank's own factor); an algorithm that folds peers' raw inputs
  // with it first checks that every rank passed the same (Select.cpp).
  double scale = 0.0;
};

struct Reduction {
  ReduceSpec spec;
  bool premul = false;  // PREMUL_SUM: multiply the local input by `factor` first
  double factor = 1.0;  // its value, on the host (what the CPU engine uses)
  // The factor as the caller gave it when it was a tensor: the CUDA engine hands NCCL a device
  // copy of it, read when the op runs, so issuing never synchronises with the device (and works
  // during CUDA graph capture). Undefined for a plain number.
  at::Tensor factorTensor;
};

}  // namespace myccl
