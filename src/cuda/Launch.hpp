// One enqueue on the CUDA engine (private to src/cuda): the communicator it runs on with its
// stream (CommSlot), and Launch, which an op or a coalesced batch describes itself into: staging
// copies on the stream, the NCCL calls inside one group, copies back after it. Everything
// device- or NCCL-specific goes through the Runtime seam (Runtime.hpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "myccl/Errors.hpp"
#include "myccl/OpInfo.hpp"
#include "myccl/cuda/NcclComm.hpp"
#include "myccl/cuda/NcclTypes.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

// A tensor's bytes (numel x element size, whatever its strides).
inline size_t nbytesOf(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// Do [p, p+n) and [q, q+m) share a byte?
inline bool overlaps(const void* p, size_t n, const void* q, size_t m) {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return n != 0 && m != 0 && a < b + m && b < a + n;
}

// True when ts[r] is the r-th block of `each` bytes of one contiguous buffer starting at ts[0].
inline bool consecutiveBlocks(const std::vector<at::Tensor>& ts, size_t each) {
  if (ts.empty() || each == 0) return false;
  auto* base = static_cast<const char*>(ts[0].data_ptr());
  for (size_t r = 0; r < ts.size(); ++r) {
    if (!ts[r].is_contiguous() || nbytesOf(ts[r]) != each) return false;
    if (static_cast<const char*>(ts[r].data_ptr()) != base + r * each) return false;
  }
  return true;
}

// Throws CommError for a failed NCCL call (InProgress is not a failure: settle() waits for it).
void checkNccl(Nccl& nccl, NcclResult r, const char* call, const Described& where, NcclCommHandle comm);

// A communicator with the stream its asynchronous ops run on.
struct CommSlot {
  std::string key;  // "group0", "p2p0-1"
  std::shared_ptr<NcclComm> comm;
  Stream stream{Stream::DEFAULT, c10::Device(c10::kCPU)};  // set when made
  std::unique_ptr<Event> ready;  // caller's stream -> this stream; reusable, block() copies its state
  int device = 0;
  int lowRank = -1;  // two-rank communicators: the group rank that is rank 0 in it (-1: the group's)

  // The rank `groupRank` has in this communicator.
  int peerIndex(int groupRank) const { return lowRank < 0 ? groupRank : (groupRank == lowRank ? 0 : 1); }
};

// One NCCL call of a launch, by value: what Launch::issue passes to NCCL inside the group.
// Ranks are group ranks (translated to the communicator's at the call).
struct NcclCall {
  enum Kind : uint8_t { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, Send, Recv } kind;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  NcclType type = NcclType::Uint8;
  int opSlot = -1;  // reductions: Launch::redOp's slot
  int peer = -1;    // root or peer
};

// One enqueue: an op, or a coalesced batch of ops, on one communicator and one stream. Ops
// describe themselves into it in three phases, so that no copy ever runs inside an open NCCL
// group (kernels launched there would run before the group's, not after). The common op (one
// contiguous tensor, one NCCL call) allocates nothing here: calls are plain records and the
// lists keep their first entries inline.
class Launch {
 public:
  Launch(Device& dev, CommSlot& slot, Stream stream) : dev_(dev), slot_(slot), stream_(stream) {}

  // ---- phase 1, on the stream before the NCCL calls: staging ----
  // Local work on the stream (copies between the caller's tensors and staging buffers).
  void stage(std::function<void()> f) { stages_.push_back(std::move(f)); }
  // A tensor of the given size and dtype for staging, allocated for this stream.
  at::Tensor scratch(at::IntArrayRef sizes, at::ScalarType type) { return dev_.empty(sizes, type, stream_); }
  // A contiguous tensor of dtype `type` standing in for `user`; `user` itself when it already
  // is one. copyIn: filled from `user` first; copyBack: copied into `user` after the NCCL calls.
  at::Tensor buffer(const at::Tensor& user, at::ScalarType type, bool copyIn, bool copyBack);
  // A reduction operator for the calls; PREMUL_SUM operators are created per launch (before the
  // group opens) and destroyed once it is closed. A tensor factor is copied on the stream into a
  // device scalar that NCCL reads when the op runs: no host synchronisation. Returns a slot for op().
  int redOp(const NcclReduce& plan);
  // ---- phase 2, inside one group, under the communicator lock ----
  // Counts are in elements of `type` (bytes for the byte-wise ones). The tensors are held until
  // the group has ended (stream order keeps staging buffers safe after that).
  void allReduce(const at::Tensor& buf, size_t count, NcclType type, int opSlot) {
    call({NcclCall::AllReduce, buf.data_ptr(), buf.data_ptr(), count, type, opSlot, -1}, buf);
  }
  void broadcast(const at::Tensor& from, const at::Tensor& to, size_t bytes, int root) {
    call({NcclCall::Broadcast, from.data_ptr(), to.data_ptr(), bytes, NcclType::Uint8, -1, root}, from, to);
  }
  void reduce(const at::Tensor& from, const at::Tensor& to, size_t count, NcclType type, int opSlot, int root) {
    call({NcclCall::Reduce, from.data_ptr(), to.data_ptr(), count, type, opSlot, root}, from, to);
  }
  // `bytes` per rank, gathered into `to` at `dst`.
  void allGather(const at::Tensor& from, const at::Tensor& to, void* dst, size_t bytes) {
    call({NcclCall::AllGather, from.data_ptr(), dst, bytes, NcclType::Uint8, -1, -1}, from, to);
  }
  // `count` elements per rank, from `from` at `src`.
  void reduceScatter(const at::Tensor& from, const void* src, const at::Tensor& to, size_t count, NcclType type,
                     int opSlot) {
    call({NcclCall::ReduceScatter, src, to.data_ptr(), count, type, opSlot, -1}, from, to);
  }
  void send(const at::Tensor& from, size_t bytes, int peer) { send(from, from.data_ptr(), bytes, peer); }
  void recv(const at::Tensor& to, size_t bytes, int peer) { recv(to, to.data_ptr(), bytes, peer); }
  // From or into `at`, inside `owner` (which the call holds).
  void send(const at::Tensor& owner, const void* at, size_t bytes, int peer) {
    call({NcclCall::Send, at, nullptr, bytes, NcclType::Uint8, -1, peer}, owner);
  }
  void recv(const at::Tensor& owner, void* at, size_t bytes, int peer) {
    call({NcclCall::Recv, nullptr, at, bytes, NcclType::Uint8, -1, peer}, owner);
  }
  // ---- phase 3, after the group, on the stream ----
  void after(std::function<void()> f) { afters_.push_back(std::move(f)); }

  // Runner: phases 1 and 2. Throws CommError (the group must then be failed).
  void issue(Clock::time_point deadline, const Described& where);
  // Runner: phase 3.
  void finish();

 private:
  struct OpSlot {
    NcclReduce plan;
    at::Tensor scalar;  // device premul factor
    NcclRedOp op;
  };
  template <class... T>
  void call(const NcclCall& c, const T&... hold) {
    calls_.push_back(c);
    (held_.push_back(hold), ...);
  }
  NcclResult make(Nccl& api, const NcclCall& c, NcclCommHandle h) const;
  Device& dev_;
  CommSlot& slot_;
  Stream stream_;
  c10::SmallVector<std::function<void()>, 1> stages_;
  c10::SmallVector<NcclCall, 2> calls_;
  c10::SmallVector<at::Tensor, 4> held_;
  c10::SmallVector<std::function<void()>, 1> afters_;
  c10::SmallVector<OpSlot, 1> ops_;
};

}  // namespace myccl::cuda
