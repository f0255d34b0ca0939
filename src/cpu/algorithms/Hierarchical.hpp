// Two-level collectives for groups spanning hosts (private to src/cpu/algorithms). Small ops go
// through one leader per host; large ones are striped (local rank i of every host carries slice i
// across). The family's entry points (allreduce, broadcast, ... at the end) are defined in
// Select.cpp, which alone chooses among the variants.
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu::hier {

// True when the group spans several hosts and some host holds several of its ranks.
bool applies(const CollCtx& c);
// Whether the striped variants can run: every host holds the same number (> 1) of the group's ranks.
bool canStripe(const CollCtx& c);
// Whether a two-level sum of this type carries float32 partials (MYCCL_FLOAT32_PARTIALS).
bool widePartials(const CollCtx& c, DType dt);

void stripedAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
void leaderAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
// Chunk by chunk down a chain of hosts, each host's local broadcast overlapping the next chunks.
void pipelinedBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);
void leaderBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);
void stripedAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void leaderAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void stripedReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                           const ReduceSpec& spec);
void leaderReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                          const ReduceSpec& spec);
// widePartials: the inputs widened to float32, reduce_scatter'ed by the entry point, rounded once.
void widenedReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                           const ReduceSpec& spec);
void barrier(CollCtx& c);

// The family's entry points (Select.cpp).
void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
void broadcast(CollCtx& c, void* buf, size_t nbytes, int root);
void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec);

}  // namespace myccl::cpu::hier
