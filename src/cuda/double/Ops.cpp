// The double's NCCL calls that issue work: groups (per thread, launched at the outermost end),
// PreMulSum operators, and the ops, each checked as NCCL checks it, then recorded into the open
// group or launched at once, numbered in launch order.
#include <algorithm>
#include <cstring>

#include "NcclApi.hpp"

namespace myccl::cuda::testdouble {

GroupState& groupOf(Machine& m) {
  thread_local std::map<uint64_t, GroupState> groups;
  return groups[m.serial];
}

NcclResult DoubleNccl::groupStart() {
  m_->requireDevice("ncclGroupStart");
  ++groupOf(*m_).depth;
  return NcclResult::Success;
}

NcclResult DoubleNccl::groupEnd() {
  m_->requireDevice("ncclGroupEnd");
  GroupState& g = groupOf(*m_);
  if (g.depth == 0) {
    return report(NcclResult::InvalidUsage,
                  "ncclGroupEnd without ncclGroupStart on thread " + std::to_string(threadNumber()));
  }
  if (--g.depth > 0) return NcclResult::Success;
  std::vector<Pending> ops;
  ops.swap(g.ops);
  const NcclResult error = g.error;
  g.error = NcclResult::Success;
  NcclResult r = error;
  if (error == NcclResult::Success) {
    r = launch(ops);
  } else {
    m_->count("groups_failed");
  }
  const uint64_t me = threadNumber();
  for (auto& c : g.held) {
    uint64_t mine = me;
    c->user.compare_exchange_strong(mine, 0);
  }
  g.held.clear();
  return r;
}

NcclResult DoubleNccl::redOpCreatePreMulSum(NcclRedOp* op, void* scalar, NcclType type, ScalarResidence residence,
                                            NcclCommHandle comm) {
  const char* call = "ncclRedOpCreatePreMulSum";
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  Use use(*m_, c, call);
  if (op == nullptr || scalar == nullptr) {
    return report(NcclResult::InvalidArgument, std::string(call) + ": null op or scalar");
  }
  if (!validType(type)) {
    return report(NcclResult::InvalidArgument,
                  std::string(call) + ": invalid data type " + std::to_string(static_cast<int>(type)));
  }
  Premul p;
  p.type = type;
  p.residence = residence;
  if (residence == ScalarResidence::HostImmediate) {
    std::memcpy(p.value.data(), scalar, typeBytes(type));  // read now: the caller may reuse it
    m_->count("premul_host");
  } else {
    p.ptr = scalar;  // read by each op when it runs
    m_->count("premul_device");
  }
  std::lock_guard<std::mutex> lk(c->mu);
  *op = c->nextRedOp++;
  c->redOps[*op] = p;
  return NcclResult::Success;
}

NcclResult DoubleNccl::redOpDestroy(NcclRedOp op, NcclCommHandle comm) {
  const char* call = "ncclRedOpDestroy";
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  Use use(*m_, c, call);
  std::lock_guard<std::mutex> lk(c->mu);
  if (c->redOps.erase(op) == 0) {
    return report(NcclResult::InvalidArgument, std::string(call) + ": " + std::to_string(op) +
                                                   " is no PreMulSum operator of communicator " + c->name);
  }
  return NcclResult::Success;
}

NcclResult DoubleNccl::allReduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op,
                                 NcclCommHandle comm, const Stream& stream) {
  return call("ncclAllReduce", comm, makeOp(OpKind::AllReduce, sendbuff, recvbuff, count, type, op, -1, stream));
}

NcclResult DoubleNccl::broadcast(const void* sendbuff, void* recvbuff, size_t count, NcclType type, int root,
                                 NcclCommHandle comm, const Stream& stream) {
  return call("ncclBroadcast", comm,
              makeOp(OpKind::Broadcast, sendbuff, recvbuff, count, type, kNcclSum, root, stream));
}

NcclResult DoubleNccl::reduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op, int root,
                              NcclCommHandle comm, const Stream& stream) {
  return call("ncclReduce", comm, makeOp(OpKind::Reduce, sendbuff, recvbuff, count, type, op, root, stream));
}

NcclResult DoubleNccl::allGather(const void* sendbuff, void* recvbuff, size_t sendcount, NcclType type,
                                 NcclCommHandle comm, const Stream& stream) {
  return call("ncclAllGather", comm,
              makeOp(OpKind::AllGather, sendbuff, recvbuff, sendcount, type, kNcclSum, -1, stream));
}

NcclResult DoubleNccl::reduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, NcclType type,
                                     NcclRedOp op, NcclCommHandle comm, const Stream& stream) {
  return call("ncclReduceScatter", comm,
              makeOp(OpKind::ReduceScatter, sendbuff, recvbuff, recvcount, type, op, -1, stream));
}

NcclResult DoubleNccl::send(const void* sendbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                            const Stream& stream) {
  return call("ncclSend", comm, makeOp(OpKind::Send, sendbuff, nullptr, count, type, kNcclSum, peer, stream));
}

NcclResult DoubleNccl::recv(void* recvbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                            const Stream& stream) {
  return call("ncclRecv", comm, makeOp(OpKind::Recv, nullptr, recvbuff, count, type, kNcclSum, peer, stream));
}

Op DoubleNccl::makeOp(OpKind kind, const void* send, void* recv, size_t count, NcclType type, NcclRedOp op, int peer,
                      const Stream& stream) {
  Op o;
  o.kind = kind;
  o.send = send;
  o.recv = recv;
  o.count = count;
  o.type = type;
  o.op = op;
  o.peer = peer;
  o.stream = stream;
  return o;
}

// Argument checks NCCL makes at the call (ncclInvalidArgument); empty when fine. Resolves a
// PreMulSum operator into the op.
std::string DoubleNccl::invalid(Comm& c, Op& op) {
  if (!validType(op.type)) return "invalid data type " + std::to_string(static_cast<int>(op.type));
  const bool reduces = op.kind == OpKind::AllReduce || op.kind == OpKind::Reduce || op.kind == OpKind::ReduceScatter;
  std::lock_guard<std::mutex> lk(c.mu);
  if (reduces && (op.op < kNcclSum || op.op > kNcclAvg)) {
    auto it = c.redOps.find(op.op);
    if (it == c.redOps.end()) return "invalid reduction operator " + std::to_string(op.op);
    if (it->second.type != op.type) {
      return std::string("PreMulSum operator made for ") + typeName(it->second.type) + " used with " +
             typeName(op.type);
    }
    op.premul = it->second;
    op.op = kNcclSum;
  }
  // Seen with NCCL 2.28 on an H100: a one-rank communicator refuses ncclAvg of float8
  // (ncclInvalidArgument, no message); two ranks do it.
  if (reduces && op.op == kNcclAvg && c.nranks == 1 &&
      (op.type == NcclType::Float8e4m3 || op.type == NcclType::Float8e5m2)) {
    return std::string("ncclAvg of ") + typeName(op.type) + " on a one-rank communicator";
  }
  const bool rooted = op.kind == OpKind::Broadcast || op.kind == OpKind::Reduce;
  const bool p2p = op.kind == OpKind::Send || op.kind == OpKind::Recv;
  if ((rooted || p2p) && (op.peer < 0 || op.peer >= c.nranks)) {
    return std::string(rooted ? "root " : "peer ") + std::to_string(op.peer) + " is out of range for " +
           std::to_string(c.nranks) + " ranks";
  }
  if (op.count == 0) return "";
  const bool root = op.peer == c.rank;
  const bool needSend = op.kind != OpKind::Recv && (op.kind != OpKind::Broadcast || root);
  const bool needRecv = op.kind != OpKind::Send && (op.kind != OpKind::Reduce || root);
  if (needSend && op.send == nullptr) return "null send buffer";
  if (needRecv && op.recv == nullptr) return "null receive buffer";
  return "";
}

// Every op: checks, then recorded into the open group or launched as a group of one.
NcclResult DoubleNccl::call(const char* name, NcclCommHandle comm, Op op) {
  m_->requireDevice(name);
  GroupState& g = groupOf(*m_);
  auto fail = [&](NcclResult r) {
    if (g.depth > 0 && g.error == NcclResult::Success) g.error = r;
    return r;
  };
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, name, &r);
  if (!c) return fail(r);
  Use use(*m_, c, name);
  if ((r = usable(*c, name)) != NcclResult::Success) return fail(r);
  const std::string bad = invalid(*c, op);
  if (!bad.empty()) return fail(report(NcclResult::InvalidArgument, std::string(name) + " on " + c->name + ": " + bad));
  if (!m_->worker(op.stream)) {
    return fail(report(NcclResult::UnhandledCudaError, std::string(name) + " on " + c->name + ": " +
                                                           streamName(op.stream) + " is no stream of this machine"));
  }
  if (op.stream.device_index() != c->device) {
    return fail(report(NcclResult::UnhandledCudaError,
                       std::string(name) + " on " + c->name + " (a communicator of cuda:" + std::to_string(c->device) +
                           ") given " + streamName(op.stream) + ", a stream of another device"));
  }
  if (op.count == 0) return NcclResult::Success;  // NCCL returns at once: nothing to match
  if (g.depth > 0) {
    g.ops.push_back(Pending{c, op});
    use.keep(g);
    return NcclResult::Success;
  }
  std::vector<Pending> one{Pending{c, op}};
  return launch(one);
}

// Launches a group's ops: per communicator one stream item, in the communicator's launch
// order; the ops are numbered here, as every rank must launch them in the same order.
NcclResult DoubleNccl::launch(std::vector<Pending>& ops) {
  std::vector<std::shared_ptr<Comm>> comms;
  std::map<Comm*, std::vector<Op>> byComm;
  for (auto& p : ops) {
    auto& list = byComm[p.comm.get()];
    if (list.empty()) comms.push_back(p.comm);
    list.push_back(p.op);
  }
  NcclResult result = NcclResult::Success;
  for (auto& c : comms) {
    if (c->aborted || c->destroyed) {
      result = NcclResult::InvalidUsage;  // aborted while its ops waited in the group
      continue;
    }
    auto l = std::make_shared<Launch>();
    l->comm = c;
    l->ops = std::move(byComm[c.get()]);
    l->stream = l->ops.front().stream;
    for (const auto& op : l->ops) {
      if (op.stream != l->stream && std::find(l->joined.begin(), l->joined.end(), op.stream) == l->joined.end()) {
        l->joined.push_back(op.stream);
      }
    }
    bool busy = false;
    {
      std::lock_guard<std::mutex> lk(c->mu);
      for (auto& op : l->ops) {
        if (op.kind == OpKind::Send) {
          op.seq = c->sends[op.peer]++;
        } else if (op.kind == OpKind::Recv) {
          op.seq = c->recvs[op.peer]++;
        } else {
          op.seq = c->collectives++;
        }
      }
      l->order = c->launched++;
      // A nonblocking communicator's launch may be in progress when the call returns: always
      // the first, then one in four, for a random while; the caller must poll.
      if (!c->blocking && (l->order == 0 || m_->random(3) == 0)) {
        c->busy = true;
        c->busyUntil = Clock::now() + std::chrono::microseconds(m_->random(2000));
        busy = true;
      }
    }
    enqueueLaunch(*m_, l);
    if (busy && result == NcclResult::Success) result = NcclResult::InProgress;
    m_->count("launched_ops", static_cast<int64_t>(l->ops.size()));
  }
  m_->count("group_launches");
  return result;
}

}  // namespace myccl::cuda::testdouble
