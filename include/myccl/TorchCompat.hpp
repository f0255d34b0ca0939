// Every difference between the torch versions myccl builds against (2.11 to 2.15), and only
// here: the rest of the tree writes against these names and never tests a torch version itself.
// A feature an older torch lacks is mapped to what that torch itself does (op types), or compiled
// only where torch announces the API it needs (MYCCL_HAS_*).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/headeronly/version.h>

#include <memory>

#define MYCCL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !MYCCL_TORCH_AT_LEAST(2, 11)
#error "c10d_ext needs torch 2.11 or newer"
#endif

// Backend API additions of torch 2.14 (reconfigure, one-sided windows, abort hooks). torch
// announces them with feature macros; features built on them are compiled only under these.
#if defined(C10D_BACKEND_HAS_RECONFIGURE)
#define MYCCL_HAS_RECONFIGURE 1
#else
#define MYCCL_HAS_RECONFIGURE 0
#endif
#if defined(C10D_BACKEND_HAS_WINDOW)
#define MYCCL_HAS_WINDOW 1
#else
#define MYCCL_HAS_WINDOW 0
#endif
// Abort hooks and ephemeral timeouts (2.14); 2.15 adds supportsAbortHooks() to announce them.
#if defined(C10D_BACKEND_HAS_HOOKS)
#define MYCCL_HAS_ABORT_HOOKS 1
#else
#define MYCCL_HAS_ABORT_HOOKS 0
#endif
#define MYCCL_HAS_SUPPORTS_ABORT_HOOKS MYCCL_TORCH_AT_LEAST(2, 15)
// Backend::registerCompletionHook and Work::getCompletionKey (torch 2.15).
#define MYCCL_HAS_COMPLETION_HOOKS MYCCL_TORCH_AT_LEAST(2, 15)

namespace torch::autograd {
struct Node;
}

namespace myccl::compat {

// The factor of ReduceOp.PREMUL_SUM: torch 2.13 dropped "NCCL" from the name (2.14 and 2.15
// keep the old one as an alias, a later release may not).
#if MYCCL_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

// ReduceOp.PREMUL_SUM with a plain factor (torch's makeNCCLPreMulSum, renamed with the
// supplement), built from its two fields, which every supported torch has.
inline c10d::ReduceOp makePreMulSum(double factor) {
  c10d::ReduceOp op;
  op.op_ = c10d::ReduceOp::PREMUL_SUM;
  op.supplement_ = c10::make_intrusive<PreMulSumSupplement>(factor);
  return op;
}

// The holder of autograd graph nodes (a gradient accumulator, grad_fn): std::shared_ptr until
// torch 2.12, c10::intrusive_ptr from 2.13.
#if MYCCL_TORCH_AT_LEAST(2, 13)
using NodePtr = c10::intrusive_ptr<torch::autograd::Node>;
#else
using NodePtr = std::shared_ptr<torch::autograd::Node>;
#endif

// Backend virtuals that not every supported torch declares (shrink, supportsShrinking, split,
// merge) are declared in MycclBackend without `override`: where torch has the virtual with that
// signature they override it, elsewhere they are plain methods torch never calls. The Python
// tests check each capability through torch's own binding where torch has one.

// Op types torch added later than the ops themselves. Before, torch's own process groups report
// such an op as COALESCED, so myccl's Work does the same there (its profiler range and stats
// still carry the op's own name).
#if MYCCL_TORCH_AT_LEAST(2, 12)
inline constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
inline constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif
#if MYCCL_TORCH_AT_LEAST(2, 14)
inline constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED;
#else
inline constexpr c10d::OpType kAllgatherIntoTensorCoalesced = c10d::OpType::COALESCED;
#endif

}  // namespace myccl::compat
