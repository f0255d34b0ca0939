// The entry points Algorithms.hpp declares: each picks the family of algorithms for the group
// (shared memory when every rank shares this host, two levels when the group spans hosts and
// some host holds several ranks, flat algorithms over the transport otherwise) and runs it.
#include "Flat.hpp"
#include "Hierarchical.hpp"
#include "ShmAlgorithms.hpp"
#include "myccl/cpu/Reduce.hpp"

namespace myccl::cpu {

namespace {

// Which family runs an op: shared memory when every rank shares this host, two levels when
// the group spans hosts and some host holds several ranks, flat over TCP otherwise.
enum class Family { Single, Shm, Hier, Flat };

Family family(const CollCtx& c, bool hierarchicalVersion) {
  if (c.size == 1) return Family::Single;
  if (!c.crossHost) return c.shm ? Family::Shm : Family::Flat;
  return hierarchicalVersion && c.hierarchical && hier::applies(c) ? Family::Hier : Family::Flat;
}

}  // namespace

bool twoLevelsApply(const CollCtx& c) {
  return hier::applies(c);
}

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
    case Family::Flat: return flat::allreduce(c, buf, count, spec);
  }
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  switch (family(c, true)) {
    case Family::Single: return;
    case Family::Shm: return shmalg::broadcast(c, *c.shm, buf, nbytes, root);
    case Family::Hier: return hier::broadcast(c, buf, nbytes, root);
    case Family::Flat: return flat::broadcast(c, buf, nbytes, root);
  }
}

void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::reduce(c, *c.shm, in, out, count, spec, root);
    default: return flat::reduce(c, in, out, count, spec, root);
  }
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  switch (family(c, true)) {
    case Family::Shm: return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, false, 0);
    case Family::Hier: return hier::allgatherv(c, in, outs, nbytes);
    default: return flat::allgatherv(c, in, outs, nbytes);
  }
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::allgatherv(c, *c.shm, in, outs, nbytes, true, root);
    default: return flat::gatherv(c, in, outs, nbytes, root);
  }
}

void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::scatterv(c, *c.shm, ins, out, nbytes, root);
    default: return flat::scatterv(c, ins, out, nbytes, root);
  }
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  switch (family(c, true)) {
    case Family::Shm: return shmalg::reduceScatterv(c, *c.shm, ins, out, counts, spec);
    case Family::Hier: return hier::reduceScatterv(c, ins, out, counts, spec);
    default: return flat::reduceScatterv(c, ins, out, counts, spec);
  }
}

void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::alltoallv(c, *c.shm, sends, sendBytes, recvs, recvBytes);
    default: return flat::alltoallv(c, sends, sendBytes, recvs, recvBytes);
  }
}

void barrier(CollCtx& c) {
  switch (family(c, true)) {
    case Family::Single: return;
    case Family::Shm: return shmalg::barrier(c, *c.shm);
    case Family::Hier: return hier::barrier(c);
    case Family::Flat: return flat::barrier(c);
  }
}

}  // namespace myccl::cpu
