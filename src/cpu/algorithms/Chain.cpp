// Large broadcasts and reduces across hosts: a pipelined chain through the ranks, the root's host
// first (the root first in it), then the other hosts in order. Every rank receives the message
// once and passes it on once, so each host's link carries it once each way however many hosts
// there are, where scatter + all-gather makes the root's link carry it about twice (2(n-1)/n) and
// a binomial tree log2(n) times. Chunks keep every hop busy at once; they are small enough that
// filling the chain (n - 2 chunks) is a few percent of the message.
#include <numeric>
#include <tuple>

#include "Flat.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu::flat {

namespace {

// This rank's neighbours towards the root (`up`) and away from it (`down`), -1 where there is none.
void chainNeighbours(const CollCtx& c, int root, int& up, int& down) {
  const int n = c.size;
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (c.topo) {
    const auto& host = c.topo->hostOfRank;
    const int nh = c.topo->crossSize;
    auto key = [&](int q) { return std::make_tuple((host[q] - host[root] + nh) % nh, q != root, q); };
    std::sort(order.begin(), order.end(), [&](int a, int b) { return key(a) < key(b); });
  } else {
    std::rotate(order.begin(), order.begin() + root, order.end());
  }
  const int pos = static_cast<int>(std::find(order.begin(), order.end(), c.rank) - order.begin());
  up = pos > 0 ? order[pos - 1] : -1;
  down = pos + 1 < n ? order[pos + 1] : -1;
}

// At least 64 KiB, and small enough that filling the chain is a few percent of the message.
size_t chainChunk(const CollCtx& c, size_t nbytes, size_t esize) {
  size_t chunk = std::clamp<size_t>(nbytes / (16 * static_cast<size_t>(std::max(1, c.size - 1))), 64 * 1024,
                                    std::max<size_t>(c.chunkBytes, 256 * 1024));
  return std::max<size_t>(esize, chunk / esize * esize);
}

}  // namespace

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
// folds what it received with its own and passes the partial on, the root folds the last.
void chainReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.algo = "tcp-pipelined-chain";
  int next, prev;  // partials come from `prev` (farther from the root) and go to `next`
  chainNeighbours(c, root, next, prev);
  const size_t esize = dtypeSize(spec.dtype);
  const size_t nbytes = count * esize;
  if (prev < 0 && next < 0) {  // a chain of one
    reduceInto(spec, out, &in, 1, count);
    return;
  }
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

}  // namespace myccl::cpu::flat
