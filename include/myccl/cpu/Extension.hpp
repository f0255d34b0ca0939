// The CPU engine's one extension point: an op that a layer above adds to the engine without
// reaching into it (src/cpu/extensions/). The engine runs its body as it runs its own
// collectives: queued in issue order with the group's other ops, on a CollCtx with the op's own
// tag space and deadline, the group's links and (one host) its shared memory; a body that throws
// fails the group as any failed op does. A body moves bytes only through the entry points of
// Algorithms.hpp, so that Select.cpp stays the one place that chooses how.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>

namespace myccl::cpu {

struct CollCtx;

struct ExtensionOp {
  // The op's name, a string literal: OpInfo::name (errors, traces, stats, the flight recorder).
  const char* name = "extension";
  c10d::OpType type = c10d::OpType::UNKNOWN;  // what torch's profiler and flight recorder call it
  const char* redop = nullptr;                // its reduction, for the record (null: none)
  // MYCCL_DEBUG=DETAIL checks before each op that every rank called the same op with the same
  // arguments, and fails the group where they did not. An op that exists to let ranks find out
  // in step that they disagree declines the check.
  bool fingerprinted = true;
  // False: the caller waits at once, and an idle engine runs the op on the calling thread.
  bool asyncOp = true;
  std::function<void(CollCtx&)> body;
};

}  // namespace myccl::cpu
