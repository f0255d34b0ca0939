// Collectives for groups that span hosts, in two levels: inside a host through shared memory (or
// the flat algorithms over TCP when a host has no shared memory), between hosts over TCP. Small
// ops go through one leader per host (its lowest rank; for rooted ops the root stands in for its
// host); large all_reduce, reduce_scatter and all_gather are striped: local rank i of every host
// carries slice i across hosts, so every rank and link of a host works at once. Which variant
// runs is Select.cpp's choice; the phases inside a host and across go through the shared-memory
// and flat families' entry points, which choose their own algorithms there.
#include "Hierarchical.hpp"

#include <algorithm>
#include <cstring>

#include "Flat.hpp"
#include "Levels.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu::hier {

namespace {

constexpr uint32_t kStepLeaders = 20;

int indexIn(const std::vector<int>& v, int x) {
  return static_cast<int>(std::find(v.begin(), v.end(), x) - v.begin());
}

// stripes[i][h]: the rank with local index i on host h. Empty when the hosts hold different
// numbers of ranks (then there is no one-to-one pairing across hosts).
std::vector<std::vector<int>> stripes(const CollCtx& c, const Levels& L) {
  std::vector<std::vector<int>> out(L.local.size());
  for (auto& ranks : ranksByHost(*c.topo)) {
    if (ranks.size() != L.local.size()) return {};
    for (size_t i = 0; i < ranks.size(); ++i) out[i].push_back(ranks[i]);
  }
  return out;
}

// Per stripe, the sum of its ranks' sizes (elements or bytes) and its offset when the stripes
// are packed one after another; returns the packed total.
size_t stripeLayout(const std::vector<std::vector<int>>& st, const size_t* perRank, std::vector<size_t>& sizes,
                    std::vector<size_t>& offs) {
  sizes.assign(st.size(), 0);
  offs.assign(st.size(), 0);
  size_t total = 0;
  for (size_t i = 0; i < st.size(); ++i) {
    offs[i] = total;
    for (int r : st[i]) sizes[i] += perRank[r];
    total += sizes[i];
  }
  return total;
}

}  // namespace

bool applies(const CollCtx& c) {
  // Worth it when hosts are several and at least one holds several ranks.
  return c.topo && c.topo->crossSize > 1 && c.topo->crossSize < c.topo->size;
}

// Else each level rounds to the type: across hosts the partials are half the bytes, which is what
// a link-bound job needs, for one rounding more than a single fold (a ring rounds at every step).
bool widePartials(const CollCtx& c, DType dt) {
  return c.float32Partials && (dt == DType::F16 || dt == DType::BF16);
}

bool canStripe(const CollCtx& c) {
  Levels L = levels(c);
  return L.local.size() > 1 && !stripes(c, L).empty();
}

namespace {

// Large all_reduces are striped across each host's ranks: local rank i reduces slice i on its
// host, then reduces it with the ranks holding slice i on the other hosts (every rank's link
// busy, each carrying 1/local_size of the bytes), then the slices are gathered locally. One
// leader carrying everything serialises the cross-host phase on one thread and one link.
// With float32 partials (widePartials), sums of low-precision types stay in float32 up to the
// final rounding, which happens once, before the final values travel.
void stripedAllreduce(CollCtx& c, Levels& L, const std::vector<int>& peers, void* buf, size_t count,
                      const ReduceSpec& spec) {
  const int nl = static_cast<int>(L.local.size()), me = L.localIdx;
  const bool wide = widePartials(c, spec.dtype);
  const DType sumType = wide ? DType::F32 : spec.dtype;
  const size_t es = dtypeSize(spec.dtype), ses = dtypeSize(sumType);
  const char* src = static_cast<const char*>(buf);
  if (wide) {
    float* w = static_cast<float*>(c.scratch.get(kSlotWide, count * sizeof(float)));
    toFloat32(spec.dtype, buf, w, count);
    src = reinterpret_cast<const char*>(w);
  }
  std::vector<size_t> offs, counts, bytes(nl);
  partition(count, nl, offs, counts);
  std::vector<const void*> ins(nl);
  std::vector<void*> outs(nl);
  for (int i = 0; i < nl; ++i) {
    bytes[i] = counts[i] * es;
    ins[i] = src + offs[i] * ses;
    outs[i] = static_cast<char*>(buf) + offs[i] * es;
  }
  ReduceSpec local = spec;
  local.dtype = sumType;
  local.divisor = 0;  // AVG divides once, in the last reduction
  char* sliceSum = static_cast<char*>(c.scratch.get(kSlotA, counts[me] * ses));
  localReduceScatterv(c, L, ins.data(), sliceSum, counts.data(), local);

  // Across hosts: reduce-scatter the slice among the counterparts, round, all-gather.
  const int nh = static_cast<int>(peers.size()), h = L.hostIdx;
  std::vector<size_t> po, pc, pbytes(nh);
  partition(counts[me], nh, po, pc);
  std::vector<const void*> xins(nh);
  std::vector<void*> xouts(nh);
  char* slice = static_cast<char*>(c.scratch.get(kSlotB, counts[me] * es));
  for (int k = 0; k < nh; ++k) {
    pbytes[k] = pc[k] * es;
    xins[k] = sliceSum + po[k] * ses;
    xouts[k] = slice + po[k] * es;
  }
  auto xc = c.sub(peers, h);
  ReduceSpec full = spec;
  full.dtype = sumType;
  if (wide) {
    char* piece = static_cast<char*>(c.scratch.get(kSlotC, pc[h] * ses));
    flat::reduceScatterv(xc, xins.data(), piece, pc.data(), full);
    fromFloat32(spec.dtype, reinterpret_cast<const float*>(piece), xouts[h], pc[h]);
  } else {
    flat::reduceScatterv(xc, xins.data(), xouts[h], pc.data(), full);
  }
  flat::allgatherv(xc, xouts[h], xouts.data(), pbytes.data());
  localAllgatherv(c, L, slice, outs.data(), bytes.data());
  c.algo = c.shm ? "hierarchical-striped-shm-tcp" : "hierarchical-striped-tcp";
}

// Small all_reduces: reduce to one leader per host, all-reduce among leaders, broadcast locally.
void leaderAllreduceIn(CollCtx& c, Levels& L, void* buf, size_t count, const ReduceSpec& spec) {
  if (widePartials(c, spec.dtype)) {
    // Two levels would round twice: carry float32 through both and round once at the end.
    float* wide = static_cast<float*>(c.scratch.get(kSlotWide, std::max<size_t>(count, 1) * sizeof(float)));
    toFloat32(spec.dtype, buf, wide, count);
    ReduceSpec w = spec;
    w.dtype = DType::F32;
    leaderAllreduceIn(c, L, wide, count, w);
    fromFloat32(spec.dtype, wide, buf, count);
    return;
  }
  ReduceSpec partial = spec;
  partial.divisor = 0;  // AVG divides once, after the last level
  localReduce(c, L, buf, buf, count, partial, 0);
  if (L.representative) {
    auto lc = c.sub(L.leaders, L.hostIdx);
    flat::allreduce(lc, buf, count, spec);
  }
  localBroadcast(c, L, buf, count * dtypeSize(spec.dtype), 0);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

}  // namespace

void stripedAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  Levels L = levels(c);
  stripedAllreduce(c, L, stripes(c, L)[L.localIdx], buf, count, spec);
}

void leaderAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  Levels L = levels(c);
  leaderAllreduceIn(c, L, buf, count, spec);
}

void pipelinedBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  Levels L = levels(c, root);
  // Large: chunk by chunk down a chain of hosts from the root's, so each host's link carries
  // the message once each way (a binomial tree makes the root's carry it log2(hosts) times),
  // and each host's local broadcast of chunk k overlaps the transfer of the next chunks (the
  // transport moves them while this thread copies). About eight chunks per hop, so filling the
  // chain is a small part, each between 256 KiB and the TCP chunk size.
  const size_t hops = std::max<size_t>(1, L.leaders.size() - 1);
  const size_t chunk =
      std::clamp<size_t>(nbytes / (8 * hops), 256 * 1024, std::max<size_t>(c.chunkBytes, 256 * 1024));
  const size_t nchunks = (nbytes + chunk - 1) / chunk;
  char* base = static_cast<char*>(buf);
  auto part = [&](size_t k) { return std::min(chunk, nbytes - k * chunk); };
  std::vector<RequestPtr> recvs, sends;
  std::vector<int> children;
  int parent = -1;
  auto lc = c.sub(L.leaders, L.hostIdx);
  if (L.representative) {
    // The chain: the root's host, then the next hosts in order.
    const int nh = static_cast<int>(L.leaders.size()), rootHost = c.topo->hostOfRank[root];
    const int vr = (L.hostIdx - rootHost + nh) % nh;
    if (vr) parent = (L.hostIdx - 1 + nh) % nh;
    if (vr + 1 < nh) children.push_back((L.hostIdx + 1) % nh);
    if (parent >= 0)
      for (size_t k = 0; k < nchunks; ++k) recvs.push_back(lc.irecv(parent, lc.tag(kStepLeaders), base + k * chunk, part(k)));
  }
  const int localRoot = indexIn(L.local, L.leaders[L.hostIdx]);
  for (size_t k = 0; k < nchunks; ++k) {
    if (parent >= 0) recvs[k]->wait(c.deadline);
    for (int h : children) sends.push_back(lc.isend(h, lc.tag(kStepLeaders), base + k * chunk, part(k)));
    localBroadcast(c, L, base + k * chunk, part(k), localRoot);
  }
  waitAll(sends, c.deadline);
  c.algo = c.shm ? "hierarchical-pipelined-shm-tcp" : "hierarchical-pipelined-tcp";
}

void leaderBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  Levels L = levels(c, root);
  if (L.representative) {
    auto lc = c.sub(L.leaders, L.hostIdx);
    flat::broadcast(lc, buf, nbytes, c.topo->hostOfRank[root]);
  }
  localBroadcast(c, L, buf, nbytes, indexIn(L.local, L.leaders[L.hostIdx]));
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

namespace {

// Large all-gathers are striped: local rank i first gathers, straight into the output, the
// blocks of the ranks with local index i on every host (its stripe, over its own link), then
// the host's ranks share their stripes through shared memory.
void stripedAllgatherv(CollCtx& c, Levels& L, const std::vector<std::vector<int>>& st, const void* in,
                       void* const* outs, const size_t* nbytes) {
  const int nl = static_cast<int>(st.size()), me = L.localIdx;
  std::vector<void*> xouts;
  std::vector<size_t> xbytes;
  for (int r : st[me]) {
    xouts.push_back(outs[r]);
    xbytes.push_back(nbytes[r]);
  }
  auto xc = c.sub(st[me], L.hostIdx);
  flat::allgatherv(xc, in, xouts.data(), xbytes.data());
  // A stripe's blocks are scattered through the output: share them packed, then unpack.
  std::vector<size_t> stripeBytes, stripeOff;
  const size_t total = stripeLayout(st, nbytes, stripeBytes, stripeOff);
  char* all = static_cast<char*>(c.scratch.get(kSlotA, std::max<size_t>(total, 1)));
  char* mine = all + stripeOff[me];
  for (int r : st[me]) {
    if (nbytes[r] && outs[r] != mine) std::memcpy(mine, outs[r], nbytes[r]);
    mine += nbytes[r];
  }
  std::vector<void*> localOuts(nl);
  for (int i = 0; i < nl; ++i) localOuts[i] = all + stripeOff[i];
  localAllgatherv(c, L, all + stripeOff[me], localOuts.data(), stripeBytes.data());
  for (int i = 0; i < nl; ++i) {
    if (i == me) continue;
    const char* p = all + stripeOff[i];
    for (int r : st[i]) {
      if (nbytes[r] && outs[r] != p) std::memcpy(outs[r], p, nbytes[r]);
      p += nbytes[r];
    }
  }
  c.algo = c.shm ? "hierarchical-striped-shm-tcp" : "hierarchical-striped-tcp";
}

}  // namespace

void stripedAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  Levels L = levels(c);
  stripedAllgatherv(c, L, stripes(c, L), in, outs, nbytes);
}

void leaderAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
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

namespace {

// Large reduce-scatters are striped: local rank i sums, over its host, the blocks of the ranks
// with local index i on every host (its stripe), then reduce-scatters the stripe with the
// ranks holding it on the other hosts, which leaves each rank with its own block. Every rank's
// link carries 1/local_size of the host's bytes and no final local step is needed.
void stripedReduceScatterv(CollCtx& c, Levels& L, const std::vector<std::vector<int>>& st, const void* const* ins,
                           void* out, const size_t* counts, const ReduceSpec& spec) {
  const int nl = static_cast<int>(st.size()), nh = static_cast<int>(st[0].size()), me = L.localIdx;
  const size_t es = dtypeSize(spec.dtype);
  std::vector<size_t> stripeCount, stripeOff;
  const size_t total = stripeLayout(st, counts, stripeCount, stripeOff);
  // A stripe's blocks are scattered through the input: pack each stripe contiguously.
  char* packed = static_cast<char*>(c.scratch.get(kSlotA, std::max<size_t>(total * es, 1)));
  std::vector<const void*> localIns(nl);
  for (int i = 0; i < nl; ++i) {
    char* p = packed + stripeOff[i] * es;
    localIns[i] = p;
    for (int r : st[i]) {
      if (counts[r]) std::memcpy(p, ins[r], counts[r] * es);
      p += counts[r] * es;
    }
  }
  char* hostSum = static_cast<char*>(c.scratch.get(kSlotB, std::max<size_t>(stripeCount[me] * es, 1)));
  ReduceSpec partial = spec;
  partial.divisor = 0;  // AVG divides once, across hosts
  localReduceScatterv(c, L, localIns.data(), hostSum, stripeCount.data(), partial);
  std::vector<const void*> xins(nh);
  std::vector<size_t> xcounts(nh);
  for (size_t h = 0, o = 0; h < xcounts.size(); o += xcounts[h], ++h) {
    xcounts[h] = counts[st[me][h]];
    xins[h] = hostSum + o * es;
  }
  auto xc = c.sub(st[me], L.hostIdx);
  flat::reduceScatterv(xc, xins.data(), out, xcounts.data(), spec);
  c.algo = c.shm ? "hierarchical-striped-shm-tcp" : "hierarchical-striped-tcp";
}

}  // namespace

void widenedReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                           const ReduceSpec& spec) {
  const Topology& t = *c.topo;
  const int n = t.size;
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
}

void stripedReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                           const ReduceSpec& spec) {
  Levels L = levels(c);
  stripedReduceScatterv(c, L, stripes(c, L), ins, out, counts, spec);
}

void leaderReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                          const ReduceSpec& spec) {
  const Topology& t = *c.topo;
  const int n = t.size;
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
    flat::reduceScatterv(lc, hostIns.data(), mine, hostCount.data(), spec);
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
    flat::barrier(lc);
  }
  localBarrier(c, L);
  c.algo = c.shm ? "hierarchical-shm-tcp" : "hierarchical-tcp";
}

}  // namespace myccl::cpu::hier
