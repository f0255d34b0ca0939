// Picks the algorithm for each collective (shared memory inside a host, direct exchanges
// over the message transport otherwise), and holds what all algorithms share: scratch
// memory and the tag layout.
#include <cstdlib>
#include <sstream>

#include "Direct.hpp"
#include "ShmAlgorithms.hpp"

namespace myccl::cpu {

Scratch::~Scratch() {
  release();
}

void* Scratch::get(int slot, size_t nbytes) {
  if (static_cast<size_t>(slot) >= bufs_.size()) bufs_.resize(slot + 1);
  Buf& b = bufs_[slot];
  if (b.size < nbytes) {
    std::free(b.ptr);
    size_t want = std::max<size_t>(nbytes, b.size + b.size / 2);
    b.ptr = std::aligned_alloc(64, (want + 63) / 64 * 64);
    if (b.ptr == nullptr) throw CommError(CommErrorKind::Local, "out of memory for " + std::to_string(want) + " bytes of scratch");
    b.size = want;
  }
  return b.ptr;
}

size_t Scratch::bytesHeld() const {
  size_t t = 0;
  for (auto& b : bufs_) t += b.size;
  return t;
}

void Scratch::release() {
  for (auto& b : bufs_) std::free(b.ptr);
  bufs_.clear();
}

uint64_t collectiveTagBase(uint8_t opCode, uint64_t seq) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(opCode & 0x7f) << 56) | ((seq & 0xffffffffffull) << 16);
}

uint64_t p2pTag(int userTag) {
  return static_cast<uint32_t>(userTag);
}
uint32_t agreementWord(const ReduceSpec& spec, size_t count) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 0xff51afd7ed558ccdull; h ^= h >> 33; };
  mix(static_cast<uint64_t>(spec.dtype));
  mix(static_cast<uint64_t>(spec.op));
  mix(static_cast<uint64_t>(spec.divisor));
  mix(count);
  return static_cast<uint32_t>(h) | 1u;  // never 0 (0 means "no check")
}

std::string describeTag(uint64_t tag) {
  static const char* names[] = {"?", "broadcast", "all_reduce", "reduce", "all_gather", "gather",
                                "scatter", "reduce_scatter", "all_to_all", "barrier"};
  std::ostringstream os;
  if (tag >> 63) {
    unsigned code = (tag >> 56) & 0x7f;
    os << (code < sizeof(names) / sizeof(names[0]) ? names[code] : code == 0x7e ? "fingerprint check of" : "op")
       << " #" << ((tag >> 16) & 0xffffffffffull);
  } else {
    os << "send with tag " << static_cast<int32_t>(tag & 0xffffffffu);
  }
  return os.str();
}

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  if (c.size == 1) return;
  if (c.shm) return shmalg::allreduce(c, *c.shm, buf, count, spec);
  direct::allreduce(c, buf, count, spec);
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  if (c.size == 1) return;
  if (c.shm) return shmalg::broadcast(c, *c.shm, buf, nbytes, root);
  direct::broadcast(c, buf, nbytes, root);
}

void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  if (c.shm && c.size > 1) return shmalg::reduce(c, *c.shm, in, out, count, spec, root);
  direct::reduce(c, in, out, count, spec, root);
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  if (c.shm && c.size > 1) return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, false, 0);
  direct::allgatherv(c, in, outs, nbytes);
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  if (c.shm && c.size > 1) return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, true, root);
  direct::gatherv(c, in, outs, nbytes, root);
}

void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  if (c.shm && c.size > 1) return shmalg::scatterv(c, *c.shm, ins, out, nbytes, root);
  direct::scatterv(c, ins, out, nbytes, root);
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  if (c.shm && c.size > 1) return shmalg::reduceScatterv(c, *c.shm, ins, out, counts, spec);
  direct::reduceScatterv(c, ins, out, counts, spec);
}

void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  if (c.shm && c.size > 1) return shmalg::alltoallv(c, *c.shm, sends, sendBytes, recvs, recvBytes);
  direct::alltoallv(c, sends, sendBytes, recvs, recvBytes);
}

void barrier(CollCtx& c) {
  if (c.size == 1) return;
  if (c.shm) return shmalg::barrier(c, *c.shm);
  direct::barrier(c);
}

}  // namespace myccl::cpu
