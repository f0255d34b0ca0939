// The choice between two-level and flat algorithms across hosts (MYCCL_HIERARCHICAL) and what
// it rests on when it is `auto`: figures measured once per group, read by the engine, stats and
// c10d_ext.link_model(). The choice itself is made in Select.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace myccl::cpu {

// Taken once per group, at its first op that has a two-level version: the same figures, and so
// the same choice, on every rank.
struct LinkModel {
  bool measured = false;
  bool hierarchical = true;    // the choice
  bool declared = false;       // linkBytesPerS came from MYCCL_LINK_MBIT, not a measurement
  double linkBytesPerS = 0;    // one host's link: bytes a host sends to the next, its ranks at once (slowest host)
  double localBytesPerS = 0;   // bytes a rank takes in from its host's ranks (slowest rank; 0: one rank per host)
  double ranksPerHost = 1;     // ranks / hosts
  int hosts = 1;
  double seconds = 0;          // what measuring cost
  uint64_t bytes = 0;          // bytes this rank sent while measuring
};

struct CollCtx;
enum class OpCode : uint8_t;

// One per group, used by its op runner only (ops run one at a time): sets CollCtx::hierarchical
// for each op, measuring the links first at the group's first op with a two-level version when
// the choice is `auto` (collective: every rank measures at the same op).
class LevelChoice {
 public:
  // forced: MYCCL_HIERARCHICAL (1, 0, -1 auto); declaredLinkBytesPerS > 0 stands for the link measurement.
  LevelChoice(int forced, double declaredLinkBytesPerS) : forced_(forced), declaredLinkBytesPerS_(declaredLinkBytesPerS) {}
  // True when this call measured (the caller logs describe() and counts what it cost).
  bool choose(CollCtx& c, OpCode code);
  const LinkModel& model() const { return model_; }
  // "link <rate> MB/s per host (measured), shared memory ... : two levels (measuring took <t> ms)"
  std::string describe() const;

 private:
  int forced_;
  double declaredLinkBytesPerS_;
  LinkModel model_;
};

}  // namespace myccl::cpu
