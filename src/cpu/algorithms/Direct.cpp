// Direct exchanges: in each phase every rank sends to every rank that needs its bytes (or to and
// from the root) at once. A reduction is a direct reduce-scatter, each rank folding its own slice
// from all ranks' contributions in rank order in one pass, then a direct all-gather: the result is
// bit-identical on every rank and rounded once for low-precision types. Large messages are cut in
// segments and double-buffered (FlatCommon.cpp).
#include <cstring>

#include "Flat.hpp"

namespace myccl::cpu::flat {

void oneRoundAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  c.algo = "tcp-direct-one-round";
  const int n = c.size;
  const size_t nbytes = count * dtypeSize(spec.dtype);
  char* all = static_cast<char*>(c.scratch.get(1, nbytes * n));
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepData), all + q * nbytes, nbytes));
  }
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.isend(q, c.tag(kStepData), buf, nbytes));
  }
  waitAll(reqs, c.deadline);
  std::vector<const void*> ins(n);
  for (int q = 0; q < n; ++q) ins[q] = (q == c.rank) ? buf : all + q * nbytes;
  reduceInto(spec, buf, ins.data(), n, count);
}

void directAllreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec, bool ringGather) {
  c.algo = "tcp-direct-reduce-scatter-all-gather";
  const int n = c.size;
  const size_t esize = dtypeSize(spec.dtype);
  std::vector<size_t> offs, cnts;
  partition(count, n, offs, cnts);
  char* base = static_cast<char*>(buf);
  const size_t seg = segmentElems(c, esize);
  // Reduce-scatter: slice q of my buffer goes to q; I reduce my slice in place.
  std::vector<RequestPtr> sends;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, base + offs[q] * esize, cnts[q], esize, seg);
  }
  char* mine = base + offs[c.rank] * esize;
  reduceSliceFromPeers(c, mine, mine, cnts[c.rank], spec, kStepData);
  waitAll(sends, c.deadline);  // my copies of other slices may now be overwritten
  // All-gather the reduced slices.
  if (ringGather) {
    c.algo = "tcp-direct-reduce-scatter-ring-all-gather";
    std::vector<void*> outs;
    std::vector<size_t> bytes;
    sliceViews(base, offs, cnts, esize, outs, bytes);
    return ringAllgather(c, outs.data(), bytes.data(), kStepGather);
  }
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepGather), base + offs[q] * esize, cnts[q] * esize));
  }
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.isend(q, c.tag(kStepGather), mine, cnts[c.rank] * esize));
  }
  waitAll(reqs, c.deadline);
}

void directBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < c.size; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), buf, nbytes));
  } else {
    reqs.push_back(c.irecv(root, c.tag(kStepData), buf, nbytes));
  }
  waitAll(reqs, c.deadline);
}

void scatterAllgatherBroadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-direct";
  const int n = c.size;
  // The root sends the message once instead of n - 1 times.
  std::vector<size_t> offs, cnts;
  partition(nbytes, n, offs, cnts);
  char* base = static_cast<char*>(buf);
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < n; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), base + offs[q], cnts[q]));
  } else {
    reqs.push_back(c.irecv(root, c.tag(kStepData), base + offs[c.rank], cnts[c.rank]));
  }
  waitAll(reqs, c.deadline);
  reqs.clear();
  // Everyone forwards the slice it holds to every rank that lacks it (the root lacks none).
  if (c.rank == root) {
    for (int q = 0; q < n; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepGather), base + offs[root], cnts[root]));
  } else {
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      reqs.push_back(c.irecv(q, c.tag(kStepGather), base + offs[q], cnts[q]));
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepGather), base + offs[c.rank], cnts[c.rank]));
    }
  }
  waitAll(reqs, c.deadline);
}

void gatherReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.algo = "tcp-direct";
  const int n = c.size;
  const size_t nbytes = count * dtypeSize(spec.dtype);
  std::vector<RequestPtr> reqs;
  if (c.rank != root) {
    reqs.push_back(c.isend(root, c.tag(kStepData), in, nbytes));
    waitAll(reqs, c.deadline);
    return;
  }
  char* all = static_cast<char*>(c.scratch.get(1, nbytes * n));
  for (int q = 0; q < n; ++q)
    if (q != root) reqs.push_back(c.irecv(q, c.tag(kStepData), all + q * nbytes, nbytes));
  waitAll(reqs, c.deadline);
  std::vector<const void*> ins(n);
  for (int q = 0; q < n; ++q) ins[q] = (q == root) ? in : all + q * nbytes;
  reduceInto(spec, out, ins.data(), n, count);
}

void directReduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.algo = "tcp-direct";
  const int n = c.size;
  const size_t esize = dtypeSize(spec.dtype);
  // Direct reduce-scatter into scratch (inputs stay untouched), then gather slices at root.
  std::vector<size_t> offs, cnts;
  partition(count, n, offs, cnts);
  const char* src = static_cast<const char*>(in);
  const size_t seg = segmentElems(c, esize);
  std::vector<RequestPtr> sends;
  for (int q = 0; q < n; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, src + offs[q] * esize, cnts[q], esize, seg);
  }
  char* mine = (c.rank == root) ? static_cast<char*>(out) + offs[c.rank] * esize
                                : static_cast<char*>(c.scratch.get(2, cnts[c.rank] * esize));
  // On root `out` may be `in`: its slices still being sent must not change, so the root
  // reduces its own slice into scratch first when they alias.
  const bool alias = (c.rank == root) && (out == in);
  char* dst = alias ? static_cast<char*>(c.scratch.get(2, cnts[c.rank] * esize)) : mine;
  reduceSliceFromPeers(c, src + offs[c.rank] * esize, dst, cnts[c.rank], spec, kStepData);
  waitAll(sends, c.deadline);
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    if (alias) std::memcpy(mine, dst, cnts[c.rank] * esize);
    for (int q = 0; q < n; ++q)
      if (q != root)
        reqs.push_back(c.irecv(q, c.tag(kStepRoot), static_cast<char*>(out) + offs[q] * esize, cnts[q] * esize));
  } else {
    reqs.push_back(c.isend(root, c.tag(kStepRoot), dst, cnts[c.rank] * esize));
  }
  waitAll(reqs, c.deadline);
}

void directAllgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepData), outs[q], nbytes[q]));
  }
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.isend(q, c.tag(kStepData), in, nbytes[c.rank]));
  }
  if (outs[c.rank] != in && nbytes[c.rank] > 0) std::memcpy(outs[c.rank], in, nbytes[c.rank]);
  waitAll(reqs, c.deadline);
}

void directGatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < c.size; ++q)
      if (q != root) reqs.push_back(c.irecv(q, c.tag(kStepData), outs[q], nbytes[q]));
    if (outs[root] != in && nbytes[root] > 0) std::memcpy(outs[root], in, nbytes[root]);
  } else {
    reqs.push_back(c.isend(root, c.tag(kStepData), in, nbytes[c.rank]));
  }
  waitAll(reqs, c.deadline);
}

void directScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  c.algo = "tcp-direct";
  std::vector<RequestPtr> reqs;
  if (c.rank == root) {
    for (int q = 0; q < c.size; ++q)
      if (q != root) reqs.push_back(c.isend(q, c.tag(kStepData), ins[q], nbytes[q]));
    if (ins[root] != out && nbytes[root] > 0) std::memcpy(out, ins[root], nbytes[root]);
  } else {
    reqs.push_back(c.irecv(root, c.tag(kStepData), out, nbytes[c.rank]));
  }
  waitAll(reqs, c.deadline);
}

void directReduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts,
                          const ReduceSpec& spec) {
  c.algo = "tcp-direct";
  const size_t esize = dtypeSize(spec.dtype);
  const size_t seg = segmentElems(c, esize);
  std::vector<RequestPtr> sends;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    sendSegmented(c, sends, q, kStepData, static_cast<const char*>(ins[q]), counts[q], esize, seg);
  }
  if (c.size == 1) {
    reduceInto(spec, out, &ins[0], 1, counts[0]);
  } else {
    reduceSliceFromPeers(c, ins[c.rank], out, counts[c.rank], spec, kStepData);
  }
  waitAll(sends, c.deadline);
}

void pairwiseAlltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
                       const size_t* recvBytes) {
  c.algo = "tcp-pairwise";
  std::vector<RequestPtr> reqs;
  for (int q = 0; q < c.size; ++q) {
    if (q == c.rank) continue;
    reqs.push_back(c.irecv(q, c.tag(kStepData), recvs[q], recvBytes[q]));
  }
  for (int k = 1; k < c.size; ++k) {
    int q = (c.rank + k) % c.size;  // staggered so ranks do not all hit rank 0 first
    reqs.push_back(c.isend(q, c.tag(kStepData), sends[q], sendBytes[q]));
  }
  if (sendBytes[c.rank] != recvBytes[c.rank]) {
    throw CommError(CommErrorKind::Local, "all_to_all: this rank sends " + std::to_string(sendBytes[c.rank]) +
                                              " bytes to itself but expects " + std::to_string(recvBytes[c.rank]));
  }
  if (recvs[c.rank] != sends[c.rank] && recvBytes[c.rank] > 0)
    std::memmove(recvs[c.rank], sends[c.rank], recvBytes[c.rank]);
  waitAll(reqs, c.deadline);
}

}  // namespace myccl::cpu::flat
