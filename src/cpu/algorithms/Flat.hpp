// Flat algorithms: every rank of the group exchanges with its peers over the message transport,
// with no notion of hosts. One family per file (Direct, Ring, Bruck, HalvingDoubling, Tree, Chain)
// plus the pieces they share (FlatCommon.cpp); which one runs is decided in Select.cpp alone.
// Private to src/cpu/algorithms and to the algorithm unit tests (tests/cpp/test_algorithms.cpp).
#pragma once

#include <algorithm>
#include <vector>

#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu::flat {

// Scratch slots [0, kScratchSlots) are the flat algorithms'; other families start above.
inline constexpr int kScratchSlots = 6;

// Step numbers of the flat algorithms (the low bits of a message's tag, Tags.hpp).
inline constexpr uint32_t kStepData = 1;
inline constexpr uint32_t kStepGather = 2;
inline constexpr uint32_t kStepRoot = 3;
inline constexpr uint32_t kStepReady = 4;      // an empty message: "my receives for this op are posted"
inline constexpr uint32_t kStepReadyData = 5;  // the same, for a ring's first half (ringReduceScatter)
inline constexpr uint32_t kStepRounds = 16;    // + round number, for algorithms with log2(n) rounds

// ---- shared pieces (FlatCommon.cpp) ----------------------------------------------------------

// Elements per segment of a pipelined message (MYCCL_TCP_CHUNK_BYTES).
size_t segmentElems(const CollCtx& c, size_t esize);
// Number of segments a slice of `count` elements is sent in; both sides compute the same.
size_t numSegments(size_t count, size_t seg);
// Sends `count` elements starting at `p` to `peer` in segments (zero elements: one empty message).
void sendSegmented(CollCtx& c, std::vector<RequestPtr>& reqs, int peer, uint32_t step, const char* p, size_t count,
                   size_t esize, size_t seg);
// Receives every peer's contribution to this rank's slice segment by segment (two segments in
// flight per peer) and folds them, with this rank's own, in rank order into `out` (may be `own`).
void reduceSliceFromPeers(CollCtx& c, const void* own, void* out, size_t count, const ReduceSpec& spec,
                          uint32_t step);
// One blocking step under one tag: receive inBytes from `from` while sending outBytes to `to`;
// a peer of -1 skips that half.
void sendRecv(CollCtx& c, uint32_t step, int to, const void* out, size_t outBytes, int from, void* in,
              size_t inBytes);
// A ring's segment size in bytes, a whole number of `esize`-byte elements.
size_t ringSegmentBytes(const CollCtx& c, size_t esize);
// Slice q of `base` (partition's offs/cnts, in elements of `esize` bytes) as a pointer and a size
// in bytes, as the rings take them.
void sliceViews(char* base, const std::vector<size_t>& offs, const std::vector<size_t>& cnts, size_t esize,
                std::vector<void*>& views, std::vector<size_t>& bytes);
// Calls f(offset, length) for each segment of `nbytes` (one empty segment when nbytes is 0); both
// sides of a step compute the same cuts.
template <class F>
void forSegments(size_t nbytes, size_t seg, F&& f) {
  if (nbytes == 0) return f(size_t{0}, size_t{0});
  for (size_t off = 0; off < nbytes; off += seg) f(off, std::min(seg, nbytes - off));
}

// ---- Direct.cpp: one round, every rank to every rank (or to and from the root) ---------------

// Everyone sends everything to everyone, everyone folds in rank order (small buffers).
void oneRoundAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
// A direct reduce-scatter (each rank folds its slice from every rank in rank order), then the
// reduced slices go to everyone: directly, or around the ring (ringGather, ringAllgather).
void directAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec, bool ringGather);
// The root sends the whole buffer to every rank.
void directBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);
// The root scatters slices, then every rank sends its slice to every other.
void scatterAllgatherBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);
// Every rank sends its whole input to the root, which folds in rank order (small buffers).
void gatherReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
// A direct reduce-scatter into scratch, then the root gathers the reduced slices.
void directReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
void directAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
void directGatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root);
void directScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root);
void directReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                          const ReduceSpec& spec);
// Each rank sends to every other, staggered so ranks do not all hit rank 0 first.
void pairwiseAlltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
                       const size_t* recvBytes);

// ---- Ring.cpp --------------------------------------------------------------------------------

// outs[me] holds this rank's block already; `step` numbers the op's messages.
void ringAllgather(CollCtx& c, void* const* outs, const size_t* nbytes, uint32_t step);
// ringAllgather for an all_gather: this rank's `in` is copied into outs[me] first.
void ringAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
// ins[q] (counts[q] elements) is this rank's contribution to slice q, only read; `out` may be ins[me].
void ringReduceScatter(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec);
void ringAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);

// ---- Bruck.cpp: log2(n) rounds ---------------------------------------------------------------

// Bruck's all-gather into `rot`, this rank's block first: the block of rank (me + j) % n lands at
// rot + off[j]; off gets n + 1 entries (off[n] = total bytes).
void bruckGather(CollCtx& c, const void* in, const size_t* nbytes, char* rot, std::vector<size_t>& off);
void bruckAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
// Every input gathered in log2(n) rounds, then folded in rank order: the bits of a one-round fold.
void bruckAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
// log2(n) rounds of empty messages.
void disseminationBarrier(CollCtx& c);

// ---- HalvingDoubling.cpp ---------------------------------------------------------------------

// Recursive halving-doubling (Rabenseifner), any n; folds in tree order (exact types only).
void rhdAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);

// ---- Tree.cpp --------------------------------------------------------------------------------

void treeBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);

// ---- Chain.cpp: a pipeline through the ranks, the root's host first (c.topo) ------------------

void chainBroadcast(CollCtx& c, void* buf, size_t nbytes, int root);
// Partials travel in the element type, folded once per hop.
void chainReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);

// ---- Select.cpp: the flat family's entry points, which choose among the above ----------------

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
