// survivors(): after a failure, which of the group's ranks are still running, agreed through
// the store. Each says it is here and which ranks it saw die; nobody waits for those, so the
// survivors settle at once when a process was killed, and only a rank that is silent but not
// known dead (stalled, or on a host that vanished) costs the timeout. The first to settle decides.
#include <algorithm>
#include <sstream>
#include <thread>

#include "myccl/Errors.hpp"
#include "myccl/cpu/Bootstrap.hpp"

namespace myccl::cpu {

namespace {

std::string joinRanks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

std::vector<int> parseRanks(const std::vector<uint8_t>& bytes) {
  std::vector<int> out;
  std::stringstream in(std::string(bytes.begin(), bytes.end()));
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(std::stoi(item));
  return out;
}

std::vector<uint8_t> toBytes(const std::string& s) {
  return {s.begin(), s.end()};
}

}  // namespace

std::vector<int> survivors(c10d::Store& store, const std::string& base, int rank, int size,
                           const std::vector<int>& vanished, std::chrono::milliseconds timeout, const std::string& where) {
  auto hereKey = [&](int r) { return base + "here/" + std::to_string(r); };
  // Each rank says it is here, and which ranks it saw die (their links ended without a word):
  // nobody waits for those, so survivors settle at once when a process was killed, and only a
  // rank that is silent but not known dead (stalled, or on a host that vanished) costs the timeout.
  store.set(hereKey(rank), toBytes(joinRanks(vanished)));
  std::vector<bool> here(size, false), dead(size, false);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  for (;;) {
    for (int r = 0; r < size; ++r) {
      if (here[r] || !store.check({hereKey(r)})) continue;
      here[r] = true;
      for (int d : parseRanks(store.get(hereKey(r))))
        if (d >= 0 && d < size) dead[d] = true;
    }
    bool settled = true;
    for (int r = 0; r < size; ++r) settled = settled && (here[r] || dead[r]);
    if (settled || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(20));
  }
  // The first rank to settle decides for all, so every rank gets the same list.
  std::vector<int> mine;
  for (int r = 0; r < size; ++r)
    if (here[r]) mine.push_back(r);
  const auto verdict = parseRanks(store.compareSet(base + "verdict", {}, toBytes(joinRanks(mine))));
  if (std::find(verdict.begin(), verdict.end(), rank) == verdict.end()) {
    throwDistError("myccl: " + where + ": the other ranks settled on survivors [" + joinRanks(verdict) +
                   "] before this rank arrived (it came after their timeout of " + std::to_string(timeout.count()) +
                   " ms); it is not part of the group that goes on");
  }
  return verdict;
}

}  // namespace myccl::cpu
