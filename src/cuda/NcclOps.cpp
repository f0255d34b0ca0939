// What each op launches on the CUDA engine: the NCCL calls of every collective and
// point-to-point op, with the staging copies that make non-contiguous or mismatched tensors
// contiguous, expressed against Launch (Launch.hpp). Local copies are staged on the op's
// stream too, never run on the host.
#include "EngineImpl.hpp"

namespace myccl::cuda {

// ---- collectives ---------------------------------------------------------------------------

NcclEngine::WorkPtr NcclEngine::broadcast(OpInfo info, at::Tensor t, int root) {
  const bool isRoot = info.rank == root;
  auto launch = [root, isRoot](Launch& L, const NcclWork& w) {
    const at::Tensor& t = w.outputs()[0];
    if (t.numel() == 0) return;
    at::Tensor buf = L.buffer(t, t.scalar_type(), /*copyIn=*/isRoot, /*copyBack=*/!isRoot);
    L.broadcast(buf, buf, nbytesOf(buf), root);
  };
  const auto dev = impl_->dev.deviceOf(t);
  return impl_->submit(std::move(info), dev, info.asyncOp, {t}, {t}, std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red) {
  const auto dev = impl_->dev.deviceOf(tensors.at(0));
  const NcclReduce plan = impl_->plan(red, info, dev);
  // A list is coalesced: one allreduce per tensor, all in one group.
  auto launch = [plan](Launch& L, const NcclWork& w) {
    for (const auto& t : w.outputs()) {
      if (t.numel() == 0) continue;
      at::Tensor buf = L.buffer(t, plan.stage, true, true);
      const int slot = L.redOp(plan);
      L.allReduce(buf, static_cast<size_t>(buf.numel() * plan.perElement), plan.type, slot);
    }
  };
  std::vector<at::Tensor> inputs(tensors);
  return impl_->submit(std::move(info), dev, info.asyncOp, std::move(inputs), std::move(tensors), std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::reduce(OpInfo info, at::Tensor t, const Reduction& red, int root) {
  const auto dev = impl_->dev.deviceOf(t);
  const NcclReduce plan = impl_->plan(red, info, dev);
  const bool isRoot = info.rank == root;
  auto launch = [plan, root, isRoot](Launch& L, const NcclWork& w) {
    const at::Tensor& t = w.outputs()[0];
    if (t.numel() == 0) return;
    // Only the root's buffer receives; the others' stay as they were.
    at::Tensor buf = L.buffer(t, plan.stage, true, /*copyBack=*/isRoot);
    const int slot = L.redOp(plan);
    L.reduce(buf, buf, static_cast<size_t>(buf.numel() * plan.perElement), plan.type, slot, root);
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, {t}, {t}, std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::allgather(OpInfo info, std::vector<at::Tensor> inputs,
                                          std::vector<std::vector<at::Tensor>> outputs) {
  std::vector<at::Tensor> flatOut;
  for (auto& list : outputs) flatOut.insert(flatOut.end(), list.begin(), list.end());
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(inputs.at(0));
  auto launch = [outputs = std::move(outputs), rank](Launch& L, const NcclWork& w) {
    const auto& inputs = w.inputs();
    for (size_t k = 0; k < inputs.size(); ++k) {
      const at::Tensor& in = inputs[k];
      const auto& outs = outputs[k];
      const size_t size = outs.size();
      const size_t each = nbytesOf(in);
      // Which algorithm depends only on the block sizes, which every rank agrees on; where the
      // bytes land (straight into the caller's buffer or through a scratch one) is local.
      bool even = true;
      for (const auto& o : outs) even = even && nbytesOf(o) == each;
      if (even) {
        if (each == 0) continue;
        const int64_t n = in.numel();
        const bool direct = consecutiveBlocks(outs, each);
        at::Tensor dst = direct ? outs[0] : L.scratch({static_cast<int64_t>(size) * n}, in.scalar_type());
        void* dstPtr = dst.data_ptr();
        at::Tensor src = L.buffer(in, in.scalar_type(), true, false);
        // In place (the input is this rank's block) is fine for NCCL; any other overlap is not.
        if (src.data_ptr() != static_cast<char*>(dstPtr) + rank * each &&
            overlaps(src.data_ptr(), each, dstPtr, size * each)) {
          at::Tensor copy = L.scratch(src.sizes(), src.scalar_type());
          L.stage([copy, src]() mutable { copy.copy_(src); });
          src = copy;
        }
        L.allGather(src, dst, dstPtr, each);
        if (!direct) {
          L.after([dst, outs, n]() {
            for (size_t r = 0; r < outs.size(); ++r) {
              outs[r].copy_(dst.narrow(0, static_cast<int64_t>(r) * n, n).view(outs[r].sizes()));
            }
          });
        }
      } else {
        // Uneven blocks: rank r broadcasts its input into everyone's outs[r].
        at::Tensor src = L.buffer(in, in.scalar_type(), true, false);
        for (size_t r = 0; r < size; ++r) {
          const size_t n = nbytesOf(outs[r]);
          if (n == 0) continue;
          at::Tensor dst = L.buffer(outs[r], outs[r].scalar_type(), false, true);
          at::Tensor from = static_cast<int>(r) == rank ? src : dst;  // sendbuff is only read on the root
          L.broadcast(from, dst, n, static_cast<int>(r));
        }
      }
    }
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, std::move(inputs), std::move(flatOut), std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::allgatherBase(OpInfo info, at::Tensor input, at::Tensor output) {
  // NCCL gathers into the flat output directly, with no per-rank views, as torch's nccl does.
  if (!input.is_contiguous() || !output.is_contiguous()) return Engine::allgatherBase(std::move(info), input, output);
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(input);
  auto launch = [rank](Launch& L, const NcclWork& w) {
    const at::Tensor& in = w.inputs()[0];
    const at::Tensor& out = w.outputs()[0];
    const size_t each = nbytesOf(in);
    if (each == 0) return;
    at::Tensor src = in;
    char* dst = static_cast<char*>(out.data_ptr());
    // In place (the input is this rank's block) is fine for NCCL; any other overlap is not.
    if (src.data_ptr() != dst + rank * each && overlaps(src.data_ptr(), each, dst, nbytesOf(out))) {
      at::Tensor copy = L.scratch(src.sizes(), src.scalar_type());
      L.stage([copy, src]() mutable { copy.copy_(src); });
      src = copy;
    }
    L.allGather(src, out, dst, each);
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, {input}, {output}, std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root) {
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(input);
  return impl_->submit(
      std::move(info), dev, info.asyncOp, {input}, std::move(outputs), [root, rank](Launch& L, const NcclWork& w) {
        const at::Tensor& input = w.inputs()[0];
        const auto& outputs = w.outputs();
        if (rank != root) {
          const size_t n = nbytesOf(input);
          if (n == 0) return;
          L.send(L.buffer(input, input.scalar_type(), true, false), n, root);
          return;
        }
        for (size_t r = 0; r < outputs.size(); ++r) {
          const size_t n = nbytesOf(outputs[r]);
          if (static_cast<int>(r) == root || n == 0) continue;
          L.recv(L.buffer(outputs[r], outputs[r].scalar_type(), false, true), n, static_cast<int>(r));
        }
        if (input.numel() > 0) {
          L.stage([own = outputs[root], input]() mutable { own.copy_(input); });  // own block: a local copy
        }
      });
}

NcclEngine::WorkPtr NcclEngine::scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root) {
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(output);
  return impl_->submit(
      std::move(info), dev, info.asyncOp, std::move(inputs), {output}, [root, rank](Launch& L, const NcclWork& w) {
        const auto& inputs = w.inputs();
        const at::Tensor& output = w.outputs()[0];
        if (rank != root) {
          const size_t n = nbytesOf(output);
          if (n == 0) return;
          L.recv(L.buffer(output, output.scalar_type(), false, true), n, root);
          return;
        }
        for (size_t r = 0; r < inputs.size(); ++r) {
          const size_t n = nbytesOf(inputs[r]);
          if (static_cast<int>(r) == root || n == 0) continue;
          L.send(L.buffer(inputs[r], inputs[r].scalar_type(), true, false), n, static_cast<int>(r));
        }
        if (output.numel() > 0) L.stage([output, own = inputs[root]]() mutable { output.copy_(own); });
      });
}

NcclEngine::WorkPtr NcclEngine::reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                              std::vector<at::Tensor> outputs, const Reduction& red,
                                              std::vector<at::Tensor> /*userInputs*/) {
  const auto dev = impl_->dev.deviceOf(outputs.at(0));
  const NcclReduce plan = impl_->plan(red, info, dev);
  std::vector<at::Tensor> flatIn;
  for (auto& list : inputs) flatIn.insert(flatIn.end(), list.begin(), list.end());
  const int rank = info.rank;
  auto launch = [inputs = std::move(inputs), plan, rank](Launch& L, const NcclWork& w) {
    const auto& outputs = w.outputs();
    for (size_t k = 0; k < outputs.size(); ++k) {
      const auto& ins = inputs[k];
      const at::Tensor& out = outputs[k];
      const int64_t n = out.numel();
      bool even = true;
      for (const auto& b : ins) even = even && b.numel() == n;
      const int slot = L.redOp(plan);
      if (even) {
        if (n == 0) continue;
        const size_t each = static_cast<size_t>(n) * c10::elementSize(plan.stage);
        at::Tensor src;
        if (ins.at(0).scalar_type() == plan.stage && consecutiveBlocks(ins, each)) {
          src = ins[0];  // the blocks already form one flat input
        } else {
          src = L.scratch({static_cast<int64_t>(ins.size()) * n}, plan.stage);
          L.stage([src, ins, n]() mutable {
            for (size_t r = 0; r < ins.size(); ++r) {
              src.narrow(0, static_cast<int64_t>(r) * n, n).view(ins[r].sizes()).copy_(ins[r]);
            }
          });
        }
        void* srcPtr = src.data_ptr();
        at::Tensor dst = L.buffer(out, plan.stage, false, true);
        // In place (the output is this rank's block of the input) is fine; other overlap is not.
        if (dst.data_ptr() != static_cast<char*>(srcPtr) + rank * each &&
            overlaps(dst.data_ptr(), each, srcPtr, ins.size() * each)) {
          at::Tensor fresh = L.scratch(out.sizes(), plan.stage);
          L.after([out, fresh]() mutable { out.copy_(fresh); });
          dst = fresh;
        }
        L.reduceScatter(src, srcPtr, dst, static_cast<size_t>(n * plan.perElement), plan.type, slot);
      } else {
        // Uneven blocks: one reduce per rank, rooted at the rank that keeps that block.
        for (size_t r = 0; r < ins.size(); ++r) {
          const int64_t m = ins[r].numel();
          if (m == 0) continue;
          at::Tensor src = L.buffer(ins[r], plan.stage, true, false);
          at::Tensor dst = static_cast<int>(r) == rank ? L.buffer(out, plan.stage, false, true) : src;
          L.reduce(src, dst, static_cast<size_t>(m * plan.perElement), plan.type, slot, static_cast<int>(r));
        }
      }
    }
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, std::move(flatIn), std::move(outputs), std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::reduceScatterBase(OpInfo info, at::Tensor input, at::Tensor output,
                                                  const Reduction& red) {
  const auto dev = impl_->dev.deviceOf(output);
  const NcclReduce plan = impl_->plan(red, info, dev);
  // NCCL reduces from the flat input directly when it is already what NCCL reads.
  if (!input.is_contiguous() || input.scalar_type() != plan.stage) {
    return Engine::reduceScatterBase(std::move(info), input, output, red);
  }
  const int rank = info.rank;
  auto launch = [plan, rank](Launch& L, const NcclWork& w) {
    const at::Tensor& in = w.inputs()[0];
    const at::Tensor& out = w.outputs()[0];
    const int64_t n = out.numel();
    if (n == 0) return;
    const size_t each = static_cast<size_t>(n) * c10::elementSize(plan.stage);
    const int slot = L.redOp(plan);
    char* src = static_cast<char*>(in.data_ptr());
    at::Tensor dst = L.buffer(out, plan.stage, false, true);
    // In place (the output is this rank's block of the input) is fine; other overlap is not.
    if (dst.data_ptr() != src + rank * each && overlaps(dst.data_ptr(), each, src, nbytesOf(in))) {
      at::Tensor fresh = L.scratch(out.sizes(), plan.stage);
      L.after([out, fresh]() mutable { out.copy_(fresh); });
      dst = fresh;
    }
    L.reduceScatter(in, src, dst, static_cast<size_t>(n * plan.perElement), plan.type, slot);
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, {input}, {output}, std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> /*userInputs*/) {
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(inputs.at(0));
  auto launch = [rank](Launch& L, const NcclWork& w) {
    const auto& inputs = w.inputs();
    const auto& outputs = w.outputs();
    for (size_t r = 0; r < inputs.size(); ++r) {
      const int peer = static_cast<int>(r);
      if (peer == rank) {
        if (inputs[r].numel() > 0) {
          L.stage([out = outputs[r], in = inputs[r]]() mutable { out.copy_(in.reshape(out.sizes())); });
        }
        continue;
      }
      // Sizes may differ per peer; each pair agrees on its own (what I send is what it expects).
      const size_t sendBytes = nbytesOf(inputs[r]), recvBytes = nbytesOf(outputs[r]);
      if (sendBytes > 0) {
        L.send(L.buffer(inputs[r], inputs[r].scalar_type(), true, false), sendBytes, peer);
      }
      if (recvBytes > 0) {
        L.recv(L.buffer(outputs[r], outputs[r].scalar_type(), false, true), recvBytes, peer);
      }
    }
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, std::move(inputs), std::move(outputs), std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::alltoallBase(OpInfo info, at::Tensor input, at::Tensor output,
                                             std::vector<int64_t> inRows, std::vector<int64_t> outRows) {
  // NCCL sends and receives at offsets into the flat tensors, with no per-rank views, as torch's
  // nccl does.
  if (!input.is_contiguous() || !output.is_contiguous() || input.dim() == 0 || output.dim() == 0) {
    return Engine::alltoallBase(std::move(info), input, output, std::move(inRows), std::move(outRows));
  }
  const int rank = info.rank;
  const auto dev = impl_->dev.deviceOf(input);
  auto launch = [rank, inRows = std::move(inRows), outRows = std::move(outRows)](Launch& L, const NcclWork& w) {
    const at::Tensor& in = w.inputs()[0];
    const at::Tensor& out = w.outputs()[0];
    const size_t inRow = in.size(0) > 0 ? nbytesOf(in) / static_cast<size_t>(in.size(0)) : 0;
    const size_t outRow = out.size(0) > 0 ? nbytesOf(out) / static_cast<size_t>(out.size(0)) : 0;
    char* src = static_cast<char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    int64_t inFirst = 0, outFirst = 0;
    for (size_t r = 0; r < inRows.size(); ++r) {
      const int peer = static_cast<int>(r);
      const size_t sendBytes = static_cast<size_t>(inRows[r]) * inRow;
      const size_t recvBytes = static_cast<size_t>(outRows[r]) * outRow;
      if (peer == rank) {
        if (sendBytes > 0) {
          L.stage([in, out, i = inFirst, o = outFirst, n = inRows[r], m = outRows[r]]() mutable {
            at::Tensor to = out.narrow(0, o, m);
            to.copy_(in.narrow(0, i, n).reshape(to.sizes()));
          });
        }
      } else {
        // Sizes may differ per peer; each pair agrees on its own (what I send is what it expects).
        if (sendBytes > 0) L.send(in, src + static_cast<size_t>(inFirst) * inRow, sendBytes, peer);
        if (recvBytes > 0) L.recv(out, dst + static_cast<size_t>(outFirst) * outRow, recvBytes, peer);
      }
      inFirst += inRows[r];
      outFirst += outRows[r];
    }
  };
  return impl_->submit(std::move(info), dev, info.asyncOp, {input}, {output}, std::move(launch));
}

NcclEngine::WorkPtr NcclEngine::barrier(OpInfo info, at::Device device) {
  const int idx = device.has_index() ? device.index() : impl_->dev.current();
  DeviceGuard guard(impl_->dev, idx);
  // One element through the communicator: every rank's kernel must meet every other's.
  at::Tensor token = at::zeros({1}, impl_->dev.tensorOptions(idx).dtype(at::kFloat));
  Reduction sum;
  NcclReduce plan = planReduce(sum, argWhere(info));
  return impl_->submit(
      std::move(info), c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(idx)), /*asyncOp=*/true, {}, {token},
      [plan](Launch& L, const NcclWork& w) { L.allReduce(w.outputs()[0], 1, plan.type, L.redOp(plan)); },
      Target{}, /*hostSync=*/true);
}

// ---- point-to-point ------------------------------------------------------------------------

NcclEngine::WorkPtr NcclEngine::send(OpInfo info, at::Tensor t, int peer, int tag) {
  if (peer == info.rank && !impl_->isCoalescing()) return impl_->postSelf(info, t, tag, /*isSend=*/true);
  // Point-to-point always runs on its pair's stream: a send must not serialise the caller's stream.
  return impl_->submit(
      std::move(info), impl_->dev.deviceOf(t), /*asyncOp=*/true, {t}, {t},
      [peer](Launch& L, const NcclWork& w) {
        const at::Tensor& t = w.inputs()[0];
        const size_t n = nbytesOf(t);
        if (n == 0) return;
        L.send(L.buffer(t, t.scalar_type(), true, false), n, peer);
      },
      Target{Target::Pair, peer});
}

NcclEngine::WorkPtr NcclEngine::recv(OpInfo info, at::Tensor t, int peer, int tag) {
  if (peer == info.rank && !impl_->isCoalescing()) return impl_->postSelf(info, t, tag, /*isSend=*/false);
  return impl_->submit(
      std::move(info), impl_->dev.deviceOf(t), /*asyncOp=*/true, {}, {t},
      [peer](Launch& L, const NcclWork& w) {
        const at::Tensor& t = w.outputs()[0];
        const size_t n = nbytesOf(t);
        if (n == 0) return;
        L.recv(L.buffer(t, t.scalar_type(), false, true), n, peer);
      },
      Target{Target::Pair, peer});
}

}  // namespace myccl::cuda
