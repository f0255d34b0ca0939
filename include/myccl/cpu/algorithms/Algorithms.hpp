// Collective algorithms written against the Transport interface: pure logic over raw
// buffers, one function per collective. They take every temporary buffer from the engine's
// Scratch (never from the heap per call): after a failure the engine closes the transport
// before any such memory is reused, so a late message can never land in freed memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "myccl/cpu/Reduce.hpp"
#include "myccl/cpu/algorithms/LinkModel.hpp"
#include "myccl/cpu/algorithms/Tags.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl {
struct Topology;
}

namespace myccl::cpu {

class ShmGroup;
class Parallel;

// Engine-owned memory, cached across ops (fresh allocations per call cost up to half the
// bandwidth of large collectives). A slot keeps its pointer until the next get() of that slot.
class Scratch {
 public:
  ~Scratch();
  void* get(int slot, size_t nbytes);
  void release();

 private:
  struct Buf {
    void* ptr = nullptr;
    size_t size = 0;
  };
  std::vector<Buf> bufs_;
};

// Everything an algorithm may use: the peers, the op's private tag space, its deadline.
// A context may stand for a subset of the group (the leaders of each host, the ranks of one
// host): `rank`/`size` and peer indices are then positions in `members`.
struct CollCtx {
  Transport& tp;
  int rank;
  int size;
  uint64_t tagBase;  // unique per op (Tags.hpp); step s of the op uses tag(s)
  Deadline deadline;
  Scratch& scratch;
  size_t chunkBytes;  // segment size for pipelined large messages
  ShmGroup* shm = nullptr;  // this host's ranks of the group, when they share memory
  const Topology* topo = nullptr;        // the whole group's hosts (hierarchical algorithms)
  const std::vector<int>* members = nullptr;  // position -> group rank; null: the whole group
  bool hierarchical = true;                   // two-level algorithms across hosts (MYCCL_HIERARCHICAL, LinkModel)
  LevelChoice* levels = nullptr;              // the group's choice, which sets `hierarchical` (Select.cpp)
  // Whether this context's ranks are on several hosts: its messages cross network links, where
  // a fixed pairing of senders and receivers is what keeps every link full (Flat.cpp, ring).
  bool crossHost = false;
  bool crossHostRing = true;  // MYCCL_CROSS_HOST_RING: large all-gathers there may use the ring
  // Floating-point sums fold in rank order, the same bits whatever the algorithm (MYCCL_ORDERED_SUMS);
  // false lets large ones across hosts go around the ring, which folds each slice from another rank.
  bool orderedSums = true;
  // Two-level sums of float16/bfloat16 carry their partials across hosts in float32 (one rounding,
  // twice the bytes) rather than in their own type (MYCCL_FLOAT32_PARTIALS).
  bool float32Partials = false;
  Parallel* par = nullptr;                    // helper threads (MYCCL_NUM_THREADS > 1)
  size_t streamMinBytes = SIZE_MAX;           // results this large: streaming stores (copyOut)
  const char* algo = "none";  // set by the algorithm that ran (stats, traces)
  size_t bytes = 0;           // payload of the op as this rank sees it (stats, traces)

  uint32_t agreement = 0;     // what all ranks must agree on (dtype, reduce op, count), hashed

  uint64_t tag(uint32_t step) const { return tagBase | step; }
  int groupRank(int idx) const { return members ? (*members)[idx] : idx; }
  RequestPtr isend(int peer, uint64_t t, const void* data, size_t n) {
    return tp.isend(groupRank(peer), t, data, n, agreement);
  }
  RequestPtr isendPosted(int peer, uint64_t t, const void* data, size_t n) {
    return tp.isendPosted(groupRank(peer), t, data, n, agreement);
  }
  RequestPtr irecv(int peer, uint64_t t, void* data, size_t n) {
    return tp.irecv(groupRank(peer), t, data, n, agreement);
  }
  // The same op restricted to `m` (group ranks, containing this rank), over the transport.
  // crossHost then says whether `m` spans hosts.
  CollCtx sub(const std::vector<int>& m, int myIdx) const;
};

// Copies and reductions of large buffers, split across the group's helper threads if any.
// `stream`: write with streaming stores (streamCopy), for large results in the caller's memory.
void parallelCopy(CollCtx& c, void* dst, const void* src, size_t nbytes, bool stream = false);
void parallelReduce(CollCtx& c, const ReduceSpec& spec, void* out, const void* const* ins, int n, size_t count);

// Split `count` elements into `parts` nearly equal slices (the first count % parts one larger);
// slice r = [offsets[r], +counts[r]).
void partition(size_t count, int parts, std::vector<size_t>& offsets, std::vector<size_t>& counts);

// The agreement word of a reduction: equal on every rank that runs the same reduction.
uint32_t agreementWord(const ReduceSpec& spec, size_t count);

// What a shared-memory step's agreement word (StepDesc::arg, set by the shared-memory
// algorithms) says about the op, for hang reports: "all_reduce #12 on 1024 x float32 SUM".
std::string describeStep(uint64_t tagBase, uint64_t arg);

// The collectives. Each picks the algorithm for the group and size (Select.cpp, the only place
// that chooses): shared memory when all ranks share a host, two levels or flat exchanges over the
// message transport otherwise.

// In place: buf (count elements) becomes the reduction over all ranks.
void allreduce(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec);
// buf on root is sent to everyone.
void broadcast(CollCtx& c, void* buf, size_t nbytes, int root);
// Root's `out` receives the reduction of every rank's `in` (`in` is never modified).
void reduce(CollCtx& c, const void* in, void* out, size_t count, const ReduceSpec& spec, int root);
// outs[r] receives rank r's contribution of nbytes[r] bytes; `in` is this rank's.
void allgatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes);
// On root outs[r] receives rank r's `in`.
void gatherv(CollCtx& c, const void* in, void* const* outs, const size_t* nbytes, int root);
// On root ins[r] is sent to rank r's `out`.
void scatterv(CollCtx& c, const void* const* ins, void* out, const size_t* nbytes, int root);
// ins[r] (counts[r] elements) is this rank's contribution to rank r's result in `out`.
void reduceScatterv(CollCtx& c, const void* const* ins, void* out, const size_t* counts, const ReduceSpec& spec);
// sends[r] (sendBytes[r]) goes to rank r; recvs[r] (recvBytes[r]) comes from rank r.
void alltoallv(CollCtx& c, const void* const* sends, const size_t* sendBytes, void* const* recvs,
               const size_t* recvBytes);
void barrier(CollCtx& c);

// Horovod's agreed all_reduce (cpu/extensions/AgreedAllreduce.hpp): buf is reduced only if
// every rank offers the same nonzero `key` with the same count and reduction (key 0: no offer);
// returns whether it was, the same on every rank. It needs the group on one host in shared
// memory (agreedApplies); elsewhere it moves nothing and returns false.
bool agreedApplies(const Topology& t, bool sharedMemory);
bool allreduceAgreed(CollCtx& c, void* buf, size_t count, const ReduceSpec& spec, uint64_t key);

// Whether the group spans several hosts and some host holds several of its ranks: two levels
// (shared memory inside hosts, TCP between them) or flat TCP is then a choice (LevelChoice).
bool twoLevelsApply(const CollCtx& c);

}  // namespace myccl::cpu
