// The CPU engine's collectives: each turns its tensors into contiguous buffers (Staging.hpp),
// queues the algorithm call (Algorithms.hpp) and writes results back once it succeeded.
#include "myccl/cpu/Engine.hpp"

#include "cpu/Staging.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"

#include <ATen/ATen.h>

namespace myccl::cpu {

namespace {

std::vector<at::Tensor> flatList(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

// Whether a PREMUL_SUM can be a scaled sum (ReduceSpec::scale): SUM of float32/float64.
bool scalable(const ReduceSpec& spec) {
  return spec.op == RedOp::Sum && spec.divisor == 0 && (spec.dtype == DType::F32 || spec.dtype == DType::F64);
}

}  // namespace

CpuEngine::WorkPtr CpuEngine::broadcast(OpInfo info, at::Tensor t, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  return enqueue(w, OpCode::Broadcast, [t, root](CollCtx& c) {
    auto s = Staged::of(t, c.rank == root);
    c.bytes = s.nbytes();
    cpu::broadcast(c, s.ptr(), s.nbytes(), root);
    s.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::allreduce(OpInfo info, std::vector<at::Tensor> tensors, const Reduction& red) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), tensors, tensors);
  return enqueue(w, OpCode::Allreduce, [tensors, red](CollCtx& c) {
    const ReduceSpec& spec = red.spec;
    if (tensors.size() == 1) {
      auto s = Staged::of(tensors[0], true);
      c.bytes = s.nbytes();
      if (red.premul && scalable(spec)) {
        // float32/float64: the factor rides on the sum (a scaled sum, the same bits as scaling
        // first), which saves the shared-memory algorithms a pass over the tensor.
        ReduceSpec scaled = spec;
        scaled.scale = red.factor;
        cpu::allreduce(c, s.ptr(), s.work.numel(), scaled);
        s.commit();
        return;
      }
      if (red.premul) scaleInPlace(spec.dtype, s.ptr(), s.work.numel(), red.factor);
      cpu::allreduce(c, s.ptr(), s.work.numel(), spec);
      s.commit();
      return;
    }
    // Coalesced: one flat buffer, one collective, then back into each tensor.
    std::vector<at::Tensor> flat;
    flat.reserve(tensors.size());
    for (auto& t : tensors) flat.push_back(t.reshape({-1}));
    at::Tensor buf = at::cat(flat);
    c.bytes = buf.numel() * buf.element_size();
    if (red.premul) scaleInPlace(spec.dtype, buf.data_ptr(), buf.numel(), red.factor);
    cpu::allreduce(c, buf.data_ptr(), buf.numel(), spec);
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(buf.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::reduce(OpInfo info, at::Tensor t, const Reduction& red, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  return enqueue(w, OpCode::Reduce, [t, red, root](CollCtx& c) {
    auto s = Staged::of(t, true);
    c.bytes = s.nbytes();
    const void* in = s.ptr();
    at::Tensor scaled;
    if (red.premul) {
      scaled = privateCopy(s.work);
      scaleInPlace(red.spec.dtype, scaled.data_ptr(), scaled.numel(), red.factor);
      in = scaled.data_ptr();
    }
    cpu::reduce(c, in, s.ptr(), s.work.numel(), red.spec, root);
    if (c.rank == root) s.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::allgather(OpInfo info, std::vector<at::Tensor> inputs,
                                        std::vector<std::vector<at::Tensor>> outputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), inputs, flatList(outputs));
  return enqueue(w, OpCode::Allgather, [inputs, outputs](CollCtx& c) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto in = Staged::of(inputs[i], true);
      std::vector<Staged> outs;
      std::vector<void*> ptrs;
      std::vector<size_t> sizes;
      for (auto& o : outputs[i]) {
        outs.push_back(Staged::of(o, false));
        ptrs.push_back(outs.back().ptr());
        sizes.push_back(outs.back().nbytes());
      }
      for (auto sz : sizes) c.bytes += sz;
      cpu::allgatherv(c, in.ptr(), ptrs.data(), sizes.data());
      for (auto& o : outs) o.commit();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::gather(OpInfo info, at::Tensor input, std::vector<at::Tensor> outputs, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{input}, outputs);
  return enqueue(w, OpCode::Gather, [input, outputs, root](CollCtx& c) {
    auto in = Staged::of(input, true);
    std::vector<Staged> outs;
    std::vector<void*> ptrs(c.size, nullptr);
    std::vector<size_t> sizes(c.size, in.nbytes());
    if (c.rank == root) {
      for (int r = 0; r < c.size; ++r) {
        outs.push_back(Staged::of(outputs[r], false));
        ptrs[r] = outs.back().ptr();
        sizes[r] = outs.back().nbytes();
      }
    }
    c.bytes = in.nbytes();
    cpu::gatherv(c, in.ptr(), ptrs.data(), sizes.data(), root);
    for (auto& o : outs) o.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::scatter(OpInfo info, std::vector<at::Tensor> inputs, at::Tensor output, int root) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), inputs, std::vector<at::Tensor>{output});
  return enqueue(w, OpCode::Scatter, [inputs, output, root](CollCtx& c) {
    auto out = Staged::of(output, false);
    std::vector<Staged> ins;
    std::vector<const void*> ptrs(c.size, nullptr);
    std::vector<size_t> sizes(c.size, out.nbytes());
    if (c.rank == root) {
      for (int r = 0; r < c.size; ++r) {
        ins.push_back(Staged::of(inputs[r], true));
        ptrs[r] = ins.back().ptr();
        sizes[r] = ins.back().nbytes();
      }
    }
    c.bytes = out.nbytes();
    cpu::scatterv(c, ptrs.data(), out.ptr(), sizes.data(), root);
    out.commit();
  });
}

CpuEngine::WorkPtr CpuEngine::reduceScatter(OpInfo info, std::vector<std::vector<at::Tensor>> inputs,
                                            std::vector<at::Tensor> outputs, const Reduction& red,
                                            std::vector<at::Tensor> userInputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), userInputs.empty() ? flatList(inputs) : userInputs, outputs);
  return enqueue(w, OpCode::ReduceScatter, [inputs, outputs, red](CollCtx& c) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      auto out = Staged::of(outputs[i], false);
      std::vector<at::Tensor> keep;
      std::vector<const void*> ptrs;
      std::vector<size_t> counts;
      for (auto& t : inputs[i]) {
        at::Tensor x = red.premul ? privateCopy(t) : t.contiguous();
        if (red.premul) scaleInPlace(red.spec.dtype, x.data_ptr(), x.numel(), red.factor);
        keep.push_back(x);
        ptrs.push_back(x.data_ptr());
        counts.push_back(x.numel());
      }
      for (auto& x : keep) c.bytes += x.numel() * x.element_size();
      cpu::reduceScatterv(c, ptrs.data(), out.ptr(), counts.data(), red.spec);
      out.commit();
    }
  });
}

CpuEngine::WorkPtr CpuEngine::alltoall(OpInfo info, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> userInputs) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), userInputs.empty() ? inputs : userInputs, outputs);
  return enqueue(w, OpCode::Alltoall, [inputs, outputs](CollCtx& c) {
    std::vector<Staged> ins, outs;
    std::vector<const void*> sp;
    std::vector<void*> rp;
    std::vector<size_t> sb, rb;
    for (auto& t : inputs) {
      ins.push_back(Staged::of(t, true));
      sp.push_back(ins.back().ptr());
      sb.push_back(ins.back().nbytes());
    }
    for (auto& t : outputs) {
      outs.push_back(Staged::of(t, false));
      rp.push_back(outs.back().ptr());
      rb.push_back(outs.back().nbytes());
    }
    for (auto b : sb) c.bytes += b;
    cpu::alltoallv(c, sp.data(), sb.data(), rp.data(), rb.data());
    for (auto& o : outs) o.commit();
  });
}

// One op in two phases, each an all-gather under its own tag space (this op's sequence number
// with the all_gather and all_reduce codes, which no other op of the group uses): how many
// entries each rank has, then the entries. Indices travel transposed, so that each rank's block
// is one contiguous run of rows.
CpuEngine::WorkPtr CpuEngine::allreduceSparse(OpInfo info, at::Tensor t) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{t}, std::vector<at::Tensor>{t});
  const uint64_t seq = w->info().seq;
  return enqueue(w, OpCode::Allreduce, [t, seq](CollCtx& c) {
    const int n = c.size;
    at::Tensor in = t.coalesce();
    at::Tensor indices = in._indices().t().contiguous();  // nnz x ndim
    at::Tensor values = in._values().contiguous();
    std::vector<int64_t> counts(n);
    const int64_t nnz = in._nnz();
    {
      CollCtx sizes = c;
      sizes.tagBase = collectiveTagBase(OpCode::Allgather, seq);
      std::vector<void*> outs(n);
      std::vector<size_t> bytes(n, sizeof(int64_t));
      for (int r = 0; r < n; ++r) outs[r] = &counts[r];
      cpu::allgatherv(sizes, &nnz, outs.data(), bytes.data());
    }
    std::vector<at::Tensor> idxRows, valRows;
    std::vector<void*> idxOuts(n), valOuts(n);
    std::vector<size_t> idxBytes(n), valBytes(n);
    for (int r = 0; r < n; ++r) {
      idxRows.push_back(at::empty({counts[r], indices.size(1)}, indices.options()));
      auto vshape = values.sizes().vec();
      vshape[0] = counts[r];
      valRows.push_back(at::empty(vshape, values.options()));
      idxOuts[r] = idxRows[r].data_ptr();
      valOuts[r] = valRows[r].data_ptr();
      idxBytes[r] = idxRows[r].numel() * idxRows[r].element_size();
      valBytes[r] = valRows[r].numel() * valRows[r].element_size();
    }
    CollCtx data = c;
    data.tagBase = collectiveTagBase(OpCode::Allreduce, seq);
    cpu::allgatherv(data, indices.data_ptr(), idxOuts.data(), idxBytes.data());
    CollCtx vdata = c;
    vdata.tagBase = collectiveTagBase(OpCode::Allreduce, seq) | 0x8000;  // above every algorithm's steps
    cpu::allgatherv(vdata, values.data_ptr(), valOuts.data(), valBytes.data());
    std::vector<at::Tensor> idxCols;
    for (auto& x : idxRows) idxCols.push_back(x.t());
    t.copy_(at::sparse_coo_tensor(at::cat(idxCols, 1), at::cat(valRows, 0), in.sizes()).coalesce());
    c.algo = "sparse-all-gather";
    for (int r = 0; r < n; ++r) c.bytes += idxBytes[r] + valBytes[r];
  });
}

void CpuEngine::agree(OpInfo info) {
  // The fingerprint names the op as the other engine will run it; the record says what ran here.
  info.asyncOp = false;
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  enqueue(w, OpCode::Fingerprint, [](CollCtx&) {})->wait();
}

CpuEngine::WorkPtr CpuEngine::barrier(OpInfo info, at::Device /*device*/) {
  auto w = c10::make_intrusive<MycclWork>(std::move(info), std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
  return enqueue(w, OpCode::Barrier, [](CollCtx& c) { cpu::barrier(c); });
}

}  // namespace myccl::cpu
