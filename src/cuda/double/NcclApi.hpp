// The double's Nccl (private to src/cuda/double): the class, and what its calls share: the
// calling thread's group and the hold a call keeps on a communicator. Comm.cpp defines the
// communicators' lifecycle and state, Ops.cpp groups, reduction operators and the ops.
#pragma once

#include <functional>

#include "Nccl.hpp"

namespace myccl::cuda::testdouble {

// Every communicator made on a machine, destroyed ones included: a handle used after destroy
// must still be recognised.
struct NcclState {
  std::mutex mu;
  std::map<const void*, std::shared_ptr<Comm>> comms;
  std::string lastError;
};

struct Pending {
  std::shared_ptr<Comm> comm;
  Op op;
};

// The calling thread's NCCL group on one machine (ncclGroupStart/End nest per thread).
struct GroupState {
  int depth = 0;
  std::vector<Pending> ops;
  std::vector<std::shared_ptr<Comm>> held;  // comms this thread holds until the group ends
  NcclResult error = NcclResult::Success;   // an op of the group failed: the group fails
};

GroupState& groupOf(Machine& m);

// Holds a communicator for the length of one call (or, for an op in an open group, until the
// group ends): NCCL communicators are not thread-safe, and a group belongs to one thread.
class Use {
 public:
  Use(Machine& m, const std::shared_ptr<Comm>& c, const char* call);
  ~Use();
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;

  // The op joined an open group: the thread holds the comm until the outermost groupEnd.
  void keep(GroupState& g);

 private:
  std::shared_ptr<Comm> c_;
  bool owned_ = false;
};

// NCCL's API over a store: communicators move data through `store_`, share the machine's
// streams, allocator and violation log.
class DoubleNccl final : public Nccl {
 public:
  DoubleNccl(std::shared_ptr<Machine> m, c10::intrusive_ptr<c10d::Store> store)
      : m_(std::move(m)), store_(std::move(store)), st_(m_->nccl()) {}

  // Comm.cpp
  int version() override { return kDoubleNcclVersion; }
  NcclResult getUniqueId(NcclUniqueId* id) override;
  NcclResult commInitRank(NcclCommHandle* comm, int nranks, const NcclUniqueId& id, int rank,
                          const NcclCommConfig& config) override;
  NcclResult commSplit(NcclCommHandle comm, int color, int key, NcclCommHandle* newcomm,
                       const NcclCommConfig& config) override;
  NcclResult commGetAsyncError(NcclCommHandle comm, NcclResult* asyncError) override;
  NcclResult commCount(NcclCommHandle comm, int* count) override;
  NcclResult commFinalize(NcclCommHandle comm) override;
  NcclResult commDestroy(NcclCommHandle comm) override;
  NcclResult commAbort(NcclCommHandle comm) override;
  const char* errorString(NcclResult r) override;
  const char* lastError(NcclCommHandle comm) override;

  // Ops.cpp
  NcclResult groupStart() override;
  NcclResult groupEnd() override;
  NcclResult redOpCreatePreMulSum(NcclRedOp* op, void* scalar, NcclType type, ScalarResidence residence,
                                  NcclCommHandle comm) override;
  NcclResult redOpDestroy(NcclRedOp op, NcclCommHandle comm) override;
  NcclResult allReduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op,
                       NcclCommHandle comm, const Stream& stream) override;
  NcclResult broadcast(const void* sendbuff, void* recvbuff, size_t count, NcclType type, int root, NcclCommHandle comm,
                       const Stream& stream) override;
  NcclResult reduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op, int root,
                    NcclCommHandle comm, const Stream& stream) override;
  NcclResult allGather(const void* sendbuff, void* recvbuff, size_t sendcount, NcclType type, NcclCommHandle comm,
                       const Stream& stream) override;
  NcclResult reduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, NcclType type, NcclRedOp op,
                           NcclCommHandle comm, const Stream& stream) override;
  NcclResult send(const void* sendbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                  const Stream& stream) override;
  NcclResult recv(void* recvbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                  const Stream& stream) override;

 private:
  // Comm.cpp
  static std::vector<uint8_t> bytesOf(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
  static std::string pointer(const void* p);
  NcclResult setError(NcclResult r, const std::string& why, Comm* c = nullptr);
  // A misuse: a violation, and NCCL's result code with the text for lastError.
  NcclResult report(NcclResult r, const std::string& why);
  std::shared_ptr<Comm> makeComm(const std::string& key, const std::string& name,
                                 const c10::intrusive_ptr<c10d::Store>& store, bool blocking);
  NcclCommHandle add(const std::shared_ptr<Comm>& c);
  std::shared_ptr<Comm> find(NcclCommHandle h);
  // The communicator behind `h` for `call`, or null with *r set: a null or unknown handle, or
  // one used after abort or destroy (NCCL has freed it), is a violation.
  std::shared_ptr<Comm> enter(NcclCommHandle h, const char* call, NcclResult* r);
  // Whether `call` may use the communicator now: not while a nonblocking call on it is in
  // progress, not after finalize; a communicator in error returns its error.
  NcclResult usable(Comm& c, const char* call);
  // ncclCommGetAsyncError: creation still settling, an in-progress launch or finalize, or the error.
  NcclResult state(Comm& c);
  NcclResult waitSettled(Comm& c);
  // Advances creation: all ranks joined (init), or all parent ranks' colors known (split).
  NcclResult settle(Comm& c);
  NcclResult settleInit(Comm& c);
  NcclResult settleSplit(Comm& c);
  NcclResult settled(Comm& c, const std::string& misuse);
  void reportJoinHang(Comm& c, const std::string& what, int ranks, const std::function<std::string(int)>& keyOf);
  // Blocks until every launch of `c` has run (finalize, or destroy's implicit finalize).
  void waitFinished(Comm& c, const char* call);

  // Ops.cpp
  static Op makeOp(OpKind kind, const void* send, void* recv, size_t count, NcclType type, NcclRedOp op, int peer,
                   const Stream& stream);
  // Argument checks NCCL makes at the call (ncclInvalidArgument); empty when fine. Resolves a
  // PreMulSum operator into the op.
  std::string invalid(Comm& c, Op& op);
  // Every op: checks, then recorded into the open group or launched as a group of one.
  NcclResult call(const char* name, NcclCommHandle comm, Op op);
  // Launches a group's ops: per communicator one stream item, in the communicator's launch
  // order; the ops are numbered here, as every rank must launch them in the same order.
  NcclResult launch(std::vector<Pending>& ops);

  std::shared_ptr<Machine> m_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<NcclState> st_;
};

}  // namespace myccl::cuda::testdouble
