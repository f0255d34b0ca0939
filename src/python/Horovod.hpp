// What the files of c10d_ext.horovod's module part share (defined in HorovodBindings.cpp): the
// agreed all_reduce, the agreed step of a list of tensors, and the key of a list of names.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "myccl/backend/ProcessGroupMyccl.hpp"

namespace myccl::horovod {

// The agreed all_reduce of one tensor on `b`'s CPU engine (cpu/extensions/AgreedAllreduce.hpp):
// reduces `t` only if every rank offers the same nonzero `key` with the same size and op; the
// answer goes into `agreed` (one uint8). Errors name the op and the rank.
c10::intrusive_ptr<c10d::Work> agreedAllreduce(MycclBackend& b, at::Tensor& t, at::Tensor& agreed, int64_t key,
                                               const c10d::ReduceOp& op);
// Whether `b` has it: the same answer on every rank.
bool agreedAvailable(MycclBackend& b);

// The dtypes the agreed all_reduce offers.
bool offerable(c10::ScalarType s);

// One agreed step of `tensors` (see _agreed_all_reduce_many): 1 when every rank offered the same
// (`out` holds the results), 0 when not (nothing written), -1 when a tensor cannot be offered
// (nothing ran). A negative `agreeBytes`: the ranks agreed on the list already (its key rode on
// the negotiation's message), so every buffer is a plain all_reduce. Called without the GIL.
int agreedMany(MycclBackend* b, const std::vector<at::Tensor>& tensors, const std::vector<bool>& inplace,
               at::Tensor& agreed, int64_t key, const c10d::ReduceOp& op, double scale, int64_t fuseBytes,
               int64_t aloneBytes, int64_t agreeBytes, std::vector<at::Tensor>& out);

// The key of a list of names with its op and postscale: nonzero, the same on every rank.
uint64_t keyOfNames(const std::vector<std::string>& names, int64_t op, double post);

// `key` with every tensor's dtype and shape folded in: nonzero, or 0 when a tensor cannot be
// offered (not a dense contiguous CPU tensor of a reducible dtype).
uint64_t keyOfTensors(uint64_t key, const std::vector<at::Tensor>& tensors);

}  // namespace myccl::horovod
