// Reduction kernels for every dtype x op, shared by all CPU algorithms. Inputs are combined
// in the order given (rank order), so every rank computes bit-identical results; float16 and
// bfloat16 accumulate in float32 and are rounded once, after the last input (and the AVG
// division). Vectorised for AVX-512 / AVX2 with a portable fallback chosen at load time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "myccl/Reduction.hpp"

namespace myccl::cpu {

using myccl::DType;
using myccl::RedOp;
using myccl::ReduceSpec;

// out[i] = ins[0][i] (op) ins[1][i] (op) ... ins[n-1][i], then / divisor. `out` may be the same
// pointer as any one input (never a partial overlap).
void reduceInto(const ReduceSpec& spec, void* out, const void* const* ins, int n, size_t count);

// data[i] *= factor (PREMUL_SUM pre-scaling), in the element type.
void scaleInPlace(DType dt, void* data, size_t count, double factor);

// float16/bfloat16 <-> float32 (round to nearest even on the way down), for algorithms that
// must carry partial sums at full precision and round once at the end.
void toFloat32(DType from, const void* in, float* out, size_t count);
void fromFloat32(DType to, const float* in, void* out, size_t count);

// Which instruction set the kernels picked on this machine ("avx512f", "avx2", "default").
const char* reduceIsa();

}  // namespace myccl::cpu
