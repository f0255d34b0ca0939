// The two levels of a group spanning hosts and the phases among one host's ranks (Levels.hpp).
#include "Levels.hpp"

#include <cstring>

#include "ShmAlgorithms.hpp"

namespace myccl::cpu::hier {

Levels levels(const CollCtx& c, int rootRank) {
  const Topology& t = *c.topo;
  Levels L;
  L.local = t.localRanks;
  L.localIdx = t.localRank;
  L.hostIdx = t.crossRank;
  L.leaders.assign(t.crossSize, -1);
  for (int r = 0; r < t.size; ++r) {
    int h = t.hostOfRank[r];
    if (L.leaders[h] < 0) L.leaders[h] = r;
  }
  if (rootRank >= 0) L.leaders[t.hostOfRank[rootRank]] = rootRank;
  L.representative = L.leaders[L.hostIdx] == t.rank;
  return L;
}

void localReduce(CollCtx& c, Levels& L, const void* in, void* out, size_t count, const ReduceSpec& spec, int rootIdx) {
  if (L.local.size() == 1) {
    if (out != in) std::memcpy(out, in, count * dtypeSize(spec.dtype));
    return;
  }
  if (c.shm) return shmalg::reduce(c, *c.shm, in, out, count, spec, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  flat::reduce(lc, in, out, count, spec, rootIdx);
}

void localBroadcast(CollCtx& c, Levels& L, void* buf, size_t nbytes, int rootIdx) {
  if (L.local.size() == 1) return;
  if (c.shm) return shmalg::broadcast(c, *c.shm, buf, nbytes, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  flat::broadcast(lc, buf, nbytes, rootIdx);
}

void localGatherv(CollCtx& c, Levels& L, const void* in, void* const* outs, const size_t* nbytes, int rootIdx) {
  if (L.local.size() == 1) {
    if (outs[0] != in && nbytes[0]) std::memcpy(outs[0], in, nbytes[0]);
    return;
  }
  if (c.shm) return shmalg::gatherv(c, *c.shm, in, outs, nbytes, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  flat::gatherv(lc, in, outs, nbytes, rootIdx);
}

void localScatterv(CollCtx& c, Levels& L, const void* const* ins, void* out, const size_t* nbytes, int rootIdx) {
  if (L.local.size() == 1) {
    if (ins[0] != out && nbytes[0]) std::memcpy(out, ins[0], nbytes[0]);
    return;
  }
  if (c.shm) return shmalg::scatterv(c, *c.shm, ins, out, nbytes, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  flat::scatterv(lc, ins, out, nbytes, rootIdx);
}

void localReduceScatterv(CollCtx& c, Levels& L, const void* const* ins, void* out, const size_t* counts,
                         const ReduceSpec& spec) {
  if (c.shm) return shmalg::reduceScatterv(c, *c.shm, ins, out, counts, spec);
  auto lc = c.sub(L.local, L.localIdx);
  flat::reduceScatterv(lc, ins, out, counts, spec);
}

void localAllgatherv(CollCtx& c, Levels& L, const void* in, void* const* outs, const size_t* nbytes) {
  if (c.shm) return shmalg::allgatherv(c, *c.shm, in, outs, nbytes);
  auto lc = c.sub(L.local, L.localIdx);
  flat::allgatherv(lc, in, outs, nbytes);
}

std::vector<std::vector<int>> ranksByHost(const Topology& t) {
  std::vector<std::vector<int>> byHost(t.crossSize);
  for (int r = 0; r < t.size; ++r) byHost[t.hostOfRank[r]].push_back(r);
  return byHost;
}

void localBarrier(CollCtx& c, Levels& L) {
  if (L.local.size() == 1) return;
  if (c.shm) return shmalg::barrier(c, *c.shm);
  auto lc = c.sub(L.local, L.localIdx);
  flat::barrier(lc);
}

}  // namespace myccl::cpu::hier
