// Flat algorithms over any message transport, chosen by size and rank count (the constants
// below): direct exchanges (a reduction is a direct reduce-scatter, each rank reducing its own
// slice from all ranks' contributions in rank order in one pass, then a direct all-gather:
// bit-identical results everywhere, low-precision types rounded once), a ring and recursive
// halving-doubling for mid-size and large all_reduces, Bruck's rounds for small all-gathers on
// many ranks, a binomial tree for broadcasts, pairwise all-to-all, a dissemination barrier.
// Large messages are cut in segments and double-buffered. Scratch slots 0..5 (Flat.hpp).
#include <algorithm>
#include <numeric>
#include <tuple>
#include <cstdlib>
#include <cstring>

#include "Flat.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu {

namespace {

constexpr uint32_t kStepData = 1;
constexpr uint32_t kStepGather = 2;
constexpr uint32_t kStepRoot = 3;
constexpr uint32_t kStepReady = 4;  // an empty message: "my receives for this op are posted"
constexpr uint32_t kStepReadyData = 5;  // the same, for a ring's first half (ringReduceScatter)
constexpr uint32_t kStepRounds = 16;  // + round number, for algorithms with log2(n) rounds
// Reductions below this many bytes gather whole buffers instead of slicing them.
constexpr size_t kSmallReduceBytes = 32 * 1024;
// From this many ranks, small exchanges take log2(n) rounds (each rank sends ~log2(n) messages)
// instead of one round in which each rank sends n - 1: per-message cost, not bytes, decides there.
constexpr int kLogRoundsMinRanks = 4;
// All-gathers up to this many bytes in total use Bruck's rounds (every block moves log2(n) times).
constexpr size_t kSmallGatherBytes = 64 * 1024;
// Exact-type all_reduces from kSmallReduceBytes up to this use recursive halving-doubling; the ring
// takes over above (n - 1 steps of 1/n of the data beat log2(n) steps once the bytes dominate).
constexpr size_t kRhdMaxBytes = 1u << 20;
// Broadcasts and reduces at least this large across hosts go down a pipelined chain.
constexpr size_t kChainMinBytes = 1u << 20;
// All-gathers (and order-free sums) across hosts from this many bytes per rank go around a ring.
constexpr size_t kRingGatherMinBytes = 256 * 1024;

size_t segmentElems(const CollCtx& c, size_t esize) {
  return std::max<size_t>(1, c.chunkBytes / esize);
}

// Number of segments a slice of `count` elements is sent in; both sides compute the same.
size_t numSegments(size_t count, size_t seg) {
  return count == 0 ? 1 : (count + seg - 1) / seg;
}

// Sends `count` elements starting at `p` to `peer` in segments (zero elements: one empty message).
void sendSegmented(CollCtx& c, std::vector<RequestPtr>& reqs, int peer, uint32_t step, const char* p,
                   size_t count, size_t esize, size_t seg) {
  size_t nseg = numSegments(count, seg);
  for (size_t s = 0; s < nseg; ++s) {
    size_t off = s * seg, n = std::min(seg, count - std::min(count, off));
    reqs.push_back(c.isend(peer, c.tag(step), p + off * esize, n * esize));
  }
}

// Receives every peer's contribution to this rank's slice segment by segment (two segments in
// flight per peer) and folds them, with this rank's own, in rank order into `out`.
// own: this rank's contribution; out may be == own.
void reduceSliceFromPeers(CollCtx& c, const void* own, void* out, size_t count, const ReduceSpec& spec,
                          uint32_t step) {
  const size_t esize = dtypeSize(spec.dtype);
  const size_t seg = segmentElems(c, esize);
  const size_t nseg = numSegments(count, seg);
  const int n = c.size;
  // slot layout: [buffer 0 | buffer 1] x peers, each seg elements
  char* scratch = static_cast<char*>(c.scratch.get(0, 2 * static_cast<size_t>(n) * seg * esize));
  auto slot = [&](int peer, size_t s) { return scratch + ((s & 1) * n + peer) * seg * esize; };
  std::vector<std::vector<RequestPtr>> inflight(2);
  auto post = [&](size_t s) {
    auto& v = inflight[s & 1];
    v.clear();
    size_t off = s * seg, m = std::min(seg, count - std::min(count, off));
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      v.push_back(c.irecv(q, c.tag(step), slot(q, s), m * esize));
    }
  };
  post(0);
  if (nseg > 1) post(1);
  std::vector<const void*> ins(n);
  for (size_t s = 0; s < nseg; ++s) {
    waitAll(inflight[s & 1], c.deadline);
    size_t off = s * seg, m = std::min(seg, count - std::min(count, off));
    for (int q = 0; q < n; ++q)
      ins[q] = (q == c.rank) ? static_cast<const char*>(own) + off * esize : static_cast<const void*>(slot(q, s));
    reduceInto(spec, static_cast<char*>(out) + off * esize, ins.data(), n, m);
    if (s + 2 < nseg) post(s + 2);
  }
}

// A ring's messages are cut in segments of this many bytes at most (MYCCL_TCP_CHUNK_BYTES if
// smaller): a rank passes a segment on (folded, for a reduction) as soon as it is in, so the next
// link is busy while the rest of the block still arrives, and the folds overlap the transfers.
constexpr size_t kRingSegmentBytes = 1u << 20;

// Segment size in bytes, a whole number of `esize`-byte elements.
size_t ringSegmentBytes(const CollCtx& c, size_t esize) {
  return std::max<size_t>(1, std::min<size_t>(c.chunkBytes, kRingSegmentBytes) / esize) * esize;
}

// Calls f(offset, length) for each segment of `nbytes` (one empty segment when nbytes is 0); both
// sides of a ring step compute the same cuts.
template <class F>
void forSegments(size_t nbytes, size_t seg, F&& f) {
  if (nbytes == 0) return f(size_t{0}, size_t{0});
  for (size_t off = 0; off < nbytes; off += seg) f(off, std::min(seg, nbytes - off));
}

// Whether a large op goes around a ring (ringAllgather; ringReduceScatter where the order of a
// sum may change, orderFree): across hosts, at least 3 ranks, `perRank` bytes or more from each
// (the same on every rank), unless MYCCL_CROSS_HOST_RING=0.
bool ringAcrossHosts(const CollCtx& c, size_t perRank) {
  return c.crossHostRing && c.crossHost && c.size >= 3 && perRank >= kRingGatherMinBytes;
}

// Slice q of `base` (partition's offs/cnts, in elements of `esize` bytes) as a pointer and a size
// in bytes, as the rings take them.
void sliceViews(char* base, const std::vector<size_t>& offs, const std::vector<size_t>& cnts, size_t esize,
                std::vector<void*>& views, std::vector<size_t>& bytes) {
  views.resize(offs.size());
  bytes.resize(offs.size());
  for (size_t q = 0; q < offs.size(); ++q) {
    views[q] = base + offs[q] * esize;
    bytes[q] = cnts[q] * esize;
  }
}

// Ring all-gather: in step s every rank passes the block it got in step s - 1 (its own first) to
// the next rank, so each rank only ever sends to one neighbour and receives from the other. On
// links that bind, that fixed pairing is what keeps every link full: sending to all at once (or to
// each peer in turn) has several senders meet on one receiver's link while another's idles, and a
// host's link then carries 0.77-0.87 of its rate where the ring carries 0.93-0.98 (docs/NOTES.md).
// Every receive lands in its final place, so all are posted first and the left neighbour hears
// it once (an empty message); the sends then need no announcement answered (isendPosted), a round
// trip that on a full link queues behind the data, once per step. outs[me] holds this rank's
// block already.
void ringAllgather(CollCtx& c, void* const* outs, const size_t* nbytes, uint32_t step) {
  const int n = c.size, me = c.rank;
  if (n == 1) return;
  const int right = (me + 1) % n, left = (me - 1 + n) % n;
  const size_t seg = ringSegmentBytes(c, 1);
  // recvs[s]: the segments of the block that arrives in step s, the one passed on in step s + 1
  std::vector<std::vector<RequestPtr>> recvs(n - 1);
  for (int s = 0; s < n - 1; ++s) {
    const int blk = (me - s - 1 + n) % n;
    forSegments(nbytes[blk], seg, [&](size_t off, size_t len) {
      recvs[s].push_back(c.irecv(left, c.tag(step), static_cast<char*>(outs[blk]) + off, len));
    });
  }
  auto ready = c.irecv(right, c.tag(kStepReady), nullptr, 0);
  auto told = c.isend(left, c.tag(kStepReady), nullptr, 0);
  ready->wait(c.deadline);
  std::vector<RequestPtr> sends;
  for (int s = 0; s < n - 1; ++s) {
    const int blk = (me - s + n) % n;
    size_t j = 0;
    forSegments(nbytes[blk], seg, [&](size_t off, size_t len) {
      if (s > 0) recvs[s - 1][j++]->wait(c.deadline);  // passed on as soon as it is in
      sends.push_back(c.isendPosted(right, c.tag(step), static_cast<char*>(outs[blk]) + off, len));
    });
  }
  for (auto& r : recvs.back()) r->wait(c.deadline);
  sends.push_back(told);
  waitAll(sends, c.deadline);
}

// One blocking step under one tag: receive inBytes from `from` while sending outBytes to `to`;
// a peer of -1 skips that half.
void sendRecv(CollCtx& c, uint32_t step, int to, const void* out, size_t outBytes, int from, void* in,
              size_t inBytes) {
  std::vector<RequestPtr> reqs;
  if (from >= 0) reqs.push_back(c.irecv(from, c.tag(step), in, inBytes));
  if (to >= 0) reqs.push_back(c.isend(to, c.tag(step), out, outBytes));
  waitAll(reqs, c.deadline);
}

// Bruck's all-gather, any n: ceil(log2 n) rounds. This rank keeps the blocks it holds in rank
// order starting at itself (block of rank (me + j) % n at rot + off[j]); in the round of distance d
// it sends the first min(d, n - d) of them to rank me - d and receives as many, which continue its
// run, from rank me + d. off gets n + 1 entries (off[n] = total bytes).
void bruckGather(CollCtx& c, const void* in, const size_t* nbytes, char* rot, std::vector<size_t>& off) {
  const int n = c.size, me = c.rank;
  off.assign(n + 1, 0);
  for (int j = 0; j < n; ++j) off[j + 1] = off[j] + nbytes[(me + j) % n];
  if (nbytes[me] && rot != in) std::memcpy(rot, in, nbytes[me]);
  uint32_t round = 0;
  for (int d = 1; d < n; d <<= 1, ++round) {
    const int k = std::min(d, n - d);
    sendRecv(c, kStepRounds + round, (me - d + n) % n, rot, off[k], (me + d) % n, rot + off[d], off[d + k] - off[d]);
  }
}

}  // namespace

namespace flat {

namespace {

// Recursive halving-doubling all-reduce (Rabenseifner): log2(p) halving exchanges leave each of
// p = 2^floor(log2 n) ranks with the reduction of 1/p of the buffer, log2(p) doubling exchanges
// spread it. The n - p extra ranks first hand their buffer to a neighbour and get the result back at
// the end. Partial results are combined in tree order, so like the ring it runs only for types whose
// result cannot depend on the order (integers and bool).
void rhdAllreduce(CollCtx& c, char* base, size_t count, const ReduceSpec& spec) {
  c.algo = "tcp-halving-doubling";
  const int n = c.size, me = c.rank;
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int extra = n - p;
  const size_t es = dtypeSize(spec.dtype);
  char* tmp = static_cast<char*>(c.scratch.get(5, std::max<size_t>(count, 1) * es));
  ReduceSpec partial = spec;
  partial.divisor = 0;
  // Ranks 0, 2, .., 2 * extra - 2 sit out; the others are renumbered 0..p-1.
  if (me < 2 * extra && me % 2 == 0) {
    sendRecv(c, kStepRounds, me + 1, base, count * es, -1, nullptr, 0);
    sendRecv(c, kStepRounds + 1, -1, nullptr, 0, me + 1, base, count * es);
    return;
  }
  if (me < 2 * extra) {
    sendRecv(c, kStepRounds, -1, nullptr, 0, me - 1, tmp, count * es);
    const void* ins[2] = {base, tmp};
    reduceInto(partial, base, ins, 2, count);  // n >= 4: a halving round follows
  }
  const int vr = me < 2 * extra ? me / 2 : me - extra;
  auto realRank = [&](int v) { return v < extra ? 2 * v + 1 : v + extra; };
  // Halving: the window [lo, hi) this rank is responsible for shrinks by half each round.
  std::vector<std::pair<size_t, size_t>> windows;
  size_t lo = 0, hi = count;
  uint32_t step = kStepRounds + 2;
  for (int mask = p / 2; mask >= 1; mask >>= 1, ++step) {
    const int vpeer = vr ^ mask;
    const size_t mid = lo + (hi - lo) / 2;
    const bool keepLow = vr < vpeer;
    const size_t klo = keepLow ? lo : mid, khi = keepLow ? mid : hi;
    const size_t glo = keepLow ? mid : lo, ghi = keepLow ? hi : mid;
    const int peer = realRank(vpeer);
    sendRecv(c, step, peer, base + glo * es, (ghi - glo) * es, peer, tmp, (khi - klo) * es);
    const void* ins[2] = {base + klo * es, tmp};
    reduceInto(mask == 1 ? spec : partial, base + klo * es, ins, 2, khi - klo);
    windows.emplace_back(lo, hi);
    lo = klo;
    hi = khi;
  }
  // Doubling: give the peer my window, take its half of the window we shared.
  for (int mask = 1; mask < p; mask <<= 1, ++step) {
    const int vpeer = vr ^ mask;
    auto [plo, phi] = windows.back();
    windows.pop_back();
    const size_t olo = (lo == plo) ? hi : plo, ohi = (lo == plo) ? phi : lo;
    const int peer = realRank(vpeer);
    sendRecv(c, step, peer, base + lo * es, (hi - lo) * es, peer, base + olo * es, (ohi - olo) * es);
    lo = plo;
    hi = phi;
  }
  if (me < 2 * extra) sendRecv(c, kStepRounds + 1, me - 1, base, count * es, -1, nullptr, 0);
}

// Whether a large reduction may go around a ring (ringReduceScatter), which folds each slice
// starting at a different rank: only where the order cannot change the result (integers and bool),
// or for floating-point types when the user gave up rank-order sums (MYCCL_ORDERED_SUMS=0).
bool exactType(DType dt) {
  return !isFloating(dt) && !isComplex(dt);
}

bool orderFree(const CollCtx& c, const ReduceSpec& spec) {
  return exactType(spec.dtype) || !c.orderedSums;
}

// Ring reduce-scatter: in step s each rank sends the partial of slice me - s - 1 to the next rank
// and folds the partial of slice me - s - 2 it gets from the previous one with its own input; after
// n - 1 steps it holds the whole sum of slice me in `out`. As in ringAllgather, each rank sends only
// to one neighbour, every receive (a scratch region per step, so that the left neighbour never waits
// for this one) is posted first and announced once, and the sends need no answer (isendPosted).
// ins[q] (counts[q] elements) is this rank's contribution to slice q; it is only read, and may be
// where `out` is for q == me. Partials travel in the element type.
void ringReduceScatter(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  const int n = c.size, me = c.rank;
  const int right = (me + 1) % n, left = (me - 1 + n) % n;
  const size_t esize = dtypeSize(spec.dtype);
  const size_t seg = ringSegmentBytes(c, esize);
  auto recvSlice = [&](int s) { return (me - s - 2 + 2 * n) % n; };
  std::vector<size_t> at(n, 0);
  size_t total = 0;
  for (int s = 0; s < n - 1; ++s) {
    at[s] = total;
    total += counts[recvSlice(s)] * esize;
  }
  char* tmp = static_cast<char*>(c.scratch.get(3, std::max<size_t>(total, 1)));
  std::vector<std::vector<RequestPtr>> recvs(n - 1);
  for (int s = 0; s < n - 1; ++s) {
    forSegments(counts[recvSlice(s)] * esize, seg, [&](size_t off, size_t len) {
      recvs[s].push_back(c.irecv(left, c.tag(kStepData), tmp + at[s] + off, len));
    });
  }
  auto ready = c.irecv(right, c.tag(kStepReadyData), nullptr, 0);
  auto told = c.isend(left, c.tag(kStepReadyData), nullptr, 0);
  ready->wait(c.deadline);
  std::vector<RequestPtr> sends;
  const int first = (me - 1 + n) % n;  // step 0 sends this rank's own input for it
  forSegments(counts[first] * esize, seg, [&](size_t off, size_t len) {
    sends.push_back(c.isendPosted(right, c.tag(kStepData), static_cast<const char*>(ins[first]) + off, len));
  });
  for (int s = 0; s < n - 1; ++s) {
    const int q = recvSlice(s);
    const bool last = s == n - 2;
    ReduceSpec partial = spec;
    partial.divisor = last ? spec.divisor : 0;  // AVG divides once, at the last step
    char* into = last ? static_cast<char*>(out) : tmp + at[s];
    size_t j = 0;
    forSegments(counts[q] * esize, seg, [&](size_t off, size_t len) {
      recvs[s][j++]->wait(c.deadline);
      const void* parts[2] = {static_cast<const char*>(ins[q]) + off, tmp + at[s] + off};
      reduceInto(partial, into + off, parts, 2, len / esize);
      // the partial of slice q is what step s + 1 sends
      if (!last) sends.push_back(c.isendPosted(right, c.tag(kStepData), into + off, len));
    });
  }
  sends.push_back(told);
  waitAll(sends, c.deadline);  // the inputs and partials in flight may now change
}

// Ring all-reduce: the ring reduce-scatter, then the ring all-gather of the reduced slices.
void ringAllreduce(CollCtx& c, char* base, size_t count, const ReduceSpec& spec) {
  c.algo = "tcp-ring";
  const int n = c.size;
  const size_t esize = dtypeSize(spec.dtype);
  std::vector<size_t> offs, cnts, bytes;
  partition(count, n, offs, cnts);
  std::vector<void*> slices;
  sliceViews(base, offs, cnts, esize, slices, bytes);
  ringReduceScatter(c, slices.data(), slices[c.rank], cnts.data(), spec);
  ringAllgather(c, slices.data(), bytes.data(), kStepGather);
}

// Binomial tree broadcast: log2(n) rounds instead of the root sending n-1 messages.
void treeBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-binomial-tree";
  const int n = c.size;
  const int vr = (c.rank - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (vr < mask) {
      if (vr + mask < n) sendRecv(c, kStepData, (vr + mask + root) % n, buf, nbytes, -1, nullptr, 0);
    } else if (vr < 2 * mask) {
      sendRecv(c, kStepData, -1, nullptr, 0, (vr - mask + root) % n, buf, nbytes);
    }
    mask <<= 1;
  }
}

// The chain: the root, its host's other ranks, then each next host's ranks. Returns this rank's
// neighbours towards the root (`up`) and away from it (`down`), -1 where there is none.
void chainNeighbours(const CollCtx& c, int root, int& up, int& down) {
  const int n = c.size;
  const auto& host = c.topo->hostOfRank;
  const int nh = c.topo->crossSize;
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](int q) { return std::make_tuple((host[q] - host[root] + nh) % nh, q != root, q); };
  std::sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), c.rank) - order.begin());
  up = pos > 0 ? order[pos - 1] : -1;
  down = pos + 1 < n ? order[pos + 1] : -1;
}

// Whether a broadcast or reduce goes down the chain: large, at least 3 ranks, several hosts.
bool chained(const CollCtx& c, size_t nbytes) {
  return c.size >= 3 && nbytes >= kChainMinBytes && c.topo && !c.topo->singleHost();
}

// Chunks of a chained op: small enough that filling the chain (n - 2 chunks) is a few percent of
// the message, at least 64 KiB.
size_t chainChunk(const CollCtx& c, size_t nbytes, size_t esize) {
  size_t chunk = std::clamp<size_t>(nbytes / (16 * static_cast<size_t>(c.size - 1)), 64 * 1024,
                                    std::max<size_t>(c.chunkBytes, 256 * 1024));
  return std::max<size_t>(esize, chunk / esize * esize);
}

// Large messages across hosts: a pipelined chain through the ranks, the root's host first (the
// root first in it), then the other hosts in order. Every rank receives the message once and
// passes it on once, so each host's link carries it once each way however many hosts there are,
// where scatter + all-gather makes the root's link carry it about twice (2(n-1)/n) and a
// binomial tree log2(n) times. Chunks keep every hop busy at once; they are small enough that
// filling the chain (n-2 chunks) is a few percent of the message.
void chainBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-pipelined-chain";
  int prev, next;
  chainNeighbours(c, root, prev, next);
  const size_t chunk = chainChunk(c, nbytes, 1);
  const size_t nchunks = (nbytes + chunk - 1) / chunk;
  char* base = static_cast<char*>(buf);
  auto part = [&](size_t k) { return std::min(chunk, nbytes - k * chunk); };
  std::vector<RequestPtr> recvs, sends;
  if (prev >= 0)
    for (size_t k = 0; k < nchunks; ++k) recvs.push_back(c.irecv(prev, c.tag(kStepData), base + k * chunk, part(k)));
  for (size_t k = 0; k < nchunks; ++k) {
    if (prev >= 0) recvs[k]->wait(c.deadline);
    if (next >= 0) sends.push_back(c.isend(next, c.tag(kStepData), base + k * chunk, part(k)));
  }
  waitAll(sends, c.deadline);
}

// The same chain the other way: the rank farthest from the root sends its input, each next one
// folds what it received with its own and passes the partial on, the root folds the last. Each
// host's link carries the message once each way; the reduce-scatter + gather below makes the
// root's carry it about twice. Partials travel in the element type, so this is for types where a
// fold per hop loses nothing a single fold would keep (not float16/bfloat16).
void chainReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.algo = "tcp-pipelined-chain";
  int next, prev;  // partials come from `prev` (farther from the root) and go to `next`
  chainNeighbours(c, root, next, prev);
  const size_t esize = dtypeSize(spec.dtype);
  const size_t nbytes = count * esize;
  const size_t chunk = chainChunk(c, nbytes, esize);
  const size_t nchunks = (nbytes + chunk - 1) / chunk;
  auto part = [&](size_t k) { return std::min(chunk, nbytes - k * chunk); };
  const char* src = static_cast<const char*>(in);
  if (prev < 0) {  // the far end: its input as it is
    std::vector<RequestPtr> sends;
    for (size_t k = 0; k < nchunks; ++k) sends.push_back(c.isend(next, c.tag(kStepData), src + k * chunk, part(k)));
    waitAll(sends, c.deadline);
    return;
  }
  char* got = static_cast<char*>(c.scratch.get(1, nbytes));
  char* dst = c.rank == root ? static_cast<char*>(out) : static_cast<char*>(c.scratch.get(2, nbytes));
  std::vector<RequestPtr> recvs, sends;
  for (size_t k = 0; k < nchunks; ++k) recvs.push_back(c.irecv(prev, c.tag(kStepData), got + k * chunk, part(k)));
  ReduceSpec hop = spec;
  if (c.rank != root) hop.divisor = 0;  // AVG divides once, at the root
  for (size_t k = 0; k < nchunks; ++k) {
    recvs[k]->wait(c.deadline);
    const void* ins[2] = {got + k * chunk, src + k * chunk};
    reduceInto(hop, dst + k * chunk, ins, 2, part(k) / esize);
    if (next >= 0) sends.push_back(c.isend(next, c.tag(kStepData), dst + k * chunk, part(k)));
  }
  waitAll(sends, c.deadline);
}

}  // namespace

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  c.agreement = agreementWord(spec, count);
  c.algo = "tcp-direct-reduce-scatter-all-gather";
  const int n = c.size;
  if (n == 1) return;
  const size_t esize = dtypeSize(spec.dtype);
  const size_t nbytes = count * esize;
  const bool small = nbytes <= kSmallReduceBytes || count < static_cast<size_t>(n);
  if (small && n >= kLogRoundsMinRanks) {
    // Everyone gathers every input in log2(n) rounds, then folds them in rank order: the same
    // result, bit for bit, as the one-round exchange below.
    c.algo = "tcp-bruck-gather-reduce";
    char* rot = static_cast<char*>(c.scratch.get(4, nbytes * n));
    std::vector<size_t> sizes(n, nbytes), off;
    bruckGather(c, buf, sizes.data(), rot, off);
    std::vector<const void*> ins(n);
    for (int q = 0; q < n; ++q) ins[q] = rot + off[(q - c.rank + n) % n];
    reduceInto(spec, buf, ins.data(), n, count);
    return;
  }
  if (small) {
    c.algo = "tcp-direct-one-round";
    // One round: everyone sends everything to everyone, everyone reduces in rank order.
    char* all = static_cast<char*>(c.scratch.get(1, nbytes * n));
    std::vector<RequestPtr> reqs;
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      reqs.push_back(c.irecv(q, c.tag(kStepData), all + q * nbytes, nbytes));
    }
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      reqs.push_back(c.isend(q, c.tag(kStepData), buf, nbytes));
    }
    waitAll(reqs, c.deadline);
    std::vector<const void*> ins(n);
    for (int q = 0; q < n; ++q) ins[q] = (q == c.rank) ? buf : all + q * nbytes;
    reduceInto(spec, buf, ins.data(), n, count);
    return;
  }
  const bool exact = exactType(spec.dtype);
  if (orderFree(c, spec) && ringAcrossHosts(c, nbytes / n)) return ringAllreduce(c, static_cast<char*>(buf), count, spec);
  if (n >= 4 && exact && nbytes > kRhdMaxBytes) return ringAllreduce(c, static_cast<char*>(buf), count, spec);
  if (n >= kLogRoundsMinRanks && exact) return rhdAllreduce(c, static_cast<char*>(buf), count, spec);
  std::vector<size_t> offs, cnts;
  partition(count, n, offs, cnts);
  char* base = static_cast<char*>(buf);
  const size_t seg = segmentElems(c, esize);
  // Reduce-scatter: slice q of my buffer goes to q; I reduce my slice in place.
  std::vector<RequestPtr> sends;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, base + offs[q] * esize, cnts[q], esize, seg);
  }
  char* mine = base + offs[c.rank] * esize;
  reduceSliceFromPeers(c, mine, mine, cnts[c.rank], spec, kStepData);
  waitAll(sends, c.deadline);  // my copies of other slices may now be overwritten
  // All-gather the reduced slices.
  if (ringAcrossHosts(c, nbytes / n)) {
    c.algo = "tcp-direct-reduce-scatter-ring-all-gather";
    std::vector<void*> outs;
    std::vector<size_t> bytes;
    sliceViews(base, offs, cnts, esize, outs, bytes);
    return ringAllgather(c, outs.data(), bytes.data(), kStepGather);
  }
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepGather), base + offs[q] * esize, cnts[q] * esize));
  }
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.isend(q, c.tag(kStepGather), mine, cnts[c.rank] * esize));
  }
  waitAll(reqs, c.deadline);
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-direct";
  const int n = c.size;
  if (n == 1) return;
  std::vector<RequestPtr> reqs;
  if (n >= 4 && nbytes < 256 * 1024) return treeBroadcast(c, buf, nbytes, root);
  if (chained(c, nbytes)) return chainBroadcast(c, buf, nbytes, root);
  if (n <= 3 || nbytes < 256 * 1024) {
    if (c.rank == root) {
      for (int q = 0; q < n; ++q)
        if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), buf, nbytes));
    } else {
      reqs.push_back(c.irecv(root, c.tag(kStepData), buf, nbytes));
    }
    waitAll(reqs, c.deadline);
    return;
  }
  // Large, many ranks: root scatters slices, then everyone all-gathers them, so the root sends
  // the message once instead of n-1 times.
  std::vector<size_t> offs, cnts;
  partition(nbytes, n, offs, cnts);
  char* base = static_cast<char*>(buf);
  if (c.rank == root) {
    for (int q = 0; q < n; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), base + offs[q], cnts[q]));
  } else {
    reqs.push_back(c.irecv(root, c.tag(kStepData), base + offs[c.rank], cnts[c.rank]));
  }
  waitAll(reqs, c.deadline);
  reqs.clear();
  // Everyone forwards the slice it holds to every rank that lacks it (the root lacks none).
  if (c.rank == root) {
    for (int q = 0; q < n; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepGather), base + offs[root], cnts[root]));
  } else {
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      reqs.push_back(c.irecv(q, c.tag(kStepGather), base + offs[q], cnts[q]));
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepGather), base + offs[c.rank], cnts[c.rank]));
    }
  }
  waitAll(reqs, c.deadline);
}

void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.agreement = agreementWord(spec, count);
  c.algo = "tcp-direct";
  const int n = c.size;
  const size_t esize = dtypeSize(spec.dtype);
  const size_t nbytes = count * esize;
  if (n == 1) {
    reduceInto(spec, out, &in, 1, count);
    return;
  }
  if (nbytes <= kSmallReduceBytes || count < static_cast<size_t>(n)) {
    std::vector<RequestPtr> reqs;
    if (c.rank != root) {
      reqs.push_back(c.isend(root, c.tag(kStepData), in, nbytes));
      waitAll(reqs, c.deadline);
      return;
    }
    char* all = static_cast<char*>(c.scratch.get(1, nbytes * n));
    for (int q = 0; q < n; ++q)
      if (q != root) reqs.push_back(c.irecv(q, c.tag(kStepData), all + q * nbytes, nbytes));
    waitAll(reqs, c.deadline);
    std::vector<const void*> ins(n);
    for (int q = 0; q < n; ++q) ins[q] = (q == root) ? in : all + q * nbytes;
    reduceInto(spec, out, ins.data(), n, count);
    return;
  }
  const bool lowPrecision = spec.dtype == DType::F16 || spec.dtype == DType::BF16;
  if (chained(c, nbytes) && spec.scale == 0.0 && !lowPrecision) {
    return chainReduce(c, in, out, count, spec, root);
  }
  // Direct reduce-scatter into scratch (inputs stay untouched), then gather slices at root.
  std::vector<size_t> offs, cnts;
  partition(count, n, offs, cnts);
  const char* src = static_cast<const char*>(in);
  const size_t seg = segmentElems(c, esize);
  std::vector<RequestPtr> sends;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, src + offs[q] * esize, cnts[q], esize, seg);
  }
  char* mine = (c.rank == root) ? static_cast<char*>(out) + offs[c.rank] * esize
                                : static_cast<char*>(c.scratch.get(2, cnts[c.rank] * esize));
  // On root `out` may be `in`: its slices still being sent must not change, so the root
  // reduces its own slice into scratch first when they alias.
  const bool alias = (c.rank == root) && (out == in);
  char* dst = alias ? static_cast<char*>(c.scratch.get(2, cnts[c.rank] * esize)) : mine;
  reduceSliceFromPeers(c, src + offs[c.rank] * esize, dst, cnts[c.rank], spec, kStepData);
  waitAll(sends, c.deadline);
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    if (alias) std::memcpy(mine, dst, cnts[c.rank] * esize);
    for (int q = 0; q < n; ++q)
      if (q != root)
        reqs.push_back(c.irecv(q, c.tag(kStepRoot), static_cast<char*>(out) + offs[q] * esize, cnts[q] * esize));
  } else {
    reqs.push_back(c.isend(root, c.tag(kStepRoot), dst, cnts[c.rank] * esize));
  }
  waitAll(reqs, c.deadline);
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  c.algo = "tcp-direct";
  size_t total = 0;
  for (int q = 0; q < c.size; ++q) total += nbytes[q];
  if (c.size >= kLogRoundsMinRanks && total <= kSmallGatherBytes) {
    c.algo = "tcp-bruck";
    char* rot = static_cast<char*>(c.scratch.get(4, std::max<size_t>(total, 1)));
    std::vector<size_t> off;
    bruckGather(c, in, nbytes, rot, off);
    for (int q = 0; q < c.size; ++q) {
      const char* src = rot + off[(q - c.rank + c.size) % c.size];
      if (nbytes[q] && outs[q] != src) std::memcpy(outs[q], src, nbytes[q]);
    }
    return;
  }
  if (ringAcrossHosts(c, total / c.size)) {
    c.algo = "tcp-ring";
    if (outs[c.rank] != in && nbytes[c.rank] > 0) std::memcpy(outs[c.rank], in, nbytes[c.rank]);
    return ringAllgather(c, outs, nbytes, kStepData);
  }
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepData), outs[q], nbytes[q]));
  }
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.isend(q, c.tag(kStepData), in, nbytes[c.rank]));
  }
  if (outs[c.rank] != in && nbytes[c.rank] > 0) std::memcpy(outs[c.rank], in, nbytes[c.rank]);
  waitAll(reqs, c.deadline);
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < c.size; ++q)
      if (q != root) reqs.push_back(c.irecv(q, c.tag(kStepData), outs[q], nbytes[q]));
    if (outs[root] != in && nbytes[root] > 0) std::memcpy(outs[root], in, nbytes[root]);
  } else {
    reqs.push_back(c.isend(root, c.tag(kStepData), in, nbytes[c.rank]));
  }
  waitAll(reqs, c.deadline);
}

void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < c.size; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), ins[q], nbytes[q]));
    if (ins[root] != out && nbytes[root] > 0) std::memcpy(out, ins[root], nbytes[root]);
  } else {
    reqs.push_back(c.irecv(root, c.tag(kStepData), out, nbytes[c.rank]));
  }
  waitAll(reqs, c.deadline);
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  size_t total = 0;
  for (int q = 0; q < c.size; ++q) total += counts[q];
  c.agreement = agreementWord(spec, total);
  c.algo = "tcp-direct";
  const size_t esize = dtypeSize(spec.dtype);
  if (orderFree(c, spec) && ringAcrossHosts(c, total * esize / c.size)) {
    c.algo = "tcp-ring";
    return ringReduceScatter(c, ins, out, counts, spec);
  }
  const size_t seg = segmentElems(c, esize);
  std::vector<RequestPtr> sends;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, static_cast<const char*>(ins[q]), counts[q], esize, seg);
  }
  if (c.size == 1) {
    reduceInto(spec, out, &ins[0], 1, counts[0]);
  } else {
    reduceSliceFromPeers(c, ins[c.rank], out, counts[c.rank], spec, kStepData);
  }
  waitAll(sends, c.deadline);
}

void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  c.algo = "tcp-pairwise";
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepData), recvs[q], recvBytes[q]));
  }
  for (int k = 1; k < c.size; ++k) {
    int q = (c.rank + k) % c.size;  // staggered so ranks do not all hit rank 0 first
    reqs.push_back(c.isend(q, c.tag(kStepData), sends[q], sendBytes[q]));
  }
  if (sendBytes[c.rank] != recvBytes[c.rank]) {
    throw CommError(CommErrorKind::Local, "all_to_all: this rank sends " + std::to_string(sendBytes[c.rank]) +
                                              " bytes to itself but expects " + std::to_string(recvBytes[c.rank]));
  }
  if (recvs[c.rank] != sends[c.rank] && recvBytes[c.rank] > 0)
    std::memmove(recvs[c.rank], sends[c.rank], recvBytes[c.rank]);
  waitAll(reqs, c.deadline);
}

void barrier(CollCtx& c) {
  c.algo = "tcp-dissemination";
  // Dissemination: log2(n) rounds of empty messages.
  for (int k = 1, step = 0; k < c.size; k <<= 1, ++step)
    sendRecv(c, kStepData + step, (c.rank + k) % c.size, nullptr, 0, (c.rank - k + c.size) % c.size, nullptr, 0);
}

}  // namespace flat
}  // namespace myccl::cpu
