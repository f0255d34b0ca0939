// Waiting for other ranks' keys in the store within the group's timeout (not the store's own,
// which belongs to whoever made the store and may be far longer), with an error that names the
// ranks that never published and what they were to publish.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace myccl {

// keys[i] is published by ranks[i]. Throws a DistBackendError: "<where>: Timed out after T ms
// waiting for rank(s) 2, 3 to publish <what> in the store (...)".
void waitForRanks(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& ranks,
                  std::chrono::milliseconds timeout, const std::string& what, const std::string& where);
// "2, 3": the ranks whose keys are not in the store now (each listed once, in order).
std::string missingRanks(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& ranks);

}  // namespace myccl
