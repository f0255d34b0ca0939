// Group bootstrap for the CPU engine: everything a group needs before its first op, made once,
// collectively, through the store (as NCCL keeps bootstrap and init apart from enqueue): this
// incarnation's key space, the topology, the group's secret, the shared-memory group with its
// mailboxes, and the TCP mesh. Also the group's shared tensors, which meet through the store too.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "myccl/Config.hpp"
#include "myccl/Topology.hpp"

namespace myccl::cpu {

class Transport;
class ShmGroup;
class SharedLinks;

struct GroupLinks {
  std::string keyPrefix;  // this incarnation's key space in the store
  Topology topo;
  std::shared_ptr<ShmGroup> shm;  // null: no shared memory among this host's ranks of the group
  std::shared_ptr<Transport> transport;
  // The group made these links and lends them to the groups split from it; null when the
  // transport is a channel on another group's links.
  std::shared_ptr<SharedLinks> shared;
};

// What a split needs from the group it splits (CpuEngine::splitSource).
struct SplitSource {
  std::shared_ptr<SharedLinks> links;  // null: the split makes links of its own
  Topology topo;
  int channel = -1;
};

// The key space of a new incarnation of a group on `store`: the same on every rank, and never one
// an earlier incarnation used, in this process or in an earlier torchrun attempt (Bootstrap.cpp).
std::string incarnationPrefix(c10d::Store& store, const Config& cfg);

// Collective over the group. A store reused across destroy/init never serves a previous
// group's addresses or secret: every incarnation takes a fresh key space (incarnationPrefix), or
// the one given (`keyPrefix`, which every rank derives alike: a shrunk group's).
GroupLinks bootstrapGroup(c10d::Store& store, int rank, int size, std::chrono::milliseconds timeout,
                          const std::string& group, const Config& cfg, const std::string& keyPrefix = "");

// Collective over the new group's members (`members`: their ranks in the parent, in the new group's
// order): links on the channel `parent` lent of the parent's connections, and shared memory of its own
// among this host's members, which meet in `store` (the new group's key space).
GroupLinks splitGroupLinks(c10d::Store& store, const SplitSource& parent, const std::vector<int>& members, int rank,
                           std::chrono::milliseconds timeout, const std::string& group, const Config& cfg);

// Collective over the group's ranks: a zero-filled CPU tensor whose storage every rank of the
// group on this host maps (one copy per host). `serial` numbers the calls (the same on every
// rank). The local rank `owner` creates it (whole-memory chunks: one segment made by each local
// rank); no rank returns before every local rank has mapped it, so a rank that drops its tensor
// at once cannot take the segment from a peer still opening it, and the name is gone from
// /dev/shm by then. Waits within `timeout`, naming the local ranks that did not arrive.
at::Tensor sharedTensor(c10d::Store& store, const std::string& keyPrefix, const Topology& topo, uint64_t serial,
                        const std::vector<int64_t>& shape, at::ScalarType dtype, int owner,
                        std::chrono::milliseconds timeout, const std::string& where);

// After a failure, among the group's ranks still running (Survivors.cpp): the ranks that called
// this within `timeout`, the same list on every rank that gets one, meeting under `base` in
// `store` (never over the group's links, which a failure closes). `vanished`: the ranks this
// rank saw die, which nobody waits for. A rank that arrives after the others settled raises,
// naming `where`.
std::vector<int> survivors(c10d::Store& store, const std::string& base, int rank, int size,
                           const std::vector<int>& vanished, std::chrono::milliseconds timeout, const std::string& where);

}  // namespace myccl::cpu
