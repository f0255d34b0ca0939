// waitForRanks (StoreWait.hpp).
#include "myccl/StoreWait.hpp"

#include <algorithm>

#include "myccl/Errors.hpp"

namespace myccl {

void waitForRanks(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& ranks,
                  std::chrono::milliseconds timeout, const std::string& what, const std::string& where) {
  if (keys.empty()) return;
  std::string storeError;
  try {
    store.wait(keys, timeout);
    return;
  } catch (const std::exception& e) {
    storeError = e.what();
  }
  const std::string missing = missingRanks(store, keys, ranks);
  throwDistError("myccl: " + where + ": Timed out after " + std::to_string(timeout.count()) + " ms waiting for " +
                 (missing.empty() ? std::string("the other ranks") : "rank(s) " + missing) + " to publish " + what +
                 " in the store: they have not joined the group (not started, crashed, or stuck before "
                 "init_process_group). Store: " + storeError.substr(0, storeError.find('\n')));
}

std::string missingRanks(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& ranks) {
  std::string missing;
  std::vector<int> seen;
  for (size_t i = 0; i < keys.size(); ++i) {
    bool present = false;
    try {
      present = store.check({keys[i]});
    } catch (const std::exception&) {
    }
    if (present || std::find(seen.begin(), seen.end(), ranks[i]) != seen.end()) continue;
    seen.push_back(ranks[i]);
    missing += (missing.empty() ? "" : ", ") + std::to_string(ranks[i]);
  }
  return missing;
}

}  // namespace myccl
