// Shared-memory collectives for groups whose ranks all share one host (private to
// src/cpu/algorithms; callers use the selecting entry points in Algorithms.hpp).
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/transport/Shm.hpp"

namespace myccl::cpu::shmalg {

void allreduce(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec);
void broadcast(CollCtx& c, ShmGroup& g, void* buf, size_t nbytes, int root);
void reduce(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
// rootOnly: a gather (only `root` receives).
void allgatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes, bool rootOnly,
                int root);
void scatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* nbytes, int root);
void reduceScatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* counts,
                    const ReduceSpec& spec);
void alltoallv(CollCtx& c, ShmGroup& g, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes);
void barrier(CollCtx& c, ShmGroup& g);

}  // namespace myccl::cpu::shmalg
