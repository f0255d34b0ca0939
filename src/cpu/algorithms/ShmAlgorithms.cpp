// Collectives among the ranks of one host through shared memory. Every op is a sequence of
// steps (see Shm.hpp): a rank writes what others must read into its staging buffer of the
// step's parity, posts the step, waits for the ranks it reads from, and reads straight out of
// their buffers. Reductions: small ones in one step (everyone reads everything), large ones
// as a chunked reduce-scatter (each rank reduces its slice from all peers' buffers, in rank
// order) followed by an all-gather of the reduced slices.
#include "ShmAlgorithms.hpp"

#include "myccl/cpu/Copy.hpp"

#include <algorithm>
#include <cstring>

namespace myccl::cpu::shmalg {

namespace {

// The agreement word of an op's first step (StepDesc::arg): every local rank must post the same
// one. Reductions: count << 16 | dtype << 8 | 0x80 AVG | 0x40 scaled | op (reduce also mixes the
// root into bits 58..63, above any count); byte movers: total bytes << 8 | root (0xff: none).
constexpr uint64_t kAvgBit = 0x80, kScaledBit = 0x40, kRedOpMask = 0x7, kCountMask = 0xffffffffff;

uint64_t reduceArg(size_t count, const ReduceSpec& spec) {
  return (static_cast<uint64_t>(count) << 16) | (static_cast<uint64_t>(spec.dtype) << 8) |
         static_cast<uint64_t>(spec.op) | (spec.divisor ? kAvgBit : 0) | (spec.scale != 0.0 ? kScaledBit : 0);
}

constexpr uint64_t kAgreedArg = 0x41475245;  // "AGRE": the agreed op's fixed word
constexpr uint64_t kScaleOffer = 0x5343414c;  // "SCAL": beside a scaled sum's factor (sameScale)

uint64_t bytesArg(size_t nbytes, uint64_t root) {
  return (static_cast<uint64_t>(nbytes) << 8) | (root & 0xff);
}

void copy(CollCtx& c, void* dst, const void* src, size_t n) {
  parallelCopy(c, dst, src, n);
}

// Step A of a chunked reduction: stage in this rank's buffer the slices of `base` that the other
// ranks reduce (slice q = [so[q], +sc[q]) elements of es bytes), post, and wait for everyone's.
// Returns the step, whose buffers the reducing step reads.
uint32_t stageSlices(CollCtx& c, ShmGroup& g, const StepDesc& desc, const char* base, const std::vector<size_t>& so,
                     const std::vector<size_t>& sc, size_t es) {
  const int n = g.size(), me = g.rank();
  const uint32_t a = g.begin(desc, c.deadline);
  char* stage = g.buffer(me, a & 1);
  for (int q = 0; q < n; ++q)
    if (q != me) copy(c, stage + so[q] * es, base + so[q] * es, sc[q] * es);
  g.post(a);
  g.waitAll(a, c.deadline);
  return a;
}

// Ops whose results, over all ranks of this host, fill at least a last-level cache write them
// into the caller's tensors with streaming stores: memcpy reads every destination line before
// overwriting it, which costs a large share of the copy rate into memory that is not in cache.
// Smaller results may still be in cache when the caller reads them, and there memcpy is as
// fast or faster. Reduce and scatter's receivers keep memcpy; scatter's root streams its own
// block only (the measurements behind each choice: docs/DECISIONS.md, "Large results are written
// with streaming stores").
// `hostBytes`: what the op writes into result tensors on this host (all local ranks
// together); the threshold is MYCCL_STREAM_STORE_BYTES (default: the LLC's size,
// streamCopyMinBytes()).
void copyOut(CollCtx& c, void* dst, const void* src, size_t n, size_t hostBytes) {
  parallelCopy(c, dst, src, n, hostBytes >= c.streamMinBytes);
}

// Zero copy (Select.cpp says when to try it): every rank publishes where its buffer is; when
// every buffer lives in registered shared memory (tensors from allocateTensor) peers read each
// other's tensors in place and the staging copies disappear. All ranks take the same decision,
// from the published regions.
// One step: publish where `mine` is; true (and `ptrs`) if the ranks in `need` all have
// registered buffers. `ptrs[q]` is then rank q's buffer in this process.
bool agreeZeroCopy(CollCtx& c, ShmGroup& g, const StepDesc& desc, const void* mine, size_t nbytes,
                   const std::vector<int>& need, std::vector<char*>& ptrs) {
  const int n = g.size(), me = g.rank();
  const uint32_t s = g.begin(desc, c.deadline);
  ShmGroup::packRegion(g.locate(mine, nbytes), g.scratch(me, s));
  g.post(s);
  g.waitAll(s, c.deadline);
  ptrs.assign(n, nullptr);
  for (int q : need)
    if (ShmGroup::unpackRegion(g.scratch(q, s)).slot < 0) return false;
  for (int q : need)
    ptrs[q] = (q == me) ? static_cast<char*>(const_cast<void*>(mine)) : g.resolve(q, ShmGroup::unpackRegion(g.scratch(q, s)));
  return true;
}

std::vector<int> everyone(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Final step of a zero-copy op: nobody returns (and lets its caller touch its tensor) while a
// peer may still be reading it.
void finishZeroCopy(CollCtx& c, ShmGroup& g, const StepDesc& desc) {
  const uint32_t s = g.begin(desc, c.deadline);
  g.post(s);
  g.waitAll(s, c.deadline);
}

}  // namespace

namespace {

// The end of a one-step reduction: fold every peer's buffer staged in step `s` into `data`.
void foldStaged(CollCtx& c, ShmGroup& g, uint32_t s, char* data, size_t count, const ReduceSpec& spec) {
  const int n = g.size(), me = g.rank();
  std::vector<const void*> ins(n);
  for (int q = 0; q < n; ++q) ins[q] = (q == me) ? static_cast<const void*>(data) : g.buffer(q, s & 1);
  parallelReduce(c, spec, data, ins.data(), n, count);
}

}  // namespace

void allreduceOneStep(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec) {
  const size_t nbytes = count * dtypeSize(spec.dtype);
  const StepDesc desc{c.tagBase, reduceArg(count, spec)};
  char* data = static_cast<char*>(buf);
  c.algo = "shm-one-step";
  const uint32_t s = g.begin(desc, c.deadline);
  copy(c, g.buffer(g.rank(), s & 1), data, nbytes);
  g.post(s);
  g.waitAll(s, c.deadline);
  foldStaged(c, g, s, data, count, spec);
}

bool sameScale(CollCtx& c, ShmGroup& g, size_t count, const ReduceSpec& spec) {
  StepDesc desc{c.tagBase, reduceArg(count, spec)};
  std::memcpy(&desc.agree[0], &spec.scale, sizeof(double));  // never 0: the scale is not 0
  desc.agree[1] = kScaleOffer;
  const uint32_t s = g.begin(desc, c.deadline);
  g.post(s);
  g.waitAll(s, c.deadline);
  return g.allAgree(s);
}

bool allreduceAgreed(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec, uint64_t key) {
  const size_t nbytes = count * dtypeSize(spec.dtype);
  // The step itself is the same on every rank whatever each offers (a fixed agreement word), so
  // no difference between the offers can fail the group; the offer carries the exact size and
  // reduction beside the caller's key, so ranks never read a length they did not agree on.
  const bool offer = key != 0 && nbytes <= g.stagingBytes();
  StepDesc desc{c.tagBase, kAgreedArg};
  if (offer) {
    desc.agree[0] = key;
    desc.agree[1] = reduceArg(count, spec);
  }
  c.algo = "shm-declined";  // the stats tell the two outcomes apart
  char* data = static_cast<char*>(buf);
  const uint32_t s = g.begin(desc, c.deadline);
  if (offer) copy(c, g.buffer(g.rank(), s & 1), data, nbytes);
  g.post(s);
  g.waitAll(s, c.deadline);
  if (!g.allAgree(s)) return false;  // every rank returns here alike: nothing was written
  c.algo = "shm-agreed";
  foldStaged(c, g, s, data, count, spec);
  return true;
}

void allreduceSliced(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec, bool tryZeroCopy) {
  const int n = g.size(), me = g.rank();
  const size_t es = dtypeSize(spec.dtype);
  const size_t nbytes = count * es;
  const StepDesc desc{c.tagBase, reduceArg(count, spec)};
  char* data = static_cast<char*>(buf);
  std::vector<const void*> ins(n);
  std::vector<size_t> so, sc;
  if (tryZeroCopy) {
    std::vector<char*> ptrs;
    if (agreeZeroCopy(c, g, desc, data, nbytes, everyone(n), ptrs)) {
      c.algo = "shm-zero-copy";
      // Reduce my slice straight out of every rank's tensor, then copy the others' slices.
      partition(count, n, so, sc);
      for (int q = 0; q < n; ++q) ins[q] = ptrs[q] + so[me] * es;
      const uint32_t a = g.begin(desc, c.deadline);
      parallelReduce(c, spec, data + so[me] * es, ins.data(), n, sc[me]);
      g.post(a);
      g.waitAll(a, c.deadline);
      for (int q = 0; q < n; ++q)
        if (q != me) copyOut(c, data + so[q] * es, ptrs[q] + so[q] * es, sc[q] * es, nbytes * n);
      finishZeroCopy(c, g, desc);
      return;
    }
  }
  c.algo = "shm-reduce-scatter-all-gather";
  const size_t chunk = std::max<size_t>(n, g.stagingBytes() / es);
  for (size_t off = 0; off < count; off += chunk) {
    const size_t m = std::min(chunk, count - off);
    partition(m, n, so, sc);
    char* base = data + off * es;
    const uint32_t a = stageSlices(c, g, desc, base, so, sc, es);
    // Step B: reduce my slice out of everybody's step-A buffer, publish it.
    const uint32_t b = g.begin(desc, c.deadline);
    char* mine = base + so[me] * es;
    for (int q = 0; q < n; ++q) ins[q] = (q == me) ? static_cast<const void*>(mine) : g.buffer(q, a & 1) + so[me] * es;
    parallelReduce(c, spec, mine, ins.data(), n, sc[me]);
    copy(c, g.buffer(me, b & 1) + so[me] * es, mine, sc[me] * es);
    g.post(b);
    g.waitAll(b, c.deadline);
    for (int q = 0; q < n; ++q)
      if (q != me) copy(c, base + so[q] * es, g.buffer(q, b & 1) + so[q] * es, sc[q] * es);
  }
}

void pipelinedBroadcast(CollCtx& c, ShmGroup& g, void* buf, size_t nbytes, int root, bool tryZeroCopy) {
  const int n = g.size(), me = g.rank();
  const StepDesc desc{c.tagBase, bytesArg(nbytes, static_cast<uint64_t>(root))};
  const size_t chunk = g.stagingBytes();
  char* data = static_cast<char*>(buf);
  if (tryZeroCopy) {
    std::vector<char*> ptrs;
    if (agreeZeroCopy(c, g, desc, data, nbytes, {root}, ptrs)) {
      c.algo = "shm-zero-copy";
      if (me != root) copyOut(c, data, ptrs[root], nbytes, nbytes * n);
      finishZeroCopy(c, g, desc);
      return;
    }
  }
  // Non-roots post a step as soon as they start it (they write nothing), which lets the root
  // stage chunk k+1 while they copy chunk k out.
  c.algo = "shm-pipelined";
  for (size_t off = 0; off < nbytes; off += chunk) {
    const size_t m = std::min(chunk, nbytes - off);
    const uint32_t s = g.begin(desc, c.deadline);
    if (me == root) copy(c, g.buffer(me, s & 1), data + off, m);
    g.post(s);
    if (me != root) {
      g.wait(root, s, c.deadline);
      copyOut(c, data + off, g.buffer(root, s & 1), m, nbytes * n);
    }
  }
}

void reduceOneStep(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  const int n = g.size(), me = g.rank();
  const size_t es = dtypeSize(spec.dtype);
  const size_t nbytes = count * es;
  const StepDesc desc{c.tagBase, reduceArg(count, spec) ^ (static_cast<uint64_t>(root) << 58)};
  const char* src = static_cast<const char*>(in);
  std::vector<const void*> ins(n);
  c.algo = "shm-one-step";
  const uint32_t s = g.begin(desc, c.deadline);
  if (me != root) copy(c, g.buffer(me, s & 1), src, nbytes);
  g.post(s);
  if (me == root) {
    g.waitAll(s, c.deadline);
    for (int q = 0; q < n; ++q) ins[q] = (q == me) ? static_cast<const void*>(src) : g.buffer(q, s & 1);
    parallelReduce(c, spec, out, ins.data(), n, count);
  }
}

void reduceSliced(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  const int n = g.size(), me = g.rank();
  const size_t es = dtypeSize(spec.dtype);
  const StepDesc desc{c.tagBase, reduceArg(count, spec) ^ (static_cast<uint64_t>(root) << 58)};
  const char* src = static_cast<const char*>(in);
  std::vector<const void*> ins(n);
  c.algo = "shm-reduce-scatter-gather";
  const size_t chunk = std::max<size_t>(n, g.stagingBytes() / es);
  std::vector<size_t> so, sc;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t m = std::min(chunk, count - off);
    partition(m, n, so, sc);
    const char* base = src + off * es;
    const uint32_t a = stageSlices(c, g, desc, base, so, sc, es);
    const uint32_t b = g.begin(desc, c.deadline);
    // The input must stay untouched: my reduced slice goes to staging (or straight to `out`).
    char* dst = (me == root) ? static_cast<char*>(out) + (off + so[me]) * es : g.buffer(me, b & 1) + so[me] * es;
    for (int q = 0; q < n; ++q)
      ins[q] = (q == me) ? static_cast<const void*>(base + so[me] * es) : g.buffer(q, a & 1) + so[me] * es;
    parallelReduce(c, spec, dst, ins.data(), n, sc[me]);
    g.post(b);
    if (me == root) {
      for (int q = 0; q < n; ++q) {
        if (q == me) continue;
        g.wait(q, b, c.deadline);
        copy(c, static_cast<char*>(out) + (off + so[q]) * es, g.buffer(q, b & 1) + so[q] * es, sc[q] * es);
      }
    }
  }
}

void allgatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes, bool rootOnly,
                int root, bool tryZeroCopy) {
  const int n = g.size(), me = g.rank();
  size_t most = 0, total = 0;
  for (int q = 0; q < n; ++q) most = std::max(most, nbytes[q]), total += nbytes[q];
  const StepDesc desc{c.tagBase, bytesArg(total, rootOnly ? static_cast<uint64_t>(root) : 0xff)};
  const bool receiver = !rootOnly || me == root;
  const size_t written = rootOnly ? total : total * n;  // result bytes on this host
  if (receiver) copyOut(c, outs[me], in, nbytes[me], written);
  if (tryZeroCopy && !rootOnly) {
    std::vector<char*> ptrs;
    if (agreeZeroCopy(c, g, desc, in, nbytes[me], everyone(n), ptrs)) {
      c.algo = "shm-zero-copy";
      for (int q = 0; q < n; ++q)
        if (q != me) copyOut(c, outs[q], ptrs[q], nbytes[q], written);
      finishZeroCopy(c, g, desc);
      return;
    }
  }
  c.algo = "shm-staged";
  const size_t chunk = g.stagingBytes();
  for (size_t off = 0; off < most; off += chunk) {
    const uint32_t s = g.begin(desc, c.deadline);
    if (off < nbytes[me] && !(rootOnly && me == root))
      copy(c, g.buffer(me, s & 1), static_cast<const char*>(in) + off, std::min(chunk, nbytes[me] - off));
    g.post(s);
    if (!receiver) continue;
    for (int q = 0; q < n; ++q) {
      if (q == me || off >= nbytes[q]) continue;
      g.wait(q, s, c.deadline);
      copyOut(c, static_cast<char*>(outs[q]) + off, g.buffer(q, s & 1), std::min(chunk, nbytes[q] - off), written);
    }
  }
}

void scatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* nbytes, int root) {
  const int n = g.size(), me = g.rank();
  size_t most = 0, total = 0;
  for (int q = 0; q < n; ++q) most = std::max(most, nbytes[q]), total += nbytes[q];
  const StepDesc desc{c.tagBase, bytesArg(total, static_cast<uint64_t>(root))};
  if (me == root) copyOut(c, out, ins[me], nbytes[me], total);
  c.algo = "shm-staged";
  const size_t region = std::max<size_t>(64, g.stagingBytes() / n / 64 * 64);
  for (size_t off = 0; off < most; off += region) {
    const uint32_t s = g.begin(desc, c.deadline);
    if (me == root) {
      char* stage = g.buffer(me, s & 1);
      for (int q = 0; q < n; ++q)
        if (q != me && off < nbytes[q])
          copy(c, stage + q * region, static_cast<const char*>(ins[q]) + off, std::min(region, nbytes[q] - off));
    }
    g.post(s);
    if (me != root && off < nbytes[me]) {
      g.wait(root, s, c.deadline);
      copy(c, static_cast<char*>(out) + off, g.buffer(root, s & 1) + me * region, std::min(region, nbytes[me] - off));
    }
  }
}

void reduceScatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* counts,
                    const ReduceSpec& spec, bool tryZeroCopy) {
  const int n = g.size(), me = g.rank();
  const size_t es = dtypeSize(spec.dtype);
  size_t most = 0, total = 0;
  for (int q = 0; q < n; ++q) most = std::max(most, counts[q]), total += counts[q];
  const StepDesc desc{c.tagBase, reduceArg(total, spec)};
  std::vector<const void*> from(n);
  if (tryZeroCopy) {
    bool contiguous = true;
    std::vector<size_t> prefix(n + 1, 0);
    for (int q = 0; q < n; ++q) {
      prefix[q + 1] = prefix[q] + counts[q];
      contiguous &= static_cast<const char*>(ins[q]) == static_cast<const char*>(ins[0]) + prefix[q] * es;
    }
    std::vector<char*> ptrs;
    // Every rank takes part in the agreement; a non-contiguous input simply publishes nothing.
    if (agreeZeroCopy(c, g, desc, contiguous ? ins[0] : nullptr, contiguous ? total * es : 0, everyone(n), ptrs)) {
      c.algo = "shm-zero-copy";
      for (int q = 0; q < n; ++q) from[q] = ptrs[q] + prefix[me] * es;
      parallelReduce(c, spec, out, from.data(), n, counts[me]);
      finishZeroCopy(c, g, desc);
      return;
    }
  }
  c.algo = "shm-staged";
  const size_t region = std::max<size_t>(1, g.stagingBytes() / n / es);  // elements per destination
  for (size_t off = 0; off < most; off += region) {
    const uint32_t s = g.begin(desc, c.deadline);
    char* stage = g.buffer(me, s & 1);
    for (int q = 0; q < n; ++q)
      if (q != me && off < counts[q])
        copy(c, stage + q * region * es, static_cast<const char*>(ins[q]) + off * es, std::min(region, counts[q] - off) * es);
    g.post(s);
    if (off >= counts[me]) continue;
    g.waitAll(s, c.deadline);
    const size_t m = std::min(region, counts[me] - off);
    for (int q = 0; q < n; ++q)
      from[q] = (q == me) ? static_cast<const char*>(ins[me]) + off * es : g.buffer(q, s & 1) + me * region * es;
    parallelReduce(c, spec, static_cast<char*>(out) + off * es, from.data(), n, m);
  }
}

void alltoallv(CollCtx& c, ShmGroup& g, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  const int n = g.size(), me = g.rank();
  const StepDesc desc{c.tagBase, 0};
  c.algo = "shm-staged";
  // Step 0: everybody publishes what it sends to whom; mismatches are caught here, by name.
  const uint32_t s0 = g.begin(desc, c.deadline);
  auto* mySizes = reinterpret_cast<uint64_t*>(g.buffer(me, s0 & 1));  // n words fit: staging >= 4 KiB
  for (int q = 0; q < n; ++q) mySizes[q] = sendBytes[q];
  g.post(s0);
  g.waitAll(s0, c.deadline);
  size_t most = 0;
  for (int q = 0; q < n; ++q) {
    auto* theirs = reinterpret_cast<const uint64_t*>(g.buffer(q, s0 & 1));
    for (int r = 0; r < n; ++r) most = std::max<size_t>(most, theirs[r]);
    if (theirs[me] != recvBytes[q]) {
      throw CommError(CommErrorKind::Protocol,
                      "rank " + std::to_string(g.groupRank(q)) + " sends " + std::to_string(theirs[me]) +
                          " bytes to this rank but this rank expects " + std::to_string(recvBytes[q]) +
                          " from it (check the split sizes)",
                      g.groupRank(q));
    }
  }
  size_t received = 0;
  for (int q = 0; q < n; ++q) received += recvBytes[q];
  copyOut(c, recvs[me], sends[me], recvBytes[me], received * n);
  const size_t region = std::max<size_t>(64, g.stagingBytes() / n / 64 * 64);
  for (size_t off = 0; off < most; off += region) {
    const uint32_t s = g.begin(desc, c.deadline);
    char* stage = g.buffer(me, s & 1);
    for (int q = 0; q < n; ++q)
      if (q != me && off < sendBytes[q])
        copy(c, stage + q * region, static_cast<const char*>(sends[q]) + off, std::min(region, sendBytes[q] - off));
    g.post(s);
    for (int q = 0; q < n; ++q) {
      if (q == me || off >= recvBytes[q]) continue;
      g.wait(q, s, c.deadline);
      copyOut(c, static_cast<char*>(recvs[q]) + off, g.buffer(q, s & 1) + me * region,
              std::min(region, recvBytes[q] - off), received * n);
    }
  }
}

void barrier(CollCtx& c, ShmGroup& g) {
  c.algo = "shm-flags";
  const uint32_t s = g.begin(StepDesc{c.tagBase, 0}, c.deadline);
  g.post(s);
  g.waitAll(s, c.deadline);
}

}  // namespace myccl::cpu::shmalg

namespace myccl::cpu {

std::string describeStep(uint64_t tagBase, uint64_t arg) {
  std::string s = describeTag(tagBase);
  switch (tagOpCode(tagBase)) {
    case OpCode::Allreduce:
    case OpCode::Reduce:
    case OpCode::ReduceScatter:
      return s + " on " + std::to_string((arg >> 16) & shmalg::kCountMask) + " x " +
             dtypeName(static_cast<DType>((arg >> 8) & 0xff)) + " " +
             redOpName(static_cast<RedOp>(arg & shmalg::kRedOpMask)) + ((arg & shmalg::kAvgBit) ? "/AVG" : "");
    case OpCode::Broadcast:
    case OpCode::Allgather:
    case OpCode::Gather:
    case OpCode::Scatter:
      return s + " of " + std::to_string(arg >> 8) + " bytes";
    default:
      return s;
  }
}

}  // namespace myccl::cpu
