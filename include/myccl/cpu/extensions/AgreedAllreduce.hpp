// Horovod's agreed all_reduce (c10d_ext.horovod's one-step path), an op of the CPU engine's
// extension point (cpu/Extension.hpp): it reduces only if every rank offers the same nonzero key
// with the same size and reduction, and ranks that disagree all find out in the same step, with
// nothing written and the group usable. Whether a group has it is agreedApplies (Algorithms.hpp);
// where it has not, the op moves nothing and says 0 on every rank alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>

#include "myccl/Errors.hpp"
#include "myccl/cpu/Extension.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu {

// The op, for MycclBackend::runExtension: reduces the dense CPU tensor `t` in place with `op` if
// every rank of the group (`size` ranks) offered the same nonzero `key`, and writes into `agreed`
// (one uint8 or bool CPU element) 1 when it reduced, 0 when not. Checks its arguments first,
// raising errors that name `where`. Synchronous: whether it reduced is the caller's answer.
ExtensionOp agreedAllreduce(const Where& where, const at::Tensor& t, const at::Tensor& agreed, int64_t key,
                            const c10d::ReduceOp& op, int size);

}  // namespace myccl::cpu
