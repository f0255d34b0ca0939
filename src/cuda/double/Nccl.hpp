// The double's communicators (private to src/cuda/double): what a communicator knows, one
// recorded NCCL op, and one launch (a group's ops on one communicator, run as one stream item).
// Comm.cpp owns the API side (creation, groups, checks); Collectives.cpp runs launches.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <array>
#include <optional>

#include "Machine.hpp"

namespace myccl::cuda::testdouble {

enum class OpKind { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, Send, Recv };

// A PreMulSum operator's factor: the bytes copied at creation (HostImmediate), or the address
// read when the op runs (Device).
struct Premul {
  NcclType type = NcclType::Float32;
  ScalarResidence residence = ScalarResidence::HostImmediate;
  std::array<unsigned char, 8> value{};
  const void* ptr = nullptr;
};

struct Op {
  OpKind kind = OpKind::AllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;  // elements; per rank for allGather's send and reduceScatter's receive
  NcclType type = NcclType::Float32;
  NcclRedOp op = kNcclSum;  // a PreMulSum operator is recorded as sum + premul
  std::optional<Premul> premul;
  int peer = -1;  // root of rooted collectives, peer of send/recv
  Stream stream{Stream::DEFAULT, c10::Device(c10::kCUDA, 0)};
  uint64_t seq = 0;  // launch number: of the comm's collectives, or of its sends/receives to/from peer
};

struct Comm {
  Machine* machine = nullptr;
  std::string name;  // for messages: config.name or derived from the id
  std::string key;   // the communicator's key space in the store
  c10::intrusive_ptr<c10d::Store> store;
  int device = 0;
  bool blocking = true;

  std::mutex settleMu;  // one thread at a time advances creation (it talks to the store)
  std::mutex mu;        // guards everything below but the atomics
  std::condition_variable cv;
  int nranks = 0;
  int rank = -1;
  // Creation not settled yet (ranks still joining, or a split's colors still arriving).
  bool joining = false;
  Clock::time_point joinStart;
  bool joinHangReported = false;
  // A split child: the parent's ranks publish "color key" under splitBase/<parent rank>.
  bool split = false;
  std::string splitBase;
  int parentRanks = 0;
  int parentRank = -1;
  int color = 0;
  std::string parentName;
  NcclResult error = NcclResult::Success;  // sticky
  bool busy = false;                       // a nonblocking launch reports InProgress until polled
  Clock::time_point busyUntil;
  bool finalized = false;
  std::string lastError;
  uint64_t launched = 0;   // launches (stream items) so far
  uint64_t finished = 0;   // ... of which have run (or were skipped)
  uint64_t orderDone = 0;  // launches run in launch order, across streams
  int active = 0;          // items running now
  uint64_t collectives = 0;
  std::map<int, uint64_t> sends, recvs;  // per peer
  uint64_t splits = 0;
  std::map<NcclRedOp, Premul> redOps;
  NcclRedOp nextRedOp = 5;  // after NCCL's built-in operators

  std::atomic<bool> aborted{false};
  std::atomic<bool> destroyed{false};
  std::atomic<uint64_t> user{0};  // thread inside a call on it (or holding it in an open group)
  std::atomic<bool> overlapReported{false};

  // Records the first error; later calls and launches see it.
  void fail(NcclResult r, const std::string& why);
  bool stopped() const { return aborted.load() || machine->stopping.load(); }
};

// A group's ops on one communicator, run as one stream item in the comm's launch order.
struct Launch {
  std::shared_ptr<Comm> comm;
  uint64_t order = 0;
  std::vector<Op> ops;
  Stream stream{Stream::DEFAULT, c10::Device(c10::kCUDA, 0)};  // where the item runs
  std::vector<Stream> joined;  // other streams of the group's ops: they wait for the item
  uint64_t ticket = 0;          // its place on its device, where device order is on (Machine)
};

// Collectives.cpp: queues the launch on its streams.
void enqueueLaunch(Machine& m, const std::shared_ptr<Launch>& launch);

// Reduce.cpp: element types and reductions.
bool validType(NcclType t);
size_t typeBytes(NcclType t);
const char* typeName(NcclType t);
const char* kindName(OpKind k);
// "all_reduce 100 x float32 sum", "broadcast 4 x uint8 root 1": what ranks must agree on.
std::string describe(const Op& op);
// Multiplies `n` elements at `data` by the premul factor, in the element type.
void applyPremul(void* data, size_t n, const Premul& p);
// Reduces `parts` (rank order, `n` elements each) with a built-in operator into `out`.
void reduceParts(const std::vector<const unsigned char*>& parts, size_t n, NcclType type, NcclRedOp op, void* out);

}  // namespace myccl::cuda::testdouble
