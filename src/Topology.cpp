// Host identity exchange through the store.
#include "myccl/Topology.hpp"

#include "myccl/StoreWait.hpp"

#include <algorithm>
#include <unordered_map>

namespace myccl {

Topology Topology::fromHostIds(int rank, const std::vector<std::string>& idOfRank) {
  Topology t;
  t.rank = rank;
  t.size = static_cast<int>(idOfRank.size());
  std::unordered_map<std::string, int> index;
  t.hostOfRank.resize(t.size);
  for (int r = 0; r < t.size; ++r) {
    auto it = index.find(idOfRank[r]);
    if (it == index.end()) {
      it = index.emplace(idOfRank[r], static_cast<int>(t.hostIds.size())).first;
      t.hostIds.push_back(idOfRank[r]);
    }
    t.hostOfRank[r] = it->second;
  }
  for (int r = 0; r < t.size; ++r)
    if (t.hostOfRank[r] == t.hostOfRank[rank]) t.localRanks.push_back(r);
  t.localRank = static_cast<int>(std::find(t.localRanks.begin(), t.localRanks.end(), rank) - t.localRanks.begin());
  t.localSize = static_cast<int>(t.localRanks.size());
  t.crossRank = t.hostOfRank[rank];
  t.crossSize = static_cast<int>(t.hostIds.size());
  return t;
}

Topology Topology::subset(const std::vector<int>& members, int rank) const {
  std::vector<std::string> ids;
  for (int m : members) ids.push_back(hostIds[hostOfRank[m]]);
  return fromHostIds(rank, ids);
}

Topology Topology::exchange(c10d::Store& store, const std::string& prefix, int rank, int size,
                            const std::string& hostId, std::chrono::milliseconds timeout, const std::string& where) {
  store.set(prefix + "host/" + std::to_string(rank), std::vector<uint8_t>(hostId.begin(), hostId.end()));
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r = 0; r < size; ++r) keys.push_back(prefix + "host/" + std::to_string(r)), ranks.push_back(r);
  waitForRanks(store, keys, ranks, timeout, "their host identity", where);
  std::vector<std::string> ids;
  for (auto& v : store.multiGet(keys)) ids.emplace_back(v.begin(), v.end());
  return fromHostIds(rank, ids);
}

}  // namespace myccl
