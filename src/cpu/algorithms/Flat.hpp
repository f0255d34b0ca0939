// Flat algorithms: every rank of the group exchanges with its peers over the message transport,
// with no notion of hosts (private to src/cpu/algorithms; see Flat.cpp for which runs when).
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu::flat {

// Scratch slots [0, kScratchSlots) are the flat algorithms'; other families start above.
inline constexpr int kScratchSlots = 6;

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
void broadcast(CollCtx& c, void* buf, size_t nbytes, int root);
void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root);
void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root);
void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec);
void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes);
void barrier(CollCtx& c);

}  // namespace myccl::cpu::flat
