// What an op is about (OpInfo), for error messages, traces, the flight recorder and the
// profiler, and the lazily formatted text an error on an op's path names (Described).
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>  // c10d::OpType

#include <chrono>
#include <cstdint>
#include <string>

namespace myccl {

// What a Work is about, for error messages, traces and the flight recorder.
struct OpInfo {
  c10d::OpType type = c10d::OpType::UNKNOWN;
  std::string op;     // what the op is, e.g. "all_reduce", "send to 1 tag 0"
  const char* name = "op";  // torch's name of the op ("all_reduce", "send"), a string literal:
                            // profiler ranges and stats
  uint64_t seq = 0;   // per-group sequence number (collectives) or p2p counter
  int rank = -1;      // this rank in the group
  int size = 0;       // the group's size, and its ranks in the default group as start + stride
  int rankStart = 0, rankStride = 1;  // (for torch's profiler metadata; stride -1: uneven)
  std::string group;  // group name
  std::chrono::milliseconds timeout{0};
  bool asyncOp = true;  // false: the caller waits at once (the engine may run it inline)
  // What the op is about, for the flight recorder, traces and cross-rank checks.
  std::string dtype;
  std::string shape;
  std::string redop;
  uint64_t bytes = 0;
  int64_t root = -1;

  // "all_reduce #12 (rank 0, group 'default_pg')"
  std::string describe() const;
};

// What an error on an op's path names: an op, described only if an error is raised (so the hot
// path builds no string), or a fixed text. Refers to its source: use it within the call.
class Described {
 public:
  Described(const OpInfo& info) : info_(&info) {}      // NOLINT: implicit by design
  Described(const std::string& text) : text_(&text) {}  // NOLINT
  std::string str() const { return info_ ? info_->describe() : *text_; }

 private:
  const OpInfo* info_ = nullptr;
  const std::string* text_ = nullptr;
};

}  // namespace myccl
