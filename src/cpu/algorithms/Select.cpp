// The one place that chooses how a CPU collective runs. The entry points of Algorithms.hpp pick
// the family (one host's shared memory, two levels across hosts, or flat over the transport);
// each family's own entry points, defined here too, pick among its algorithms by size, rank count
// and type; and LevelChoice decides, once per group, between two levels and flat TCP. The
// families' files hold the algorithms and never choose. Every threshold is here, with why.
#include <sstream>

#include "Flat.hpp"
#include "Hierarchical.hpp"
#include "LinkProbe.hpp"
#include "ShmAlgorithms.hpp"
#include "myccl/Log.hpp"
#include "myccl/Topology.hpp"
#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/Stats.hpp"

namespace myccl::cpu {

namespace {

// ---- thresholds ------------------------------------------------------------------------------

// Flat reductions below this many bytes gather whole buffers instead of slicing them.
constexpr size_t kSmallReduceBytes = 32 * 1024;
// From this many ranks, small exchanges take log2(n) rounds (each rank sends ~log2(n) messages)
// instead of one round in which each rank sends n - 1: per-message cost, not bytes, decides there.
constexpr int kLogRoundsMinRanks = 4;
// Flat all-gathers up to this many bytes in total use Bruck's rounds (every block moves log2(n) times).
constexpr size_t kSmallGatherBytes = 64 * 1024;
// Exact-type all_reduces from kSmallReduceBytes up to this use recursive halving-doubling; the ring
// takes over above (n - 1 steps of 1/n of the data beat log2(n) steps once the bytes dominate).
constexpr size_t kRhdMaxBytes = 1u << 20;
// Broadcasts below this on 4+ ranks go down a binomial tree; larger ones are cut in slices.
constexpr size_t kTreeMaxBytes = 256 * 1024;
// Broadcasts and reduces at least this large across hosts go down a pipelined chain.
constexpr size_t kChainMinBytes = 1u << 20;
// All-gathers (and order-free sums) across hosts from this many bytes per rank go around a ring.
constexpr size_t kRingGatherMinBytes = 256 * 1024;
// Shared memory: small reductions go in one step; below this every rank reading everything is
// cheaper than a second synchronisation.
constexpr size_t kOneStepReduceBytes = 64 * 1024;
// Shared memory: ops at least this large first check whether every rank's buffer lives in
// registered shared memory (zero copy); below it the check costs more than the copies it saves.
constexpr size_t kZeroCopyMinBytes = 256 * 1024;
// Two levels: from this size all_reduce, reduce_scatter and all_gather are striped across each
// host's ranks (below it the extra local step costs more than the narrower cross-host messages save).
constexpr size_t kStripeMinBytes = 256 * 1024;
// Two levels: from this size a broadcast across hosts is pipelined in chunks.
constexpr size_t kPipelineMinBytes = 1024 * 1024;

// ---- the family ------------------------------------------------------------------------------

enum class Family { Single, Shm, Hier, Flat };

// Shared memory when every rank shares this host, two levels when the group spans hosts, some
// host holds several ranks and the group chose two levels (LevelChoice, asked here), flat over
// TCP otherwise.
Family family(CollCtx& c, bool hierarchicalVersion) {
  if (c.size == 1) return Family::Single;
  if (!c.crossHost) return c.shm ? Family::Shm : Family::Flat;
  if (!hierarchicalVersion) return Family::Flat;
  if (c.levels) c.levels->choose(c);
  return c.hierarchical && hier::applies(c) ? Family::Hier : Family::Flat;
}

// Whether a large reduction may go around a ring, which folds each slice starting at a different
// rank: only where the order cannot change the result (integers and bool), or for floating-point
// types when the user gave up rank-order sums (MYCCL_ORDERED_SUMS=0).
bool exactType(DType dt) {
  return !isFloating(dt) && !isComplex(dt);
}

bool orderFree(const CollCtx& c, const ReduceSpec& spec) {
  return exactType(spec.dtype) || !c.orderedSums;
}

// Whether a large op goes around a ring: across hosts (where a fixed pairing of senders and
// receivers keeps every link full), at least 3 ranks, `perRank` bytes or more from each (the same
// on every rank), unless MYCCL_CROSS_HOST_RING=0.
bool ringAcrossHosts(const CollCtx& c, size_t perRank) {
  return c.crossHostRing && c.crossHost && c.size >= 3 && perRank >= kRingGatherMinBytes;
}

// Whether a broadcast or reduce goes down the chain: large, at least 3 ranks, several hosts.
bool chained(const CollCtx& c, size_t nbytes) {
  return c.size >= 3 && nbytes >= kChainMinBytes && c.topo && !c.topo->singleHost();
}

size_t sum(const size_t* v, int n) {
  size_t s = 0;
  for (int q = 0; q < n; ++q) s += v[q];
  return s;
}

// Where a scaled sum's factor cannot ride on the sum: `buf` scaled by it now, and the plain sum
// left to do (the same bits: scaling each input first is what the scaled sum stands for).
ReduceSpec scaledFirst(void* buf, size_t count, const ReduceSpec& spec) {
  scaleInPlace(spec.dtype, buf, count, spec.scale);
  ReduceSpec plain = spec;
  plain.scale = 0.0;
  return plain;
}

}  // namespace

// ---- the flat family -------------------------------------------------------------------------

namespace flat {

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  c.agreement = agreementWord(spec, count);
  c.algo = "tcp-direct-reduce-scatter-all-gather";
  const int n = c.size;
  if (n == 1) return;
  const size_t nbytes = count * dtypeSize(spec.dtype);
  const bool small = nbytes <= kSmallReduceBytes || count < static_cast<size_t>(n);
  if (small) return n >= kLogRoundsMinRanks ? bruckAllreduce(c, buf, count, spec) : oneRoundAllreduce(c, buf, count, spec);
  const bool exact = exactType(spec.dtype);
  if (orderFree(c, spec) && ringAcrossHosts(c, nbytes / n)) return ringAllreduce(c, buf, count, spec);
  if (n >= 4 && exact && nbytes > kRhdMaxBytes) return ringAllreduce(c, buf, count, spec);
  if (n >= kLogRoundsMinRanks && exact) return rhdAllreduce(c, buf, count, spec);
  directAllreduce(c, buf, count, spec, ringAcrossHosts(c, nbytes / n));
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  c.algo = "tcp-direct";
  const int n = c.size;
  if (n == 1) return;
  if (n >= 4 && nbytes < kTreeMaxBytes) return treeBroadcast(c, buf, nbytes, root);
  if (chained(c, nbytes)) return chainBroadcast(c, buf, nbytes, root);
  if (n <= 3 || nbytes < kTreeMaxBytes) return directBroadcast(c, buf, nbytes, root);
  scatterAllgatherBroadcast(c, buf, nbytes, root);
}

void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  c.agreement = agreementWord(spec, count);
  c.algo = "tcp-direct";
  const int n = c.size;
  const size_t nbytes = count * dtypeSize(spec.dtype);
  if (n == 1) {
    reduceInto(spec, out, &in, 1, count);
    return;
  }
  if (nbytes <= kSmallReduceBytes || count < static_cast<size_t>(n)) return gatherReduce(c, in, out, count, spec, root);
  // Partials travel in the element type down a chain: not for types where a fold per hop loses
  // what a single fold keeps (float16/bfloat16), nor for the DDP reducer's scaled sum.
  const bool lowPrecision = spec.dtype == DType::F16 || spec.dtype == DType::BF16;
  if (chained(c, nbytes) && spec.scale == 0.0 && !lowPrecision) return chainReduce(c, in, out, count, spec, root);
  directReduce(c, in, out, count, spec, root);
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  const size_t total = sum(nbytes, c.size);
  if (c.size >= kLogRoundsMinRanks && total <= kSmallGatherBytes) return bruckAllgatherv(c, in, outs, nbytes);
  if (ringAcrossHosts(c, total / c.size)) return ringAllgatherv(c, in, outs, nbytes);
  directAllgatherv(c, in, outs, nbytes);
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  directGatherv(c, in, outs, nbytes, root);
}

void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root) {
  directScatterv(c, ins, out, nbytes, root);
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  const size_t total = sum(counts, c.size);
  c.agreement = agreementWord(spec, total);
  if (orderFree(c, spec) && ringAcrossHosts(c, total * dtypeSize(spec.dtype) / c.size))
    return ringReduceScatter(c, ins, out, counts, spec);
  directReduceScatterv(c, ins, out, counts, spec);
}

void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes) {
  pairwiseAlltoallv(c, sends, sendBytes, recvs, recvBytes);
}

void barrier(CollCtx& c) {
  disseminationBarrier(c);
}

}  // namespace flat

// ---- the shared-memory family ----------------------------------------------------------------

namespace shmalg {

namespace {

bool oneStep(const ShmGroup& g, size_t count, size_t nbytes) {
  return nbytes <= std::min(kOneStepReduceBytes, g.stagingBytes()) || count < static_cast<size_t>(g.size());
}

}  // namespace

void allreduce(CollCtx& c, ShmGroup& g, void* buf, size_t count, const ReduceSpec& spec) {
  if (spec.scale != 0.0 && !sameScale(c, g, count, spec)) {
    // Ranks passed different factors: each scales its own input, and the sum is plain.
    return allreduce(c, g, buf, count, scaledFirst(buf, count, spec));
  }
  const size_t nbytes = count * dtypeSize(spec.dtype);
  if (oneStep(g, count, nbytes)) return allreduceOneStep(c, g, buf, count, spec);
  allreduceSliced(c, g, buf, count, spec, nbytes >= kZeroCopyMinBytes);
}

void broadcast(CollCtx& c, ShmGroup& g, void* buf, size_t nbytes, int root) {
  pipelinedBroadcast(c, g, buf, nbytes, root, nbytes >= kZeroCopyMinBytes);
}

void reduce(CollCtx& c, ShmGroup& g, const void* in, void* out, size_t count, const ReduceSpec& spec, int root) {
  if (oneStep(g, count, count * dtypeSize(spec.dtype))) return reduceOneStep(c, g, in, out, count, spec, root);
  reduceSliced(c, g, in, out, count, spec, root);
}

void allgatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes) {
  allgatherv(c, g, in, outs, nbytes, false, 0, sum(nbytes, g.size()) >= kZeroCopyMinBytes);
}

void gatherv(CollCtx& c, ShmGroup& g, const void* in, void* const* outs, const size_t* nbytes, int root) {
  allgatherv(c, g, in, outs, nbytes, true, root, false);
}

void reduceScatterv(CollCtx& c, ShmGroup& g, const void* const* ins, void* out, const size_t* counts,
                    const ReduceSpec& spec) {
  const size_t bytes = sum(counts, g.size()) * dtypeSize(spec.dtype);
  reduceScatterv(c, g, ins, out, counts, spec, bytes >= kZeroCopyMinBytes);
}

}  // namespace shmalg

// ---- the two-level family --------------------------------------------------------------------

namespace hier {

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  const size_t nl = c.topo->localSize;
  if (nl > 1 && count >= nl && count * dtypeSize(spec.dtype) >= kStripeMinBytes && canStripe(c))
    return stripedAllreduce(c, buf, count, spec);
  leaderAllreduce(c, buf, count, spec);
}

void broadcast(CollCtx& c, void* buf, size_t nbytes, int root) {
  if (nbytes >= kPipelineMinBytes) return pipelinedBroadcast(c, buf, nbytes, root);
  leaderBroadcast(c, buf, nbytes, root);
}

void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes) {
  if (sum(nbytes, c.topo->size) >= kStripeMinBytes && canStripe(c)) return stripedAllgatherv(c, in, outs, nbytes);
  leaderAllgatherv(c, in, outs, nbytes);
}

void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec) {
  if (widePartials(c, spec.dtype)) return widenedReduceScatterv(c, ins, out, counts, spec);
  if (sum(counts, c.topo->size) * dtypeSize(spec.dtype) >= kStripeMinBytes && canStripe(c))
    return stripedReduceScatterv(c, ins, out, counts, spec);
  leaderReduceScatterv(c, ins, out, counts, spec);
}

}  // namespace hier

// ---- the entry points of Algorithms.hpp ------------------------------------------------------

bool twoLevelsApply(const CollCtx& c) {
  return hier::applies(c);
}

void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec) {
  const Family f = family(c, true);
  if (spec.scale != 0.0 && f != Family::Shm) {
    // Only the shared-memory algorithms sum raw inputs in one pass; the others combine partial
    // sums, which must not be scaled again.
    return allreduce(c, buf, count, scaledFirst(buf, count, spec));
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
    case Family::Shm: return shmalg::allgatherv(c, *c.shm, in, outs, nbytes);
    case Family::Hier: return hier::allgatherv(c, in, outs, nbytes);
    default: return flat::allgatherv(c, in, outs, nbytes);
  }
}

void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root) {
  switch (family(c, false)) {
    case Family::Shm: return shmalg::gatherv(c, *c.shm, in, outs, nbytes, root);
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

bool agreedApplies(const Topology& t, bool sharedMemory) {
  return sharedMemory && t.crossSize == 1;
}

bool allreduceAgreed(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec, uint64_t key) {
  if (!c.topo || !agreedApplies(*c.topo, c.shm != nullptr)) return false;
  return shmalg::allreduceAgreed(c, *c.shm, buf, count, spec, key);
}

void barrier(CollCtx& c) {
  switch (family(c, true)) {
    case Family::Single: return;
    case Family::Shm: return shmalg::barrier(c, *c.shm);
    case Family::Hier: return hier::barrier(c);
    case Family::Flat: return flat::barrier(c);
  }
}

// ---- two levels or flat ----------------------------------------------------------------------

// The model, for an all_reduce of S bytes over H hosts of L ranks (reduce_scatter and all_gather
// are each half of it, the same ratios): two levels send 2S(H-1)/H across each host's link and
// cost every rank a local reduce-scatter and all-gather, taking in 2S(L-1)/L through shared
// memory; flat direct exchanges send L times the bytes across. So two levels win when
//   link < local * L * (H-1) / H.
LevelChoice::LevelChoice(int forced, double declaredLinkBytesPerS, std::shared_ptr<Stats> stats, std::string who)
    : forced_(forced), declaredLinkBytesPerS_(declaredLinkBytesPerS), stats_(std::move(stats)), who_(std::move(who)) {}

void LevelChoice::choose(CollCtx& c) {
  if (forced_ >= 0) {
    c.hierarchical = forced_ == 1;
    return;
  }
  // Measured at the group's first op that has a two-level version (family() asks only for those).
  // Every rank runs the same collectives in the same order, so every rank measures at the same
  // op; until then (ops with no two-level version: gather, scatter, all_to_all, reduce) two
  // levels stay the choice.
  if (!model_.measured && twoLevelsApply(c)) {
    LinkModel m = hier::measureLink(c, declaredLinkBytesPerS_);
    m.hierarchical = m.localBytesPerS <= 0 ||
                     m.linkBytesPerS < m.localBytesPerS * m.ranksPerHost * (m.hosts - 1) / m.hosts;
    {
      std::lock_guard<std::mutex> lk(mu_);
      model_ = m;
    }
    if (stats_) stats_->add("link_probe", m.hierarchical ? "hierarchical" : "flat", m.bytes, m.seconds);
    log(LogLevel::Info, who_ + ": " + describe());
  }
  c.hierarchical = model_.hierarchical;
}

LinkModel LevelChoice::model() const {
  std::lock_guard<std::mutex> lk(mu_);
  return model_;
}

std::string LevelChoice::describe() const {
  const LinkModel m = model();
  std::ostringstream os;
  os << "link " << m.linkBytesPerS / 1e6 << " MB/s per host (" << (m.declared ? "MYCCL_LINK_MBIT" : "measured")
     << "), shared memory " << m.localBytesPerS / 1e6 << " MB/s per rank, " << m.hosts << " hosts x "
     << m.ranksPerHost << " ranks: " << (m.hierarchical ? "two levels" : "flat TCP") << " (measuring took "
     << m.seconds * 1e3 << " ms)";
  return os.str();
}

}  // namespace myccl::cpu
