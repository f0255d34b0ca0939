// Rings: in each step every rank passes a block to its right neighbour and takes one from its
// left, so each rank only ever sends to one peer and receives from one. On links that bind, that
// fixed pairing is what keeps every link full: sending to all at once (or to each peer in turn)
// has several senders meet on one receiver's link while another's idles (docs/DECISIONS.md, "Rings across hosts").
// Every receive is posted first and the left neighbour hears it once (an empty message); the
// sends then need no announcement answered (isendPosted), a round trip that on a full link queues
// behind the data, once per step. Blocks travel in segments, passed on as soon as they are in.
#include <cstring>

#include "Flat.hpp"

namespace myccl::cpu::flat {

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

void ringAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  c.algo = "tcp-ring";
  if (outs[c.rank] != in && nbytes[c.rank] > 0) std::memcpy(outs[c.rank], in, nbytes[c.rank]);
  ringAllgather(c, outs, nbytes, kStepData);
}

// In step s each rank sends the partial of slice me - s - 1 to the next rank and folds the partial
// of slice me - s - 2 it gets from the previous one with its own input; after n - 1 steps it holds
// the whole sum of slice me in `out`. Each step's receive lands in a scratch region of its own, so
// the left neighbour never waits for this one. Partials travel in the element type.
void ringReduceScatter(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  c.algo = "tcp-ring";
  const int n = c.size, me = c.rank;
  const size_t esize = dtypeSize(spec.dtype);
  if (n == 1) {
    reduceInto(spec, out, &ins[0], 1, counts[0]);
    return;
  }
  const int right = (me + 1) % n, left = (me - 1 + n) % n;
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

// The ring reduce-scatter, then the ring all-gather of the reduced slices.
void ringAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  const int n = c.size;
  const size_t esize = dtypeSize(spec.dtype);
  std::vector<size_t> offs, cnts, bytes;
  partition(count, n, offs, cnts);
  std::vector<void*> slices;
  sliceViews(static_cast<char*>(buf), offs, cnts, esize, slices, bytes);
  ringReduceScatter(c, slices.data(), slices[c.rank], cnts.data(), spec);
  ringAllgather(c, slices.data(), bytes.data(), kStepGather);
  c.algo = "tcp-ring";
}

}  // namespace myccl::cpu::flat
