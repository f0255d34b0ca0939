// Names for the tag layout of Tags.hpp, for error messages and hang reports.
#include "myccl/cpu/algorithms/Tags.hpp"

namespace myccl::cpu {

const char* opCodeName(OpCode code) {
  switch (code) {
    case OpCode::Broadcast: return "broadcast";
    case OpCode::Allreduce: return "all_reduce";
    case OpCode::Reduce: return "reduce";
    case OpCode::Allgather: return "all_gather";
    case OpCode::Gather: return "gather";
    case OpCode::Scatter: return "scatter";
    case OpCode::ReduceScatter: return "reduce_scatter";
    case OpCode::Alltoall: return "all_to_all";
    case OpCode::Barrier: return "barrier";
    case OpCode::Extension: return "extension op";
    case OpCode::MonitoredBarrier: return "monitored_barrier";
    case OpCode::Window: return "window";
    case OpCode::Fingerprint: return "fingerprint check of";
    case OpCode::ChannelClose: return "closing notice of";
    case OpCode::Setup: return "setup of";
    case OpCode::LinkProbe: return "link probe before";
  }
  return "op";
}

std::string describeTag(uint64_t tag) {
  if (isCollectiveTag(tag)) return std::string(opCodeName(tagOpCode(tag))) + " #" + std::to_string(tagSeq(tag));
  return "send with tag " + std::to_string(static_cast<int32_t>(tag & 0xffffffffu));
}

}  // namespace myccl::cpu
