// What the choice between two-level and flat algorithms across hosts rests on
// (MYCCL_HIERARCHICAL=auto): measured once per group (cpu::measureLink), read by the engine,
// stats and c10d_ext.link_model().
#pragma once

#include <cstdint>

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

}  // namespace myccl::cpu
