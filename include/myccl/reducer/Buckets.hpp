// Which gradients share a flat bucket buffer. Pure planning: no tensors are allocated and no
// process group is touched, so the rebuild (rank 0's plan, broadcast) and the first plan use
// the same rule and the rule can be tested on its own.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace myccl::reducer {

// Parameter indices per bucket, in the order the buckets are reduced.
using BucketPlan = std::vector<std::vector<int64_t>>;

struct BucketCaps {
  int64_t firstBytes = 1 << 20;  // the first bucket of each dtype/device: small, so it launches early
  int64_t bytes = 25 << 20;
};

// Walks `order` (parameter indices, the order their gradients are expected to be ready) and
// fills one open bucket per (dtype, device) until it holds at least its cap; sparse
// parameters get a bucket of their own. Buckets come back sorted by the position of their
// last parameter in `order`, i.e. the order in which they become full.
BucketPlan assignBuckets(const std::vector<at::Tensor>& params, const std::vector<int64_t>& order,
                         const std::vector<bool>& sparse, const BucketCaps& caps);

// Checks that `plan` holds every parameter exactly once, dense buckets share dtype and
// device, and sparse parameters are alone; names the offending parameter otherwise.
void validatePlan(const BucketPlan& plan, const std::vector<at::Tensor>& params, const std::vector<bool>& sparse,
                  const std::vector<std::string>& names);

}  // namespace myccl::reducer
