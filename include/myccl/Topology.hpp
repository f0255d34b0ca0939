// Which ranks of a group share a host. Learned once per group through the store; decides
// transports (shared memory inside a host, TCP across) and answers local_rank() & co.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace myccl {

struct Topology {
  int rank = 0;
  int size = 1;
  std::vector<int> hostOfRank;       // rank -> host index (hosts numbered by lowest rank)
  std::vector<std::string> hostIds;  // host index -> identity
  std::vector<int> localRanks;       // group ranks on this host, ascending
  int localRank = 0;                 // index of this rank in localRanks
  int localSize = 1;
  int crossRank = 0;                 // this host's index
  int crossSize = 1;                 // number of hosts

  bool singleHost() const { return crossSize == 1; }
  bool sameHost(int a, int b) const { return hostOfRank[a] == hostOfRank[b]; }

  // Collective over the group: every rank publishes its identity under `prefix`; ranks that
  // do not within `timeout` are named in the error (`where`: the op and rank, for messages).
  // From every rank's host identity, in rank order.
  static Topology fromHostIds(int rank, const std::vector<std::string>& idOfRank);
  // The topology of a group made of some of this one's ranks (`members`, in the new group's
  // order), seen from its rank `rank`.
  Topology subset(const std::vector<int>& members, int rank) const;

  static Topology exchange(c10d::Store& store, const std::string& prefix, int rank, int size,
                           const std::string& hostId, std::chrono::milliseconds timeout, const std::string& where);
};

}  // namespace myccl
