// Exchanges in ceil(log2 n) rounds, where in the round of distance d a rank trades with the ranks
// d away on either side: Bruck's all-gather (every block moves log2(n) times, each rank sends
// ~log2(n) messages instead of n - 1) for small all-gathers and small reductions on many ranks,
// and the dissemination barrier.
#include <cstring>

#include "Flat.hpp"

namespace myccl::cpu::flat {

// This rank keeps the blocks it holds in rank order starting at itself; in the round of distance
// d it sends the first min(d, n - d) of them to rank me - d and receives as many, which continue
// its run, from rank me + d.
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

void bruckAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  c.algo = "tcp-bruck";
  size_t total = 0;
  for (int q = 0; q < c.size; ++q) total += nbytes[q];
  char* rot = static_cast<char*>(c.scratch.get(4, std::max<size_t>(total, 1)));
  std::vector<size_t> off;
  bruckGather(c, in, nbytes, rot, off);
  for (int q = 0; q < c.size; ++q) {
    const char* src = rot + off[(q - c.rank + c.size) % c.size];
    if (nbytes[q] && outs[q] != src) std::memcpy(outs[q], src, nbytes[q]);
  }
}

void bruckAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  c.algo = "tcp-bruck-gather-reduce";
  const int n = c.size;
  const size_t nbytes = count * dtypeSize(spec.dtype);
  char* rot = static_cast<char*>(c.scratch.get(4, std::max<size_t>(nbytes * n, 1)));
  std::vector<size_t> sizes(n, nbytes), off;
  bruckGather(c, buf, sizes.data(), rot, off);
  std::vector<const void*> ins(n);
  for (int q = 0; q < n; ++q) ins[q] = rot + off[(q - c.rank + n) % n];
  reduceInto(spec, buf, ins.data(), n, count);
}

void disseminationBarrier(CollCtx& c) {
  c.algo = "tcp-dissemination";
  for (int k = 1, step = 0; k < c.size; k <<= 1, ++step)
    sendRecv(c, kStepData + step, (c.rank + k) % c.size, nullptr, 0, (c.rank - k + c.size) % c.size, nullptr, 0);
}

}  // namespace myccl::cpu::flat
