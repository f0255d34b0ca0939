// Bucket planning for the Reducer: greedy fill in expected-ready order, one open bucket per
// dtype and device, a smaller first bucket so communication starts early in backward.
#include "myccl/reducer/Buckets.hpp"

#include <algorithm>
#include <map>
#include <tuple>

#include "myccl/Errors.hpp"

namespace myccl::reducer {

namespace {

using Key = std::tuple<int, int, int>;  // dtype, device type, device index

Key keyOf(const at::Tensor& t) {
  return {static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()), static_cast<int>(t.device().index())};
}

}  // namespace

BucketPlan assignBuckets(const std::vector<at::Tensor>& params, const std::vector<int64_t>& order,
                         const std::vector<bool>& sparse, const BucketCaps& caps) {
  struct Open {
    std::vector<int64_t> vars;
    int64_t bytes = 0;
    size_t closed = 0;  // buckets of this key already closed: the first one gets the small cap
  };
  // (position in `order` of the last member, members); sorted at the end.
  std::vector<std::pair<size_t, std::vector<int64_t>>> done;
  std::map<Key, Open> open;
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const int64_t i = order[pos];
    if (sparse[i]) {
      done.push_back({pos, {i}});
      continue;
    }
    Open& o = open[keyOf(params[i])];
    o.vars.push_back(i);
    o.bytes += params[i].numel() * static_cast<int64_t>(params[i].element_size());
    const int64_t cap = o.closed == 0 ? caps.firstBytes : caps.bytes;
    if (o.bytes >= cap) {
      done.push_back({pos, std::move(o.vars)});
      o.vars.clear();
      o.bytes = 0;
      ++o.closed;
    }
  }
  // Partly filled buckets become full when their last member is ready.
  std::vector<size_t> posOf(params.size());
  for (size_t pos = 0; pos < order.size(); ++pos) posOf[order[pos]] = pos;
  for (auto& [key, o] : open)
    if (!o.vars.empty()) done.push_back({posOf[o.vars.back()], std::move(o.vars)});
  std::stable_sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  BucketPlan plan;
  plan.reserve(done.size());
  for (auto& d : done) plan.push_back(std::move(d.second));
  return plan;
}

void validatePlan(const BucketPlan& plan, const std::vector<at::Tensor>& params, const std::vector<bool>& sparse,
                  const std::vector<std::string>& names) {
  std::vector<int> seen(params.size(), 0);
  for (size_t b = 0; b < plan.size(); ++b) {
    MYCCL_CHECK(!plan[b].empty(), "ddp: bucket ", b, " of ", plan.size(), " is empty");
    for (int64_t i : plan[b]) {
      MYCCL_CHECK(i >= 0 && static_cast<size_t>(i) < params.size(), "ddp: bucket ", b, " names parameter index ", i,
                  " but the model has ", params.size(), " parameters");
      MYCCL_CHECK(++seen[i] == 1, "ddp: parameter '", names[i], "' (index ", i, ") is in more than one bucket");
      MYCCL_CHECK(!sparse[i] || plan[b].size() == 1, "ddp: parameter '", names[i],
                  "' expects a sparse gradient and must have a bucket of its own, bucket ", b, " holds ",
                  plan[b].size(), " parameters");
      const at::Tensor& first = params[plan[b].front()];
      MYCCL_CHECK(params[i].scalar_type() == first.scalar_type() && params[i].device() == first.device(),
                  "ddp: bucket ", b, " mixes '", names[i], "' (", params[i].scalar_type(), " on ", params[i].device(),
                  ") with '", names[plan[b].front()], "' (", first.scalar_type(), " on ", first.device(), ")");
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    MYCCL_CHECK(seen[i] == 1, "ddp: parameter '", names[i], "' (index ", i, ") is in no bucket");
}

}  // namespace myccl::reducer
