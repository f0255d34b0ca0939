// Counts, bytes and time per (op, algorithm) of one CPU group: c10d_ext.stats().
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace myccl::cpu {

// Counts, bytes and time per (op, algorithm). Shared with p2p completion callbacks, which
// may run after the engine is gone.
class Stats {
 public:
  struct Entry {
    std::string op, algo;
    uint64_t count = 0;
    uint64_t bytes = 0;
    double seconds = 0;
  };
  void add(const std::string& op, const std::string& algo, uint64_t bytes, double seconds);
  std::vector<Entry> snapshot() const;
  void reset();

 private:
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
};

}  // namespace myccl::cpu
