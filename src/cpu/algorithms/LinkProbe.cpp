// MYCCL_HIERARCHICAL=auto: what the choice between two levels and flat algorithms across hosts
// rests on. Once per group, collective: each host's ranks exchange through shared memory (or
// among themselves over TCP), and local rank i of every host sends to local rank i of the next
// host, every rank of a host at once, as the algorithms load the link. Select.cpp decides.
#include "LinkProbe.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "Flat.hpp"
#include "Levels.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu::hier {

namespace {

// Per rank and direction: enough to see past a token bucket's burst and TCP's first round trips
// on a link of a few hundred Mbit/s, small enough to cost tens of milliseconds there, once.
constexpr size_t kProbeBytes = 1024 * 1024;
// Per rank, inside a host: larger than caches, as the local phases of the ops worth choosing for
// are (a 1 MiB exchange runs from cache, up to several times faster); a few milliseconds.
constexpr size_t kLocalProbeBytes = 8 * 1024 * 1024;
// Each phase (and round) of the probe numbers its steps apart (flat algorithms' steps stay below 0x40).
constexpr uint64_t kProbeSync = 0x100, kProbeLocal = 0x200, kProbeCross = 0x300, kProbeGather = 0x400,
                   kProbeLocalSync = 0x500;

struct ProbeReport {
  double localSeconds;  // this rank's all-gather among its host's ranks (0: alone on its host)
  double crossSeconds;  // this rank's exchange with the next and previous hosts (0: none)
  uint64_t crossBytes;  // what this rank sent across
  int32_t host;
  int32_t localSize;
};

double secondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Every rank runs the same phases in the same order, each timed after a barrier, and ends with
// every rank's figures, so the choice made from them (Select.cpp) is the same everywhere.
LinkModel measureLink(CollCtx& c, double declaredLinkBytesPerS) {
  const auto start = std::chrono::steady_clock::now();
  const Topology& t = *c.topo;
  Levels L = levels(c);
  CollCtx pc = c;
  pc.tagBase = collectiveTagBase(OpCode::LinkProbe, tagSeq(c.tagBase));
  auto phase = [&](uint64_t p) {
    CollCtx x = pc;
    x.tagBase |= p;
    return x;
  };
  char* mine = static_cast<char*>(c.scratch.get(kSlotA, kLocalProbeBytes));
  std::memset(mine, t.rank & 0xff, kLocalProbeBytes);  // pages touched before the clock runs
  ProbeReport me{0, 0, 0, t.crossRank, static_cast<int32_t>(L.local.size())};
  const int nl = static_cast<int>(L.local.size());
  if (nl > 1) {
    char* all = static_cast<char*>(c.scratch.get(kSlotB, kLocalProbeBytes * nl));
    std::memset(all, 0, kLocalProbeBytes * nl);
    std::vector<void*> outs(nl);
    std::vector<size_t> sizes(nl, kLocalProbeBytes);
    for (int i = 0; i < nl; ++i) outs[i] = all + i * kLocalProbeBytes;
    // Three times, the fastest of the last two kept: the first maps the group's shared pages (a
    // one-time cost), and a millisecond's exchange is easily stretched by a descheduled rank.
    for (uint64_t round = 0; round < 3; ++round) {
      CollCtx lsc = phase(kProbeLocalSync | round << 6), lc = phase(kProbeLocal | round << 6);
      localBarrier(lsc, L);
      const auto t0 = std::chrono::steady_clock::now();
      localAllgatherv(lc, L, mine, outs.data(), sizes.data());
      const double secs = secondsSince(t0);
      if (round == 1 || (round > 1 && secs < me.localSeconds)) me.localSeconds = secs;
    }
  }
  if (declaredLinkBytesPerS <= 0) {
    // Local rank i of every host sends to local rank i of the next host: every rank of a host
    // at once, as both the flat and the striped algorithms load the link.
    const auto byHost = ranksByHost(t);
    const auto& next = byHost[(t.crossRank + 1) % t.crossSize];
    const auto& prev = byHost[(t.crossRank + t.crossSize - 1) % t.crossSize];
    char* got = static_cast<char*>(c.scratch.get(kSlotC, kProbeBytes));
    std::memset(got, 0, kProbeBytes);
    // Twice, the second timed: the first opens TCP's congestion windows.
    for (uint64_t round = 0; round < 2; ++round) {
      CollCtx sc = phase(kProbeSync | round << 6), xc = phase(kProbeCross | round << 6);
      flat::barrier(sc);
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<RequestPtr> reqs;
      if (L.localIdx < static_cast<int>(prev.size()))
        reqs.push_back(xc.irecv(prev[L.localIdx], xc.tag(1), got, kProbeBytes));
      if (L.localIdx < static_cast<int>(next.size())) {
        reqs.push_back(xc.isend(next[L.localIdx], xc.tag(1), mine, kProbeBytes));
        me.crossBytes = kProbeBytes;
      }
      waitAll(reqs, c.deadline);
      if (!reqs.empty()) me.crossSeconds = secondsSince(t0);
    }
  }
  std::vector<ProbeReport> reports(t.size);
  std::vector<void*> outs(t.size);
  std::vector<size_t> sizes(t.size, sizeof(ProbeReport));
  for (int r = 0; r < t.size; ++r) outs[r] = &reports[r];
  CollCtx gc = phase(kProbeGather);
  flat::allgatherv(gc, &me, outs.data(), sizes.data());

  LinkModel m;
  m.measured = true;
  m.hosts = t.crossSize;
  m.ranksPerHost = static_cast<double>(t.size) / t.crossSize;
  if (declaredLinkBytesPerS > 0) {
    m.declared = true;
    m.linkBytesPerS = declaredLinkBytesPerS;
  } else {
    // Everyone started together (after the barrier): a host's link carried what its ranks sent
    // in the time the slowest exchange took.
    std::vector<uint64_t> sent(t.crossSize, 0);
    double slowest = 0;
    for (auto& rep : reports) {
      sent[rep.host] += rep.crossBytes;
      slowest = std::max(slowest, rep.crossSeconds);
    }
    m.linkBytesPerS = static_cast<double>(*std::min_element(sent.begin(), sent.end())) / std::max(slowest, 1e-9);
  }
  for (auto& rep : reports) {
    if (rep.localSize < 2) continue;
    const double rate = static_cast<double>(rep.localSize - 1) * kLocalProbeBytes / std::max(rep.localSeconds, 1e-9);
    m.localBytesPerS = m.localBytesPerS > 0 ? std::min(m.localBytesPerS, rate) : rate;
  }
  m.bytes = 2 * me.crossBytes + (nl > 1 ? 3 * kLocalProbeBytes : 0);
  m.seconds = secondsSince(start);
  return m;
}

}  // namespace myccl::cpu::hier
