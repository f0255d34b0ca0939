// The message-tag layout of the CPU engine, in one place. Every message of a collective
// carries a tag unique to its op and step, so messages of different ops or steps never match:
//   bit 63       1 for collectives, 0 for point-to-point
//   bits 56..62  OpCode
//   bits 16..55  the op's sequence number (40 bits)
//   bits  0..15  the step within the op (an algorithm's own numbering)
// A point-to-point tag has bit 63 clear and the user's tag in its low 32 bits.
#pragma once

#include <cstdint>
#include <string>

namespace myccl::cpu {

enum class OpCode : uint8_t {
  Broadcast = 1, Allreduce, Reduce, Allgather, Gather, Scatter, ReduceScatter, Alltoall, Barrier,
  Window = 0x7c,            // one-sided windows' puts and signals (seq: the group's window number)
  MonitoredBarrier = 0x7d,  // numbered apart from the ops (Backend::monitoredBarrier)
  Fingerprint = 0x7e,       // MYCCL_DEBUG=DETAIL's cross-rank check before an op
};

inline constexpr uint64_t kCollectiveBit = uint64_t{1} << 63;
inline constexpr int kOpCodeShift = 56;
inline constexpr uint64_t kOpCodeMask = 0x7f;
inline constexpr int kSeqShift = 16;
inline constexpr uint64_t kSeqMask = 0xffffffffffull;

// The tag of an op's step 0; its steps are tagBase | step.
constexpr uint64_t collectiveTagBase(OpCode code, uint64_t seq) {
  return kCollectiveBit | ((static_cast<uint64_t>(code) & kOpCodeMask) << kOpCodeShift) | ((seq & kSeqMask) << kSeqShift);
}
constexpr uint64_t p2pTag(int userTag) {
  return static_cast<uint32_t>(userTag);
}
constexpr bool isCollectiveTag(uint64_t tag) {
  return (tag & kCollectiveBit) != 0;
}
constexpr OpCode tagOpCode(uint64_t tag) {
  return static_cast<OpCode>((tag >> kOpCodeShift) & kOpCodeMask);
}
constexpr uint64_t tagSeq(uint64_t tag) {
  return (tag >> kSeqShift) & kSeqMask;
}

// torch's name of the op ("all_reduce"); "op" for a code that names none.
const char* opCodeName(OpCode code);
// "all_reduce #12" for a collective tag, "send with tag 3" for a point-to-point one.
std::string describeTag(uint64_t tag);

}  // namespace myccl::cpu
