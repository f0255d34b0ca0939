// Groups made from a group: split (torch's split_group; NCCL communicators split by NCCL), merge,
// and going on after a failure without a relaunch: which ranks are still there (survivors, whose
// protocol is the CPU engine's: cpu/Survivors.cpp) and a new group of them (shrink); torch's
// reconfigure. Survivors and shrink meet through the group's store, never through its links,
// which a failure closes.
#include <algorithm>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_set>
#include <variant>

#include "myccl/Engine.hpp"
#include "myccl/Errors.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"
#include "myccl/cpu/Engine.hpp"

namespace myccl {

namespace {

std::vector<uint8_t> toBytes(const std::string& s) {
  return {s.begin(), s.end()};
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> MycclBackend::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const std::vector<int>& ranks,
                                                      const c10::intrusive_ptr<Options>& opts) {
  const auto w = where("split");
  MYCCL_CHECK_ARG(!ranks.empty(), w, ": the new group has no ranks");
  std::vector<bool> seen(size_, false);
  int myIndex = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    MYCCL_CHECK_ARG(r >= 0 && r < size_, w, ": rank ", r, " of the new group is not in [0, ", size_, ")");
    MYCCL_CHECK_ARG(!seen[r], w, ": rank ", r, " appears twice in the new group");
    seen[r] = true;
    if (r == rank_) myIndex = static_cast<int>(i);
  }
  const auto timeout = opts ? opts->timeout : timeout_.load();
  // Collective over this group (torch calls split on every rank of it): NCCL splits the group's
  // communicators with the lowest rank of each new group as its color, which every member agrees
  // on and no other group of this split has (their ranks do not overlap).
  std::shared_ptr<SplitParts> parts;
  if (auto cuda = engines_.cudaIfMade()) {
    const int color = myIndex < 0 ? -1 : *std::min_element(ranks.begin(), ranks.end());
    parts = cuda->splitParts(color, myIndex, timeout);
  }
  // The CPU side lends its links on a channel of their own (every rank of this group takes the
  // next one, members or not, so all agree), or the new group makes links of its own.
  cpu::SplitSource source;
  if (auto cpu = engines_.cpuIfAny()) source = cpu->splitSource();
  if (myIndex < 0) return nullptr;  // not a member: no group, as torch expects
  std::vector<int64_t> members;
  for (int r : ranks) members.push_back(globalRanks_.empty() ? r : globalRanks_[r]);
  const std::string name = opts && !opts->group_name.empty() ? opts->group_name : group_ + ":split";
  CpuMaker makeCpu;
  if (source.links) {
    // No store round trip: its shared memory, if any, meets over the parent's links (splitGroupLinks).
    makeCpu = [&](std::shared_ptr<Recorder> recorder) {
      auto links = cpu::splitGroupLinks(*store, source, ranks, myIndex, timeout, name, cfg_);
      return std::make_shared<cpu::CpuEngine>(store, std::move(links), name, cfg_, std::move(recorder));
    };
  }
  auto child = c10::make_intrusive<MycclBackend>(store, myIndex, static_cast<int>(ranks.size()), timeout, name,
                                                 std::move(members), cfg_, "", false, makeCpu);
  if (parts) child->engines_.cuda(child->where("split"))->adoptSplit(std::move(parts));
  return child;
}

c10::intrusive_ptr<c10d::Backend> MycclBackend::merge(const c10::intrusive_ptr<c10d::Store>& store,
                                                      const c10::intrusive_ptr<Options>& opts, const int& rank,
                                                      const int& size) {
  const auto w = where("merge");
  MYCCL_CHECK_ARG(size >= 1 && rank >= 0 && rank < size, w, ": rank ", rank, " is not in [0, ", size, ")");
  // Ranks of several groups, possibly never connected: a group of its own through the store torch
  // gives, with this group's settings.
  const auto timeout = opts ? opts->timeout : timeout_.load();
  const std::string name = opts && !opts->group_name.empty() ? opts->group_name : group_ + ":merge";
  return c10::make_intrusive<MycclBackend>(store, rank, size, timeout, name, std::vector<int64_t>{}, cfg_);
}

std::vector<int> MycclBackend::survivors(std::chrono::milliseconds timeout) {
  const auto w = where("survivors");
  MYCCL_CHECK_ARG(timeout.count() >= 0, w, ": timeout must not be negative, got ", timeout.count(), " ms");
  if (timeout.count() == 0) timeout = timeout_.load();
  // A connection of its own: other threads of this process may be using the group's.
  auto store = store_->clone();
  const std::string base = engines_.cpu(w)->keyPrefix() + "survivors" + std::to_string(survivorRounds_++) + "/";
  return cpu::survivors(*store, base, rank_, size_, vanishedRanks(), timeout, w.str());
}

c10::intrusive_ptr<c10d::Backend> MycclBackend::shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                                       const c10::intrusive_ptr<Options>& optsOverride) {
  const auto w = where("shrink");
  MYCCL_CHECK_ARG(!ranksToExclude.empty(), w, ": no rank to exclude");
  MYCCL_CHECK_ARG(shrinkFlags == 0 || shrinkFlags == 1, w, ": unknown shrink flags ", shrinkFlags,
                  " (SHRINK_DEFAULT = 0, SHRINK_ABORT = 1)");
  std::vector<bool> excluded(size_, false);
  for (int64_t r : ranksToExclude) {
    MYCCL_CHECK_ARG(r >= 0 && r < size_, w, ": rank ", r, " to exclude is not in [0, ", size_, ")");
    MYCCL_CHECK_ARG(!excluded[r], w, ": rank ", r, " is excluded twice");
    MYCCL_CHECK_ARG(r != rank_, w, ": rank ", r, " is this rank, which the new group would exclude; only the "
                    "ranks that stay call shrink");
    excluded[r] = true;
  }
  std::vector<int64_t> members;  // global ranks of the new group, in this group's order
  int newRank = -1;
  std::string gone;  // the excluded ranks, in the key space: members that disagree never meet
  for (int r = 0; r < size_; ++r) {
    if (excluded[r]) {
      gone += "_" + std::to_string(r);
      continue;
    }
    if (r == rank_) newRank = static_cast<int>(members.size());
    members.push_back(globalRanks_.empty() ? r : globalRanks_[r]);
  }
  if (shrinkFlags == 1) {
    for (auto& e : engines_.all()) e->abort("shrink with SHRINK_ABORT on rank " + std::to_string(rank_));
  }
  const auto timeout = optsOverride ? optsOverride->timeout : timeout_.load();
  const std::string prefix = engines_.cpu(w)->keyPrefix() + "shrink" + std::to_string(shrinks_++) + "/x" + gone + "/";
  // This group's store object (not a clone, which would be one more connection per shrink): the new
  // group keeps it alive when torch destroys this one, and nothing here changes its settings.
  return c10::make_intrusive<MycclBackend>(store_, newRank, static_cast<int>(members.size()),
                                           timeout, group_ + ":shrunk", std::move(members), cfg_, prefix);
}

#if MYCCL_HAS_RECONFIGURE

namespace {

// "myccl:<stable rank>:<uuid>:<nonce>" -> the stable rank (the rank in the default group the
// process had when it made its group); raises on anything else.
int64_t stableRankOf(const std::string& w, const std::string& handle) {
  std::vector<std::string> f;
  std::stringstream in(handle);
  std::string item;
  while (std::getline(in, item, ':')) f.push_back(item);
  int64_t stable = -1;
  try {
    if (f.size() == 4 && f[0] == "myccl") stable = std::stoll(f[1]);
  } catch (const std::exception&) {
    stable = -1;
  }
  MYCCL_CHECK_ARG(stable >= 0, w, ": '", handle, "' is not a myccl reconfigure handle (from get_reconfigure_handle())");
  return stable;
}

}  // namespace

c10d::ReconfigureHandle MycclBackend::get_reconfigure_handle() const {
  const int64_t stable = globalRanks_.empty() || rank_ >= static_cast<int>(globalRanks_.size()) ? rank_
                                                                                                   : globalRanks_[rank_];
  return "myccl:" + std::to_string(stable) + ":" + std::to_string(reconfigureUuid_) + ":" + nonce_;
}

c10::intrusive_ptr<c10d::Work> MycclBackend::reconfigure(const c10d::ReconfigureOptions& opts) {
  const auto w = where("reconfigure");
  std::vector<std::string> handles;
  std::visit([&](const auto& given) { handles.assign(given.begin(), given.end()); }, opts.handles);
  if (std::holds_alternative<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles)) {
    std::sort(handles.begin(), handles.end());  // a set: the same order on every member
  }
  MYCCL_CHECK_ARG(!handles.empty(), w, ": no handles; pass every member's get_reconfigure_handle()");
  MYCCL_CHECK_ARG(std::set<std::string>(handles.begin(), handles.end()).size() == handles.size(), w,
                  ": a handle appears twice among the ", handles.size(), " handles");
  MYCCL_CHECK_ARG(opts.uuid >= 0, w, ": uuid must not be negative, got ", opts.uuid);
  std::vector<int64_t> stable;
  for (const auto& h : handles) stable.push_back(stableRankOf(w.str(), h));
  const std::string mine = get_reconfigure_handle();
  const auto it = std::find(handles.begin(), handles.end(), mine);
  MYCCL_CHECK_ARG(it != handles.end(), w, ": this rank's handle '", mine, "' is not among the ", handles.size(),
                  " handles; every member passes the same list, its own handle included");
  const int newRank = static_cast<int>(it - handles.begin());
  const int newSize = static_cast<int>(handles.size());
  const auto timeout = opts.timeout.value_or(timeout_.load());
  const std::string prefix = "myccl/reconfigure/" + std::to_string(opts.uuid) + "/";
  // With every op of the group held off and none in flight: the new links first (if a member
  // never comes, this raises, naming it, and the group keeps what it had), then the old engines go.
  auto recorder = makeRecorder(newRank, newSize);
  auto make = [&] {
    if (newRank == 0) {
      // A uuid names one membership for good: its keys may still hold an earlier one's addresses.
      const auto claimed = store_->compareSet(prefix + "claimed", {}, toBytes(mine));
      MYCCL_CHECK_ARG(std::string(claimed.begin(), claimed.end()) == mine, w, ": uuid ", opts.uuid,
                      " was already used by another reconfigure; pass a fresh uuid every time");
    }
    auto cpu = std::make_shared<cpu::CpuEngine>(store_, newRank, newSize, timeout, group_, cfg_, recorder, prefix);
    cpu->setAbortHooks(abortHooks_);
    return cpu;
  };
  auto old = engines_.recorder();
  engines_.replace(w, make, recorder, "reconfigured with uuid " + std::to_string(opts.uuid), [&] {
    RecorderRegistry::get().retire(old);
    RecorderRegistry::get().add(recorder);
    rank_ = newRank;
    size_ = newSize;
    setRanks(std::move(stable));
    collSeq_ = 0;
    p2pSeq_ = 0;
    reconfigureUuid_ = opts.uuid;
    shutdown_ = false;
  });
  // Done when it returns, as torch's gloo: a completed Work.
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  fut->markCompleted(c10::IValue(std::vector<at::Tensor>()));
  return c10d::Work::create_from_future(fut);
}

#endif

}  // namespace myccl
