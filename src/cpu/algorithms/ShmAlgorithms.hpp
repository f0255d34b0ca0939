// Shared-memory collectives for groups whose ranks all share one host (private to
// src/cpu/algorithms and its unit tests). The entry points of this family (allreduce, broadcast,
// reduce, ... below the variants) are defined in Select.cpp, which alone chooses among them:
// one step or sliced, and whether to try zero copy (every buffer in registered shared memory).
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/transport/Shm.hpp"

namespace myccl::cpu::shmalg {

// Every rank stages its whole buffer, every rank folds every buffer (small reductions).
void allreduceOneStep(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec);
// Horovod's agreed all_reduce, in one step: every rank offers `key` (0: no offer) with its data
// (at most one staging buffer), and reduces only if every rank offered the same key, size and
// reduction. Returns whether it reduced; ranks that disagree all return false from the same step,
// with nothing written and the group usable.
bool allreduceAgreed(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec, uint64_t key);
// One step: whether every rank passed the same ReduceSpec::scale (a PREMUL_SUM factor is each
// rank's own); the same answer on every rank. A scaled sum folds peers' raw inputs with this
// rank's factor, so it runs only where they agree.
bool sameScale(CollCtx& c, ShmGroup& g, size_t count, const ReduceSpec& spec);
// A reduce-scatter of staged slices then an all-gather, chunk by chunk through the staging buffers.
void allreduceSliced(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec, bool tryZeroCopy);
void pipelinedBroadcast(CollCtx& c, ShmGroup& g, void* buf, size_t nbytes, int root, bool tryZeroCopy);
void reduceOneStep(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
void reduceSliced(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
// rootOnly: a gather (only `root` receives; never zero copy).
void allgatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes, bool rootOnly,
                int root, bool tryZeroCopy);
void scatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* nbytes, int root);
void reduceScatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* counts,
                    const ReduceSpec& spec, bool tryZeroCopy);
void alltoallv(CollCtx& c, ShmGroup& g, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes);
void barrier(CollCtx& c, ShmGroup& g);

// The family's entry points (Select.cpp).
void allreduce(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec);
void broadcast(CollCtx& c, ShmGroup& g, void* buf, size_t nbytes, int root);
void reduce(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
void allgatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes);
void gatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes, int root);
void reduceScatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* counts,
                    const ReduceSpec& spec);

}  // namespace myccl::cpu::shmalg
