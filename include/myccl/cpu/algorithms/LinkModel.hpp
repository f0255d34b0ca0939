// The choice between two-level and flat algorithms across hosts (MYCCL_HIERARCHICAL) and what
// it rests on when it is `auto`: figures measured once per group, read by the engine, stats and
// c10d_ext.link_model(). The choice itself is made in Select.cpp, as it picks each op's family.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
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
class Stats;

// One per group: sets CollCtx::hierarchical for each op that has a two-level version, measuring
// the links first at the group's first such op when the choice is `auto` (collective: every rank
// measures at the same op). Select.cpp asks it as it picks an op's family; the op runner runs one
// op at a time, so only model() is read from other threads.
class LevelChoice {
 public:
  // forced: MYCCL_HIERARCHICAL (1, 0, -1 auto); declaredLinkBytesPerS > 0 stands for the link
  // measurement. A measurement is logged once, naming `who` ("group 'g' rank 3"), and counted in
  // `stats` as link_probe/<choice>.
  LevelChoice(int forced, double declaredLinkBytesPerS, std::shared_ptr<Stats> stats, std::string who);
  void choose(CollCtx& c);
  // The figures and choice as last measured (measured = false before).
  LinkModel model() const;
  // "link <rate> MB/s per host (measured), shared memory ... : two levels (measuring took <t> ms)"
  std::string describe() const;

 private:
  const int forced_;
  const double declaredLinkBytesPerS_;
  const std::shared_ptr<Stats> stats_;
  const std::string who_;
  mutable std::mutex mu_;  // model_'s writes (by the op runner) and model()
  LinkModel model_;
};

}  // namespace myccl::cpu
