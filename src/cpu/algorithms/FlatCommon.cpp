// What the flat algorithms share: segmenting large messages, folding one slice from every
// peer in rank order, one blocking exchange step, a ring's segment size and slice views.
#include <cstring>

#include "Flat.hpp"

namespace myccl::cpu::flat {

namespace {

// A ring's messages are cut in segments of this many bytes at most (MYCCL_TCP_CHUNK_BYTES if
// smaller): a rank passes a segment on (folded, for a reduction) as soon as it is in, so the next
// link is busy while the rest of the block still arrives, and the folds overlap the transfers.
constexpr size_t kRingSegmentBytes = 1u << 20;

}  // namespace

size_t segmentElems(const CollCtx& c, size_t esize) {
  return std::max<size_t>(1, c.chunkBytes / esize);
}

size_t numSegments(size_t count, size_t seg) {
  return count == 0 ? 1 : (count + seg - 1) / seg;
}

void sendSegmented(CollCtx& c, std::vector<RequestPtr>& reqs, int peer, uint32_t step, const char* p, size_t count,
                   size_t esize, size_t seg) {
  size_t nseg = numSegments(count, seg);
  for (size_t s = 0; s < nseg; ++s) {
    size_t off = s * seg, n = std::min(seg, count - std::min(count, off));
    reqs.push_back(c.isend(peer, c.tag(step), p + off * esize, n * esize));
  }
}

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

void sendRecv(CollCtx& c, uint32_t step, int to, const void* out, size_t outBytes, int from, void* in,
              size_t inBytes) {
  std::vector<RequestPtr> reqs;
  if (from >= 0) reqs.push_back(c.irecv(from, c.tag(step), in, inBytes));
  if (to >= 0) reqs.push_back(c.isend(to, c.tag(step), out, outBytes));
  waitAll(reqs, c.deadline);
}

size_t ringSegmentBytes(const CollCtx& c, size_t esize) {
  return std::max<size_t>(1, std::min<size_t>(c.chunkBytes, kRingSegmentBytes) / esize) * esize;
}

void sliceViews(char* base, const std::vector<size_t>& offs, const std::vector<size_t>& cnts, size_t esize,
                std::vector<void*>& views, std::vector<size_t>& bytes) {
  views.resize(offs.size());
  bytes.resize(offs.size());
  for (size_t q = 0; q < offs.size(); ++q) {
    views[q] = base + offs[q] * esize;
    bytes[q] = cnts[q] * esize;
  }
}

}  // namespace myccl::cpu::flat
