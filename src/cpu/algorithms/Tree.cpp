// Binomial tree broadcast: log2(n) rounds in which every rank that has the message passes it to
// one that has not, instead of the root sending n - 1 messages (small broadcasts on many ranks).
#include "Flat.hpp"

namespace myccl::cpu::flat {

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

}  // namespace myccl::cpu::flat
