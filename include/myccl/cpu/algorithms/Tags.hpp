// The message-tag layout of the CPU engine, in one place. Every message of a collective
// carries a tag unique to its op and step, so messages of different ops or steps never match:
//   bit 63       1 for collectives, 0 for point-to-point
//   bits 56..62  OpCode
//   bits 48..55  the channel: 0 for the group that made the links, 1..255 for groups split from
//                it that share them (ChannelTransport adds and removes it; algorithms never see it)
//   bits 16..47  the op's sequence number (32 bits, compared modulo 2^32)
//   bits  0..15  the step within the op (an algorithm's own numbering)
// A point-to-point tag has bit 63 clear, the channel in bits 48..55 and the user's tag in its low
// 32 bits.
#pragma once

#include <cstdint>
#include <string>

namespace myccl::cpu {

enum class OpCode : uint8_t {
  Broadcast = 1, Allreduce, Reduce, Allgather, Gather, Scatter, ReduceScatter, Alltoall, Barrier,
  Extension,                // an op of the engine's extension point (cpu/Extension.hpp)
  LinkProbe = 0x79,         // MYCCL_HIERARCHICAL=auto's measurement of the links, before an op (seq: the op's)
  Setup = 0x7a,             // a group's setup over links it already has (a split's shared memory)
  ChannelClose = 0x7b,      // a group on shared links tells its peers it closed (ChannelTransport)
  Window = 0x7c,            // one-sided windows' puts and signals (seq: the group's window number)
  MonitoredBarrier = 0x7d,  // numbered apart from the ops (Backend::monitoredBarrier)
  Fingerprint = 0x7e,       // MYCCL_DEBUG=DETAIL's cross-rank check before an op
};

inline constexpr uint64_t kCollectiveBit = uint64_t{1} << 63;
inline constexpr int kOpCodeShift = 56;
inline constexpr uint64_t kOpCodeMask = 0x7f;
inline constexpr int kSeqShift = 16;
inline constexpr uint64_t kSeqMask = 0xffffffffull;
inline constexpr int kChannelShift = 48;
inline constexpr uint64_t kChannelMask = 0xff;
inline constexpr int kMaxChannel = 255;

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
// Whether sequence number `a` comes before `b`, across the wrap at 2^32.
constexpr bool seqBefore(uint64_t a, uint64_t b) {
  const uint64_t ahead = (b - a) & kSeqMask;
  return ahead != 0 && ahead < (kSeqMask >> 1);
}
constexpr int tagChannel(uint64_t tag) {
  return static_cast<int>((tag >> kChannelShift) & kChannelMask);
}
constexpr uint64_t withChannel(uint64_t tag, int channel) {
  return (tag & ~(kChannelMask << kChannelShift)) | ((static_cast<uint64_t>(channel) & kChannelMask) << kChannelShift);
}

// torch's name of the op ("all_reduce"); "op" for a code that names none.
const char* opCodeName(OpCode code);
// "all_reduce #12" for a collective tag, "send with tag 3" for a point-to-point one.
std::string describeTag(uint64_t tag);

}  // namespace myccl::cpu
