// What torch's profiler sees of an op: the title of its range ("myccl:all_reduce") and torch's
// "record_param_comms" event with the comm metadata torch's own backends record. MycclWork
// calls both only while a profiler listens (at::hasCallbacks()).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "myccl/OpInfo.hpp"

namespace myccl {

// "myccl:<name>", interned: the pointer stays valid for the life of the process (the profiler
// keeps it while the range is open). `name` is a string literal (OpInfo::name).
const char* profilingTitle(const char* name);

// torch's profiler metadata for an op, recorded on the calling thread.
void recordParamComms(const OpInfo& info, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& outputs);

}  // namespace myccl
