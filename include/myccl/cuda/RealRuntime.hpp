// The Runtime of real GPUs: CUDA through torch's c10::cuda and the CUDA runtime, NCCL as torch
// loaded it (one libnccl per process). Only in builds with NCCL (MYCCL_WITH_NCCL).
#pragma once

#include "myccl/cuda/Memory.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

Runtime realRuntime();  // the process's one (stateless: forwards every call)
std::shared_ptr<Memory> realMemory();  // CUDA's virtual memory, through the driver (RealMemory.cpp)

}  // namespace myccl::cuda
