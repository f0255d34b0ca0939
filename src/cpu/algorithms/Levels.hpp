// The two levels of a group that spans hosts (private to src/cpu/algorithms): the group's ranks
// on this rank's host, one representative per host, and the phases among one host's ranks, over
// shared memory when the host has it, else the flat algorithms over TCP among them. Shared by
// the two-level algorithms (Hierarchical.cpp) and the link probe (LinkProbe.cpp).
#pragma once

#include <vector>

#include "Flat.hpp"
#include "myccl/Topology.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu::hier {

// Scratch slots above the flat algorithms' (which the local and cross-host phases also run).
inline constexpr int kSlotA = flat::kScratchSlots, kSlotB = kSlotA + 1, kSlotC = kSlotA + 2, kSlotD = kSlotA + 3,
                     kSlotWide = kSlotA + 4;

struct Levels {
  std::vector<int> local;    // group ranks on this host
  std::vector<int> leaders;  // one representative per host, by host index
  int localIdx = 0;
  int hostIdx = 0;
  bool representative = false;
};

// The levels of the group of `c`; with `rootRank` >= 0 it stands in for its host as leader.
Levels levels(const CollCtx& c, int rootRank = -1);

// ---- among this host's ranks (rootIdx: an index into Levels::local) ----
void localReduce(CollCtx& c, Levels& L, const void* in, void* out, size_t count, const ReduceSpec& spec, int rootIdx);
void localBroadcast(CollCtx& c, Levels& L, void* buf, size_t nbytes, int rootIdx);
void localGatherv(CollCtx& c, Levels& L, const void* in, void* const* outs, const size_t* nbytes, int rootIdx);
void localScatterv(CollCtx& c, Levels& L, const void* const* ins, void* out, const size_t* nbytes, int rootIdx);
void localReduceScatterv(CollCtx& c, Levels& L, const void* const* ins, void* out, const size_t* counts,
                         const ReduceSpec& spec);
void localAllgatherv(CollCtx& c, Levels& L, const void* in, void* const* outs, const size_t* nbytes);
void localBarrier(CollCtx& c, Levels& L);

// byHost[h]: the group ranks on host h, ascending (like localRanks).
std::vector<std::vector<int>> ranksByHost(const Topology& t);

}  // namespace myccl::cpu::hier
