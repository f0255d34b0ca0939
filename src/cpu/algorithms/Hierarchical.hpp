// Two-level collectives for groups spanning hosts (private to src/cpu/algorithms).
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu::hier {

// True when the group spans several hosts and some host holds several of its ranks.
bool applies(const CollCtx& c);
void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
void broadcast(CollCtx& c, void* buf, size_t nbytes, int root);
void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec);
void barrier(CollCtx& c);
LinkModel measureLink(CollCtx& c, double declaredLinkBytesPerS);

}  // namespace myccl::cpu::hier
