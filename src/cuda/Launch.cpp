// Launch's three phases (Launch.hpp): the stream's staging work, the NCCL calls inside one
// group with the reduction operators made for them, the copies back.
#include "Launch.hpp"

namespace myccl::cuda {

void checkNccl(Nccl& nccl, NcclResult r, const char* call, const Described& where, NcclCommHandle comm) {
  if (r == NcclResult::Success || r == NcclResult::InProgress) return;
  auto kind = (r == NcclResult::RemoteError || r == NcclResult::SystemError) ? CommErrorKind::PeerGone
                                                                              : CommErrorKind::Local;
  throw CommError(kind, where + ": " + call + " failed: " + ncclErrorText(nccl, r, comm));
}

at::Tensor Launch::buffer(const at::Tensor& user, at::ScalarType type, bool copyIn, bool copyBack) {
  if (user.is_contiguous() && user.scalar_type() == type) return user;
  at::Tensor buf = scratch(user.sizes(), type);
  if (copyIn) stage([buf, user]() mutable { buf.copy_(user); });
  if (copyBack) after([user, buf]() mutable { user.copy_(buf); });
  return buf;
}

int Launch::redOp(const NcclReduce& plan) {
  for (size_t i = 0; i < ops_.size(); ++i) {
    const auto& s = ops_[i].plan;
    if (s.type == plan.type && s.op == plan.op && s.premul == plan.premul && s.factor == plan.factor &&
        s.factorTensor.is_same(plan.factorTensor)) {
      return static_cast<int>(i);
    }
  }
  OpSlot s{plan, {}, kNcclSum};
  if (plan.premul && plan.factorTensor.defined()) {
    s.scalar = scratch({1}, scalarTypeOf(plan.type));
    stage([scalar = s.scalar, f = plan.factorTensor]() mutable { scalar.copy_(f.reshape({1})); });
  }
  ops_.push_back(std::move(s));
  return static_cast<int>(ops_.size() - 1);
}

void Launch::issue(Clock::time_point deadline, const Described& where) {
  if (!stages_.empty()) {
    dev_.enqueue(stream_, [fs = std::move(stages_)]() {
      for (const auto& f : fs) f();
    });
    stages_.clear();
  }
  if (calls_.empty()) return;  // e.g. a group of one rank gathering: only local copies
  NcclComm& comm = *slot_.comm;
  Nccl& api = comm.nccl();
  auto lk = comm.lock(where);
  const NcclCommHandle handle = comm.get();
  c10::SmallVector<NcclRedOp, 2> created;
  for (auto& s : ops_) {
    s.op = s.plan.op;
    if (!s.plan.premul) continue;
    alignas(8) unsigned char host[8] = {};
    NcclResult r;
    if (s.scalar.defined()) {
      r = api.redOpCreatePreMulSum(&s.op, s.scalar.data_ptr(), s.plan.type, ScalarResidence::Device, handle);
    } else {
      premulScalar(s.plan.type, s.plan.factor, host);
      r = api.redOpCreatePreMulSum(&s.op, host, s.plan.type, ScalarResidence::HostImmediate, handle);
    }
    checkNccl(api, r, "ncclRedOpCreatePreMulSum", where, handle);
    created.push_back(s.op);
  }
  checkNccl(api, api.groupStart(), "ncclGroupStart", where, handle);
  try {
    for (const auto& c : calls_) {
      // Aborted from another thread while this one was stuck inside NCCL: the handle is gone.
      if (comm.aborted()) throw CommError(CommErrorKind::Aborted, where + ": the NCCL communicator was aborted");
      checkNccl(api, make(api, c, handle), "an NCCL call", where, handle);
    }
  } catch (...) {
    (void)api.groupEnd();  // keep this thread's group depth right; the group is failed next
    throw;
  }
  NcclResult r = api.groupEnd();
  checkNccl(api, r, "ncclGroupEnd", where, handle);
  comm.settle(lk, r, deadline, where);
  // "An operator may be destroyed as soon as the last NCCL function given it returns": that is
  // the group end.
  for (auto op : created) (void)api.redOpDestroy(op, handle);
  calls_.clear();
  held_.clear();  // the staging buffers: stream order keeps them safe from here on
}

void Launch::finish() {
  if (afters_.empty()) return;
  dev_.enqueue(stream_, [fs = std::move(afters_)]() {
    for (const auto& f : fs) f();
  });
  afters_.clear();
}

NcclResult Launch::make(Nccl& api, const NcclCall& c, NcclCommHandle h) const {
  const NcclRedOp op = c.opSlot >= 0 ? ops_[static_cast<size_t>(c.opSlot)].op : kNcclSum;
  switch (c.kind) {
    case NcclCall::AllReduce:
      return api.allReduce(c.send, c.recv, c.count, c.type, op, h, stream_);
    case NcclCall::Broadcast:
      return api.broadcast(c.send, c.recv, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
    case NcclCall::Reduce:
      return api.reduce(c.send, c.recv, c.count, c.type, op, slot_.peerIndex(c.peer), h, stream_);
    case NcclCall::AllGather:
      return api.allGather(c.send, c.recv, c.count, c.type, h, stream_);
    case NcclCall::ReduceScatter:
      return api.reduceScatter(c.send, c.recv, c.count, c.type, op, h, stream_);
    case NcclCall::Send:
      return api.send(c.send, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
    case NcclCall::Recv:
      return api.recv(c.recv, c.count, c.type, slot_.peerIndex(c.peer), h, stream_);
  }
  return NcclResult::InvalidArgument;
}

}  // namespace myccl::cuda
