// Counts, bytes and time per (op, algorithm) of one CPU group.
#include "myccl/cpu/Stats.hpp"

namespace myccl::cpu {

void Stats::add(const std::string& op, const std::string& algo, uint64_t bytes, double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : entries_) {
    if (e.op == op && e.algo == algo) {
      ++e.count;
      e.bytes += bytes;
      e.seconds += seconds;
      return;
    }
  }
  entries_.push_back(Entry{op, algo, 1, bytes, seconds});
}

std::vector<Stats::Entry> Stats::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return entries_;
}

void Stats::reset() {
  std::lock_guard<std::mutex> lk(mu_);
  entries_.clear();
}

}  // namespace myccl::cpu
