// What the algorithms share besides the transport: engine-owned scratch memory, copies and
// reductions split across helper threads, slicing of a buffer into near-equal parts, and the
// agreement word every rank of a reduction must share.
#include <cstdlib>
#include <cstring>

#include "myccl/Topology.hpp"
#include "myccl/cpu/Copy.hpp"
#include "myccl/cpu/Parallel.hpp"
#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"

namespace myccl::cpu {

Scratch::~Scratch() {
  release();
}

// Where scratch starts within its page. Reductions read scratch and write the user's tensor in
// one loop; at the same offset within a page (torch's large tensors come from mmap at page +
// 64, as did 64-aligned scratch) loads and stores alias in the low 12 address bits and the CPU
// stalls loads behind stores (docs/DECISIONS.md, "Scratch starts 2240 bytes into a page"). No allocator hands
// out this offset by default.
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

CollCtx CollCtx::sub(const std::vector<int>& m, int myIdx) const {
  CollCtx c = *this;
  c.members = &m;
  c.rank = myIdx;
  c.size = static_cast<int>(m.size());
  c.shm = nullptr;
  if (topo) {
    c.crossHost = false;
    for (int r : m) c.crossHost = c.crossHost || !topo->sameHost(r, m[myIdx]);
  }
  c.topo = nullptr;
  c.levels = nullptr;  // the group's choice is made on the whole group's context
  return c;
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

}  // namespace myccl::cpu
