// MycclBackend's ops: argument checks and one routing line each. Everything that can be checked
// locally is checked here, on the caller's thread, before any peer is involved, so a bad call
// raises a ValueError naming the op, the rank and the value, and never leaves peers half-way in
// an op. The engines do the rest (Engine.hpp); the backend's other parts are listed in its header.
#include "myccl/backend/ProcessGroupMyccl.hpp"

#include <ATen/ATen.h>

#include "myccl/Arguments.hpp"
#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/TorchCompat.hpp"
#include "myccl/cpu/Engine.hpp"

namespace myccl {

using c10d::OpType;
using WorkRef = c10::intrusive_ptr<c10d::Work>;

// ---- collectives ---------------------------------------------------------------------------

WorkRef MycclBackend::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("broadcast");
  const at::Tensor& t = single(w, tensors);
  auto e = engines_.route(w, tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  checkWritable(w, t, "tensor");
  auto i = info(OpType::BROADCAST, "broadcast", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, nullptr);
  return record(e->broadcast(std::move(i), t, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_reduce");
  MYCCL_CHECK_ARG(tensors.size() == 1, w, ": expected exactly one tensor, got ", tensors.size());
  if (tensors[0].defined() && tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  auto e = engines_.route(w, tensors);
  checkWritable(w, tensors[0], "tensor");
  auto red = toReduction(w, tensors[0], opts.reduceOp, size_, onDevice(tensors[0]));
  auto i = info(OpType::ALLREDUCE, "all_reduce", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e->allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::runExtension(cpu::ExtensionOp op, std::vector<at::Tensor> inputs,
                                   std::vector<at::Tensor> outputs) {
  const auto w = where(op.name);
  auto e = engines_.cpu(w);
  auto i = info(op.type, op.name, c10d::kUnsetTimeout, op.asyncOp);
  if (!inputs.empty()) annotate(i, inputs[0], -1, op.redop);
  return record(e->runExtension(std::move(i), std::move(inputs), std::move(outputs), std::move(op)));
}

WorkRef MycclBackend::allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const auto w = where("all_reduce");
  const at::Tensor& t = single(w, tensors);
  MYCCL_CHECK_ARG(t.is_sparse() && t.device().is_cpu(), w, ": sparse all_reduce needs a sparse COO CPU tensor, got ",
                  describe(t));
  MYCCL_CHECK_ARG(opts.reduceOp.op_ == c10d::ReduceOp::SUM, w, ": sparse tensors support only ReduceOp.SUM, got ",
                  reduceOpName(opts.reduceOp.op_));
  auto e = engines_.cpu(w);
  auto i = info(OpType::_ALLREDUCE_SPARSE, "all_reduce(sparse)", opts.timeout, opts.asyncOp);
  annotate(i, t, -1, "SUM");
  return record(e->allreduceSparse(std::move(i), t));
}

WorkRef MycclBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_reduce_coalesced");
  auto e = engines_.route(w, tensors);
  for (size_t k = 0; k < tensors.size(); ++k) {
    checkSameDtype(w, tensors[0], tensors[k], ("tensor " + std::to_string(k)).c_str());
    checkWritable(w, tensors[k], "tensor");
  }
  auto red = toReduction(w, tensors[0], opts.reduceOp, size_, onDevice(tensors[0]));
  auto i = info(OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, tensors[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e->allreduce(std::move(i), tensors, red));
}

WorkRef MycclBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce");
  const at::Tensor& t = single(w, tensors);
  auto e = engines_.route(w, tensors);
  checkRoot(w, opts.rootRank, size_);
  MYCCL_CHECK_ARG(opts.rootTensor == 0, w, ": rootTensor must be 0, got ", opts.rootTensor);
  if (rank_ == opts.rootRank) checkWritable(w, t, "tensor");
  auto red = toReduction(w, t, opts.reduceOp, size_, onDevice(t));
  auto i = info(OpType::REDUCE, "reduce", opts.timeout, opts.asyncOp);
  annotate(i, t, opts.rootRank, reduceOpName(opts.reduceOp.op_));
  return record(e->reduce(std::move(i), t, red, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather");
  const at::Tensor& in = single(w, inputs, "input tensor");
  MYCCL_CHECK_ARG(outputs.size() == 1, w, ": expected one output list, got ", outputs.size());
  auto& outs = outputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(outs.size()) == size_, w, ": the output list has ", outs.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = {in};
  all.insert(all.end(), outs.begin(), outs.end());
  auto e = engines_.route(w, all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, in, outs[r], ("output " + std::to_string(r)).c_str());
    checkWritable(w, outs[r], "output");
  }
  MYCCL_CHECK_ARG(outs[rank_].numel() == in.numel(), w, ": output ", rank_, " (this rank's block) has ",
                  outs[rank_].numel(), " elements but the input has ", in.numel());
  auto i = info(OpType::ALLGATHER, "all_gather", opts.timeout, opts.asyncOp);
  annotate(i, in, -1, nullptr);
  return record(e->allgather(std::move(i), {in}, {outs}));
}

WorkRef MycclBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_into_tensor");
  auto e = engines_.route(w, {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(output.numel() == input.numel() * size_, w, ": output ", shapeOf(output), " has ", output.numel(),
                  " elements but must have input numel ", input.numel(), " x group size ", size_, " = ",
                  input.numel() * size_);
  auto i = info(OpType::_ALLGATHER_BASE, "all_gather_into_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, nullptr);
  return record(e->allgatherBase(std::move(i), input, output));
}

WorkRef MycclBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                          std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_coalesced");
  MYCCL_CHECK_ARG(!inputs.empty(), w, ": expected at least one input tensor");
  MYCCL_CHECK_ARG(static_cast<int>(outputLists.size()) == size_, w, ": expected one output list per rank (", size_,
                  "), got ", outputLists.size());
  std::vector<at::Tensor> all = inputs;
  for (int r = 0; r < size_; ++r) {
    MYCCL_CHECK_ARG(outputLists[r].size() == inputs.size(), w, ": output list ", r, " has ", outputLists[r].size(),
                    " tensors but there are ", inputs.size(), " inputs");
    all.insert(all.end(), outputLists[r].begin(), outputLists[r].end());
  }
  auto e = engines_.route(w, all);
  // outputLists[r][k] receives rank r's inputs[k]: regroup per input.
  std::vector<std::vector<at::Tensor>> per(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    for (int r = 0; r < size_; ++r) {
      const auto& o = outputLists[r][k];
      checkSameDtype(w, inputs[k], o, "output");
      checkWritable(w, o, "output");
      per[k].push_back(o);
    }
    MYCCL_CHECK_ARG(per[k][rank_].numel() == inputs[k].numel(), w, ": output ", rank_, "/", k, " has ",
                    per[k][rank_].numel(), " elements but input ", k, " has ", inputs[k].numel());
  }
  auto i = info(OpType::ALLGATHER_COALESCED, "all_gather_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e->allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::AllgatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_gather_into_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto e = engines_.route(w, all);
  std::vector<std::vector<at::Tensor>> per;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkSameDtype(w, inputs[k], outputs[k], "output");
    checkWritable(w, outputs[k], "output");
    MYCCL_CHECK_ARG(outputs[k].numel() == inputs[k].numel() * size_, w, ": output ", k, " has ", outputs[k].numel(),
                    " elements but must have ", inputs[k].numel() * size_);
    per.push_back(blocks(w, outputs[k], size_, inputs[k].numel(), "output"));
  }
  auto i = info(compat::kAllgatherIntoTensorCoalesced, "all_gather_into_tensor_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e->allgather(std::move(i), inputs, per));
}

WorkRef MycclBackend::gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::GatherOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("gather");
  const at::Tensor& in = single(w, inputs, "input tensor");
  checkRoot(w, opts.rootRank, size_);
  auto outs = rootList(w, outputs, "output", "input", in, true, static_cast<int>(opts.rootRank), rank_, size_);
  std::vector<at::Tensor> all = {in};
  all.insert(all.end(), outs.begin(), outs.end());
  auto e = engines_.route(w, all);
  auto i = info(OpType::GATHER, "gather", opts.timeout, opts.asyncOp);
  annotate(i, in, opts.rootRank, nullptr);
  return record(e->gather(std::move(i), in, outs, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                              const c10d::ScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("scatter");
  const at::Tensor& out = single(w, outputs, "output tensor");
  checkRoot(w, opts.rootRank, size_);
  checkWritable(w, out, "output");
  auto ins = rootList(w, inputs, "input", "output", out, false, static_cast<int>(opts.rootRank), rank_, size_);
  std::vector<at::Tensor> all = {out};
  all.insert(all.end(), ins.begin(), ins.end());
  auto e = engines_.route(w, all);
  auto i = info(OpType::SCATTER, "scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, opts.rootRank, nullptr);
  return record(e->scatter(std::move(i), ins, out, static_cast<int>(opts.rootRank)));
}

WorkRef MycclBackend::reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                     const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter");
  const at::Tensor& out = single(w, outputs, "output tensor");
  MYCCL_CHECK_ARG(inputs.size() == 1, w, ": expected one input list, got ", inputs.size());
  auto& ins = inputs[0];
  MYCCL_CHECK_ARG(static_cast<int>(ins.size()) == size_, w, ": the input list has ", ins.size(),
                  " tensors but the group has ", size_, " ranks");
  std::vector<at::Tensor> all = {out};
  all.insert(all.end(), ins.begin(), ins.end());
  auto e = engines_.route(w, all);
  checkWritable(w, out, "output");
  for (int r = 0; r < size_; ++r) checkSameDtype(w, out, ins[r], "input");
  MYCCL_CHECK_ARG(ins[rank_].numel() == out.numel(), w, ": input ", rank_, " has ", ins[rank_].numel(),
                  " elements but the output has ", out.numel());
  auto red = toReduction(w, out, opts.reduceOp, size_, onDevice(out));
  auto i = info(OpType::REDUCE_SCATTER, "reduce_scatter", opts.timeout, opts.asyncOp);
  annotate(i, out, -1, reduceOpName(opts.reduceOp.op_));
  return record(e->reduceScatter(std::move(i), {ins}, {out}, red));
}

WorkRef MycclBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter_tensor");
  auto e = engines_.route(w, {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  MYCCL_CHECK_ARG(input.numel() == output.numel() * size_, w, ": input ", shapeOf(input), " has ", input.numel(),
                  " elements but must have output numel ", output.numel(), " x group size ", size_, " = ",
                  output.numel() * size_);
  auto red = toReduction(w, output, opts.reduceOp, size_, onDevice(output));
  auto i = info(OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, reduceOpName(opts.reduceOp.op_));
  return record(e->reduceScatterBase(std::move(i), input, output, red));
}

WorkRef MycclBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                      const c10d::ReduceScatterOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("reduce_scatter_tensor_coalesced");
  MYCCL_CHECK_ARG(outputs.size() == inputs.size() && !inputs.empty(), w, ": ", inputs.size(), " inputs but ",
                  outputs.size(), " outputs");
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto e = engines_.route(w, all);
  std::vector<std::vector<at::Tensor>> per;
  for (size_t k = 0; k < inputs.size(); ++k) {
    checkSameDtype(w, inputs[0], inputs[k], "input");
    checkSameDtype(w, inputs[k], outputs[k], "output");
    checkWritable(w, outputs[k], "output");
    MYCCL_CHECK_ARG(inputs[k].numel() == outputs[k].numel() * size_, w, ": input ", k, " has ", inputs[k].numel(),
                    " elements but must have ", outputs[k].numel() * size_);
    per.push_back(blocks(w, inputs[k], size_, outputs[k].numel(), "input"));
  }
  auto red = toReduction(w, outputs[0], opts.reduceOp, size_, onDevice(outputs[0]));
  auto i = info(compat::kReduceScatterTensorCoalesced, "reduce_scatter_tensor_coalesced", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, reduceOpName(opts.reduceOp.op_));
  return record(e->reduceScatter(std::move(i), per, outputs, red, inputs));
}

WorkRef MycclBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                                    std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_to_all_single");
  auto e = engines_.route(w, {input, output});
  checkSameDtype(w, input, output, "output");
  checkWritable(w, output, "output");
  // Rows per rank, checked (no views: the engine addresses the flat tensors or makes its own).
  auto splitsFor = [&](const at::Tensor& t, const std::vector<int64_t>& given, const char* what) {
    if (t.dim() == 0) {
      MYCCL_CHECK_ARG(false, w, ": ", what, " must have at least one dimension");
    }
    const int64_t rows = t.size(0);
    std::vector<int64_t> splits;
    if (given.empty()) {
      MYCCL_CHECK_ARG(rows % size_ == 0, w, ": ", what, " has ", rows, " rows, not divisible by the group size ",
                      size_, "; pass split sizes for uneven exchanges");
      splits.assign(size_, rows / size_);
    } else {
      splits = given;
    }
    MYCCL_CHECK_ARG(static_cast<int>(splits.size()) == size_, w, ": ", what, " split sizes have ", splits.size(),
                    " entries but the group has ", size_, " ranks");
    int64_t sum = 0;
    for (size_t r = 0; r < splits.size(); ++r) {
      MYCCL_CHECK_ARG(splits[r] >= 0, w, ": ", what, " split size for rank ", r, " is negative (", splits[r], ")");
      sum += splits[r];
    }
    MYCCL_CHECK_ARG(sum == rows, w, ": ", what, " split sizes sum to ", sum, " but the tensor has ", rows,
                    " rows (first dimension)");
    return splits;
  };
  auto inRows = splitsFor(input, inputSplits, "input");
  auto outRows = splitsFor(output, outputSplits, "output");
  auto perRow = [](const at::Tensor& t) { return t.size(0) > 0 ? t.numel() / t.size(0) : 0; };
  const int64_t toSelf = inRows[rank_] * perRow(input), fromSelf = outRows[rank_] * perRow(output);
  MYCCL_CHECK_ARG(toSelf == fromSelf, w, ": this rank sends ", toSelf, " elements to itself but expects ", fromSelf);
  auto i = info(OpType::ALLTOALL_BASE, "all_to_all_single", opts.timeout, opts.asyncOp);
  annotate(i, input, -1, nullptr);
  return record(e->alltoallBase(std::move(i), input, output, std::move(inRows), std::move(outRows)));
}

WorkRef MycclBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                               const c10d::AllToAllOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("all_to_all");
  MYCCL_CHECK_ARG(static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_, w,
                  ": expected ", size_, " input and output tensors, got ", inputs.size(), " and ", outputs.size());
  std::vector<at::Tensor> all = inputs;
  all.insert(all.end(), outputs.begin(), outputs.end());
  auto e = engines_.route(w, all);
  for (int r = 0; r < size_; ++r) {
    checkSameDtype(w, inputs[0], inputs[r], "input");
    checkSameDtype(w, inputs[0], outputs[r], "output");
    checkWritable(w, outputs[r], "output");
  }
  MYCCL_CHECK_ARG(inputs[rank_].numel() == outputs[rank_].numel(), w, ": this rank sends ", inputs[rank_].numel(),
                  " elements to itself but expects ", outputs[rank_].numel());
  auto i = info(OpType::ALLTOALL, "all_to_all", opts.timeout, opts.asyncOp);
  annotate(i, inputs[0], -1, nullptr);
  return record(e->alltoall(std::move(i), inputs, outputs));
}

WorkRef MycclBackend::barrier(const c10d::BarrierOptions& opts) {
  CoalescingGuard coalescing(this);
  const auto w = where("barrier");
  const auto device = engines_.barrierDevice(w, opts, getBoundDeviceId());
  // On a device the barrier also orders the device's streams: every rank's kernel must meet.
  if (device.has_value()) {
    auto e = engines_.cuda(w);
    return record(e->barrier(info(OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp), *device));
  }
  auto e = engines_.cpu(w);
  return record(e->barrier(info(OpType::BARRIER, "barrier", opts.timeout, opts.asyncOp), at::kCPU));
}

void MycclBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  const auto w = where("monitored_barrier");
  // gloo's semantics: zero is a valid timeout (rank 0 then reports at once that it timed out).
  const bool unset = opts.timeout == c10d::kUnsetTimeout;
  MYCCL_CHECK_ARG(unset || opts.timeout.count() >= 0, w, ": timeout must not be negative, got ", opts.timeout.count(),
                  " ms");
  auto e = engines_.cpu(w);
  auto i = info(OpType::BARRIER, "monitored_barrier", c10d::kUnsetTimeout, false, true);
  if (!unset) i.timeout = opts.timeout;
  e->monitoredBarrier(i, ++monitoredSeq_, waitAllRanks);
}

// ---- point-to-point ------------------------------------------------------------------------

WorkRef MycclBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("send");
  const at::Tensor& t = single(w, tensors);
  auto e = engines_.route(w, tensors);
  checkPeer(w, dstRank, rank_, size_, onDevice(t));
  auto i = info(OpType::SEND, "send", c10d::kUnsetTimeout, true, true);
  annotate(i, t, dstRank, nullptr);
  i.op = "send to " + std::to_string(dstRank) + " tag " + std::to_string(tag);
  return record(e->send(std::move(i), t, dstRank, tag));
}

WorkRef MycclBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("recv");
  const at::Tensor& t = single(w, tensors);
  auto e = engines_.route(w, tensors);
  checkPeer(w, srcRank, rank_, size_, onDevice(t));
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECV, "recv", c10d::kUnsetTimeout, true, true);
  annotate(i, t, srcRank, nullptr);
  i.op = "recv from " + std::to_string(srcRank) + " tag " + std::to_string(tag);
  return record(e->recv(std::move(i), t, srcRank, tag));
}

WorkRef MycclBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  CoalescingGuard coalescing(this);
  const auto w = where("recv_any_source");
  const at::Tensor& t = single(w, tensors);
  auto e = engines_.route(w, tensors);
  MYCCL_CHECK_ARG(!onDevice(t), w, ": receive-from-any-source is supported for CPU tensors only (NCCL has no wildcard receive)");
  MYCCL_CHECK_ARG(size_ > 1, w, ": a group of one rank has nobody to receive from");
  checkWritable(w, t, "tensor");
  auto i = info(OpType::RECVANYSOURCE, "recv_any_source", c10d::kUnsetTimeout, true, true);
  annotate(i, t, -1, nullptr);
  i.op = "recv from any tag " + std::to_string(tag);
  return record(engines_.cpu(w)->recvAny(std::move(i), t, tag));
}

}  // namespace myccl
