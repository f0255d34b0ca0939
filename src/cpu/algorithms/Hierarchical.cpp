// Collectives for groups that span hosts: inside a host through shared memory (or direct TCP
// when a host has no shared memory), between hosts through one leader per host over TCP.
// The leader of a host is its lowest rank; for rooted ops the root stands in for its host.
#include "Hierarchical.hpp"

#include <algorithm>
#include <cstring>

#include "Direct.hpp"
#include "ShmAlgorithms.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu::hier {

namespace {

constexpr uint32_t kStepLeaders = 20;
// Scratch slots above the ones the direct algorithms use (0..3).
constexpr int kSlotA = 8, kSlotB = 9, kSlotC = 10, kSlotD = 11, kSlotWide = 12;

bool lowPrecision(DType dt) {
  return dt == DType::F16 || dt == DType::BF16;
}

struct Levels {
  std::vector<int> local;    // group ranks on this host
  std::vector<int> leaders;  // one representative per host, by host index
  int localIdx = 0;
  int hostIdx = 0;
  bool representative = false;
};

Levels levels(const CollCtx& c, int rootRank = -1) {
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

int indexIn(const std::vector<int>& v, int x) {
  return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
}

// ---- local phases: shared memory when this host has it, else direct TCP among its ranks ----

void localReduce(CollCtx& c, Levels& L, const void* in, void* out, size_t count, const ReduceSpec& spec, int rootIdx) {
  if (L.local.size() == 1) {
    if (out != in) std::memcpy(out, in, count * dtypeSize(spec.dtype));
    return;
  }
  if (c.shm) return shmalg::reduce(c, *c.shm, in, out, count, spec, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  direct::reduce(lc, in, out, count, spec, rootIdx);
}

void localBroadcast(CollCtx& c, Levels& L, void* buf, size_t nbytes, int rootIdx) {
  if (L.local.size() == 1) return;
  if (c.shm) return shmalg::broadcast(c, *c.shm, buf, nbytes, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  direct::broadcast(lc, buf, nbytes, rootIdx);
}

void localGatherv(CollCtx& c, Levels& L, const void* in, void* const* outs, const size_t* nbytes, int rootIdx) {
  if (L.local.size() == 1) {
    if (outs[0] != in && nbytes[0]) std::memcpy(outs[0], in, nbytes[0]);
    return;
  }
  if (c.shm) return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, true, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  direct::gatherv(lc, in, outs, nbytes, rootIdx);
}

void localScatterv(CollCtx& c, Levels& L, const void* const* ins, void* out, const size_t* nbytes, int rootIdx) {
  if (L.local.size() == 1) {
    if (ins[0] != out && nbytes[0]) std::memcpy(out, ins[0], nbytes[0]);
    return;
  }
  if (c.shm) return shmalg::scatterv(c, *c.shm, ins, out, nbytes, rootIdx);
  auto lc = c.sub(L.local, L.localIdx);
  direct::scatterv(lc, ins, out, nbytes, rootIdx);
}

void localBarrier(CollCtx& c, Levels& L) {
  if (L.local.size() == 1) return;
  if (c.shm) return shmalg::barrier(c, *c.shm);
  auto lc = c.sub(L.local, L.localIdx);
  direct::barrier(lc);
}

}  // namespace

bool applies(const CollCtx& c) {
  // Worth it when hosts are several and at least one holds several ranks.
  return c.topo && c.topo->crossSize > 1 && c.topo->crossSize < c.topo->size;
}

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  if (lowPrecision(spec.dtype)) {
    // Two levels would round twice: carry float32 through both and round once at the end.
    float* wide = static_cast<float*>(c.scratch.get(kSlotWide, std::max<size_t>(count, 1) * sizeof(float)));
    toFloat32(spec.dtype, buf, wide, count);
    ReduceSpec w = spec;
    w.dtype = DType::F32;
    hier::allreduce(c, wide, count, w);
    fromFloat32(spec.dtype, wide, buf, count);
    return;
  }
  Levels L = levels(c);
  ReduceSpec partial = spec;
  partial.divisor = 0;  // AVG divides once, after the last level
  localReduce(c, L, buf, buf, count, partial, 0);
  if (L.representative) {
    auto lc = c.sub(L.leaders, L.hostIdx);
    direct::allreduce(lc, buf, count, spec);
  }
  localBroadcast(c, L, buf, count * dtypeSize(spec.dtype), 0);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  Levels L = levels(c, root);
  if (L.representative) {
    auto lc = c.sub(L.leaders, L.hostIdx);
    direct::broadcast(lc, buf, nbytes, c.topo->hostOfRank[root]);
  }
  localBroadcast(c, L, buf, nbytes, indexIn(L.local, L.leaders[L.hostIdx]));
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  Levels L = levels(c);
  const Topology& t = *c.topo;
  const int n = t.size;
  size_t total = 0;
  std::vector<size_t> off(n);
  for (int r = 0; r < n; ++r) off[r] = total, total += nbytes[r];
  // Everything is assembled, in rank order, in one buffer on the leader, then broadcast locally.
  char* all = static_cast<char*>(c.scratch.get(kSlotA, std::max<size_t>(total, 1)));
  std::vector<void*> localOuts;
  std::vector<size_t> localBytes;
  for (int r : L.local) {
    localOuts.push_back(all + off[r]);
    localBytes.push_back(nbytes[r]);
  }
  localGatherv(c, L, in, localOuts.data(), localBytes.data(), 0);
  if (L.representative && t.crossSize > 1) {
    // Leaders swap their hosts' blocks, block by block in rank order (same order on both
    // sides, so per-pair message order matches).
    auto lc = c.sub(L.leaders, L.hostIdx);
    std::vector<RequestPtr> reqs;
    for (int h = 0; h < t.crossSize; ++h) {
      if (h == L.hostIdx) continue;
      for (int r = 0; r < n; ++r)
        if (t.hostOfRank[r] == h) reqs.push_back(lc.irecv(h, lc.tag(kStepLeaders), all + off[r], nbytes[r]));
    }
    for (int h = 0; h < t.crossSize; ++h) {
      if (h == L.hostIdx) continue;
      for (int r : L.local) reqs.push_back(lc.isend(h, lc.tag(kStepLeaders), all + off[r], nbytes[r]));
    }
    waitAll(reqs, c.deadline);
  }
  localBroadcast(c, L, all, total, 0);
  for (int r = 0; r < n; ++r)
    if (nbytes[r] && outs[r] != all + off[r]) std::memcpy(outs[r], all + off[r], nbytes[r]);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  const Topology& t = *c.topo;
  const int n = t.size;
  if (lowPrecision(spec.dtype)) {
    size_t total = 0;
    for (int r = 0; r < n; ++r) total += counts[r];
    float* wide = static_cast<float*>(c.scratch.get(kSlotWide, std::max<size_t>(total + counts[t.rank], 1) * sizeof(float)));
    std::vector<const void*> wideIns(n);
    size_t o = 0;
    for (int r = 0; r < n; ++r) {
      toFloat32(spec.dtype, ins[r], wide + o, counts[r]);
      wideIns[r] = wide + o;
      o += counts[r];
    }
    float* wideOut = wide + total;
    ReduceSpec w = spec;
    w.dtype = DType::F32;
    hier::reduceScatterv(c, wideIns.data(), wideOut, counts, w);
    fromFloat32(spec.dtype, wideOut, out, counts[t.rank]);
    return;
  }
  Levels L = levels(c);
  const size_t es = dtypeSize(spec.dtype);
  size_t total = 0;
  std::vector<size_t> off(n);
  for (int r = 0; r < n; ++r) off[r] = total, total += counts[r];
  // 1. Local reduce of the whole input to the leader (blocks packed in rank order).
  char* packed = static_cast<char*>(c.scratch.get(kSlotA, std::max<size_t>(total * es, 1)));
  for (int r = 0; r < n; ++r)
    if (counts[r]) std::memcpy(packed + off[r] * es, ins[r], counts[r] * es);
  char* hostSum = static_cast<char*>(c.scratch.get(kSlotB, std::max<size_t>(total * es, 1)));
  ReduceSpec partial = spec;
  partial.divisor = 0;
  localReduce(c, L, packed, hostSum, total, partial, 0);
  // 2. Leaders reduce-scatter by host: host h gets the blocks of its ranks.
  std::vector<size_t> hostCount(t.crossSize, 0);
  for (int r = 0; r < n; ++r) hostCount[t.hostOfRank[r]] += counts[r];
  char* mine = static_cast<char*>(c.scratch.get(kSlotC, std::max<size_t>(hostCount[L.hostIdx] * es, 1)));
  if (L.representative) {
    char* byHost = static_cast<char*>(c.scratch.get(kSlotD, std::max<size_t>(total * es, 1)));
    std::vector<const void*> hostIns(t.crossSize);
    size_t o = 0;
    for (int h = 0; h < t.crossSize; ++h) {
      hostIns[h] = byHost + o * es;
      for (int r = 0; r < n; ++r) {
        if (t.hostOfRank[r] != h) continue;
        std::memcpy(byHost + o * es, hostSum + off[r] * es, counts[r] * es);
        o += counts[r];
      }
    }
    auto lc = c.sub(L.leaders, L.hostIdx);
    direct::reduceScatterv(lc, hostIns.data(), mine, hostCount.data(), spec);
  }
  // 3. The leader hands each local rank its block.
  std::vector<const void*> pieces;
  std::vector<size_t> pieceBytes;
  size_t o = 0;
  for (int r : L.local) {
    pieces.push_back(mine + o * es);
    pieceBytes.push_back(counts[r] * es);
    o += counts[r];
  }
  localScatterv(c, L, pieces.data(), out, pieceBytes.data(), 0);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

void barrier(CollCtx& c) {
  Levels L = levels(c);
  localBarrier(c, L);
  if (L.representative) {
    auto lc = c.sub(L.leaders, L.hostIdx);
    direct::barrier(lc);
  }
  localBarrier(c, L);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

}  // namespace myccl::cpu::hier
