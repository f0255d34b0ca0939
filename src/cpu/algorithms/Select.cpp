// Picks the algorithm for each collective (shared memory inside a host, direct exchanges
// over the message transport otherwise), and holds what all algorithms share: scratch
// memory and the tag layout.
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "Direct.hpp"
#include "Hierarchical.hpp"
#include "ShmAlgorithms.hpp"
#include "myccl/Topology.hpp"
#include "myccl/cpu/Copy.hpp"
#include "myccl/cpu/Parallel.hpp"
#include "myccl/cpu/Reduce.hpp"

namespace myccl::cpu {

Scratch::~Scratch() {
  release();
}

// Where scratch starts within its page. Reductions read scratch and write the user's tensor in
// one loop; at the same offset within a page (torch's large tensors come from mmap at page +
// 64, as did 64-aligned scratch) loads and stores alias in the low 12 address bits and the CPU
// stalls loads behind stores: a 2-rank TCP all_reduce of 4 MiB took 3.7-3.9 ms instead of
// 3.0-3.1. No allocator hands out this offset by default.
constexpr size_t kScratchColour = 2048 + 192;

void* Scratch::get(int slot, size_t nbytes) {
  if (static_cast<size_t>(slot) >= bufs_.size()) bufs_.resize(slot + 1);
  Buf& b = bufs_[slot];
  if (b.size < nbytes) {
    std::free(b.ptr);
    size_t want = std::max<size_t>(nbytes, b.size + b.size / 2);
    b.ptr = std::aligned_alloc(4096, (want + kScratchColour + 4095) / 4096 * 4096);
    if (b.ptr == nullptr) throw CommError(CommErrorKind::Local, "out of memory for " + std::to_string(want) + " bytes of scratch");
    b.size = want;
  }
  return static_cast<char*>(b.ptr) + kScratchColour;
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
namespace {
constexpr size_t kParallelMinBytes = 256 * 1024;  // below this a hand-off costs more than it saves
}

void parallelCopy(CollCtx& c, void* dst, const void* src, size_t nbytes, bool stream) {
  if (!nbytes || dst == src) return;
  auto one = [stream](void* d, const void* s, size_t n) {
    if (stream)
      streamCopy(d, s, n);
    else
      std::memcpy(d, s, n);
  };
  if (!c.par || c.par->threads() == 1 || nbytes < 2 * kParallelMinBytes) {
    one(dst, src, nbytes);
    return;
  }
  c.par->run(nbytes, kParallelMinBytes, [&](size_t b, size_t e) {
    one(static_cast<char*>(dst) + b, static_cast<const char*>(src) + b, e - b);
  });
}

void parallelReduce(CollCtx& c, const ReduceSpec& spec, void* out, const void* const* ins, int n, size_t count) {
  const size_t es = dtypeSize(spec.dtype);
  if (!c.par || c.par->threads() == 1 || count * es < 2 * kParallelMinBytes) {
    reduceInto(spec, out, ins, n, count);
    return;
  }
  c.par->run(count, kParallelMinBytes / es, [&](size_t b, size_t e) {
    std::vector<const void*> part(n);
    for (int i = 0; i < n; ++i) part[i] = static_cast<const char*>(ins[i]) + b * es;
    reduceInto(spec, static_cast<char*>(out) + b * es, part.data(), n, e - b);
  });
}

void partition(size_t count, int parts, std::vector<size_t>& offsets, std::vector<size_t>& counts) {
  offsets.resize(parts);
  counts.resize(parts);
  size_t base = count / parts, extra = count % parts, off = 0;
  for (int r = 0; r < parts; ++r) {
    counts[r] = base + (static_cast<size_t>(r) < extra ? 1 : 0);
    offsets[r] = off;
    off += counts[r];
  }
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

namespace {

// Which family runs an op: shared memory when every rank shares this host, two levels when
// the group spans hosts and some host holds several ranks, direct TCP otherwise.
enum class Family { Single, Shm, Hier, Direct };

Family family(const CollCtx& c, bool hierarchicalVersion) {
  if (c.size == 1) return Family::Single;
  const bool multiHost = c.topo && c.topo->crossSize > 1;
  if (!multiHost) return c.shm ? Family::Shm : Family::Direct;
  return hierarchicalVersion && c.hierarchical && hier::applies(c) ? Family::Hier : Family::Direct;
}

}  // namespace

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  const Family f = family(c, true);
  if (spec.scale != 0.0 && f != Family::Shm) {
    // Only the shared-memory algorithms sum raw inputs in one pass; the others combine partial
    // sums, which must not be scaled again. Scaling first gives the same bits.
    scaleInPlace(spec.dtype, buf, count, spec.scale);
    ReduceSpec plain = spec;
    plain.scale = 0.0;
    return allreduce(c, buf, count, plain);
  }
  switch (f) {
    case Family::Single: return;
    case Family::Shm: return shmalg::allreduce(c, *c.shm, buf, count, spec);
    case Family::Hier: return hier::allreduce(c, buf, count, spec);
    case Family::Direct: return direct::allreduce(c, buf, count, spec);
  }
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  switch (family(c, true)) {
    case Family::Single: return;
    case Family::Shm: return shmalg::broadcast(c, *c.shm, buf, nbytes, root);
    case Family::Hier: return hier::broadcast(c, buf, nbytes, root);
    case Family::Direct: return direct::broadcast(c, buf, nbytes, root);
  }
}

void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::reduce(c, *c.shm, in, out, count, spec, root);
    default: return direct::reduce(c, in, out, count, spec, root);
  }
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  switch (family(c, true)) {
    case Family::Shm: return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, false, 0);
    case Family::Hier: return hier::allgatherv(c, in, outs, nbytes);
    default: return direct::allgatherv(c, in, outs, nbytes);
  }
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, true, root);
    default: return direct::gatherv(c, in, outs, nbytes, root);
  }
}

void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::scatterv(c, *c.shm, ins, out, nbytes, root);
    default: return direct::scatterv(c, ins, out, nbytes, root);
  }
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  switch (family(c, true)) {
    case Family::Shm: return shmalg::reduceScatterv(c, *c.shm, ins, out, counts, spec);
    case Family::Hier: return hier::reduceScatterv(c, ins, out, counts, spec);
    default: return direct::reduceScatterv(c, ins, out, counts, spec);
  }
}

void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::alltoallv(c, *c.shm, sends, sendBytes, recvs, recvBytes);
    default: return direct::alltoallv(c, sends, sendBytes, recvs, recvBytes);
  }
}

void barrier(CollCtx& c) {
  switch (family(c, true)) {
    case Family::Single: return;
    case Family::Shm: return shmalg::barrier(c, *c.shm);
    case Family::Hier: return hier::barrier(c);
    case Family::Direct: return direct::barrier(c);
  }
}

}  // namespace myccl::cpu
