// Recursive halving-doubling all-reduce (Rabenseifner): log2(p) halving exchanges leave each of
// p = 2^floor(log2 n) ranks with the reduction of 1/p of the buffer, log2(p) doubling exchanges
// spread it. The n - p extra ranks first hand their buffer to a neighbour and get the result back
// at the end. Partial results are combined in tree order, so it runs only for types whose result
// cannot depend on the order (integers and bool; Select.cpp).
#include "Flat.hpp"

namespace myccl::cpu::flat {

void rhdAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  c.algo = "tcp-halving-doubling";
  const int n = c.size, me = c.rank;
  if (n == 1) {
    const void* in = buf;
    reduceInto(spec, buf, &in, 1, count);
    return;
  }
  char* base = static_cast<char*>(buf);
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
    // With p == 1 (n == 3 is not: p = 2) this would be the last fold; p >= 2 here, so a halving
    // round follows and applies the divisor.
    reduceInto(partial, base, ins, 2, count);
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

}  // namespace myccl::cpu::flat
