// Horovod's agreed all_reduce as an extension op (AgreedAllreduce.hpp): argument checks, the
// tensor staged as the algorithm takes it, and the answer written where the caller reads it.
#include "myccl/cpu/extensions/AgreedAllreduce.hpp"

#include "cpu/Staging.hpp"
#include "myccl/Arguments.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu {

ExtensionOp agreedAllreduce(const Where& w, const at::Tensor& t, const at::Tensor& agreed, int64_t key,
                            const c10d::ReduceOp& op, int size) {
  MYCCL_CHECK_ARG(t.defined() && t.device().is_cpu() && !t.is_sparse(), w, ": needs a dense CPU tensor, got ",
                  describe(t));
  MYCCL_CHECK_ARG(agreed.defined() && agreed.device().is_cpu() && agreed.numel() == 1 &&
                      (agreed.scalar_type() == at::kByte || agreed.scalar_type() == at::kBool),
                  w, ": the answer goes into one uint8 or bool CPU element, got ", describe(agreed));
  checkWritable(w, t, "tensor");
  const Reduction red = toReduction(w, t, op, size, false);
  ExtensionOp x;
  x.name = "agreed_all_reduce";
  x.type = c10d::OpType::ALLREDUCE;
  x.redop = reduceOpName(op.op_);
  x.fingerprinted = false;  // it exists to let ranks that disagree find out in step
  x.asyncOp = false;
  // A pre-multiplied reduction would scale the tensor before knowing: it offers nothing.
  const uint64_t offer = red.premul ? 0 : static_cast<uint64_t>(key);
  x.body = [t, agreed, spec = red.spec, offer](CollCtx& c) {
    uint8_t done = 0;
    if (agreedApplies(*c.topo, c.shm != nullptr)) {
      auto s = Staged::of(t, true);
      c.bytes = s.nbytes();
      done = allreduceAgreed(c, s.ptr(), s.work.numel(), spec, offer);
      if (done) s.commit();
    }
    *static_cast<uint8_t*>(agreed.data_ptr()) = done;
  };
  return x;
}

}  // namespace myccl::cpu
