// Backend::monitoredBarrier for CPU groups, with the semantics and words torch documents for
// gloo: every other rank sends rank 0 one byte and waits for one back; rank 0 waits for each
// rank in turn and names the first that does not arrive within the timeout ("Rank N failed to
// pass monitoredBarrier in T ms"), or with waitAllRanks every one of them, then releases all.
// It runs on the caller's thread over the transport, outside the op queue and its numbering,
// so ranks that never call it do not put the group's collectives out of step.
#include <sstream>

#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

namespace {

constexpr uint32_t kStepArrive = 1;
constexpr uint32_t kStepRelease = 2;

std::string joinRanks(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

}  // namespace

void CpuEngine::monitoredBarrier(const OpInfo& info, uint64_t serial, bool waitAllRanks) {
  checkUsable(info);
  if (size_ == 1) return;
  const uint64_t base = collectiveTagBase(OpCode::MonitoredBarrier, serial);
  const auto timeout = info.timeout;
  const Deadline start = Clock::now();
  const Deadline deadline = start + timeout;
  const std::string ms = std::to_string(timeout.count()) + " ms";
  // Requests still posted when this returns write only into barrierBytes_, which outlives them.
  auto withdraw = [&](const RequestPtr& r) {
    if (r) transport_->cancel(r);
  };

  if (rank_ != 0) {
    char* mine = &barrierBytes_[2 * rank_];
    mine[0] = 1;
    auto sent = transport_->isend(0, base | kStepArrive, mine, 1);
    auto released = transport_->irecv(0, base | kStepRelease, mine + 1, 1);
    try {
      sent->wait(deadline);
      released->wait(deadline);
    } catch (const std::exception& e) {
      withdraw(released);
      throwDistError("Rank " + std::to_string(rank_) +
                     " successfully reached monitoredBarrier, but received errors while waiting for send/recv from "
                     "rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n" + e.what());
    }
    return;
  }

  std::vector<RequestPtr> arrivals(size_);
  for (int r = 1; r < size_; ++r) arrivals[r] = transport_->irecv(r, base | kStepArrive, &barrierBytes_[2 * r], 1);
  auto withdrawAll = [&] {
    for (auto& a : arrivals) withdraw(a);
  };
  std::vector<int> passed, failed;
  for (int r = 1; r < size_; ++r) {
    // Without waitAllRanks the ranks share one timeout; with it each rank gets the whole
    // timeout, or a slow rank would use up the time of every rank after it.
    Deadline until = waitAllRanks ? Clock::now() + timeout : deadline;
    if (!waitAllRanks && Clock::now() >= deadline) {
      withdrawAll();
      throwDistError("Rank 0 timed out in monitoredBarrier after " + ms + ".\n " +
                     (passed.empty() ? std::string("No ranks successfully processed in monitoredBarrier.")
                                     : "Successfully processed ranks: " + joinRanks(passed)));
    }
    try {
      arrivals[r]->wait(until);
      passed.push_back(r);
    } catch (const std::exception& e) {
      const std::string error = "[Rank 0]: Rank " + std::to_string(r) + " failed to pass monitoredBarrier in " + ms;
      if (!waitAllRanks) {
        withdrawAll();
        throwDistError(error + "\n Original exception: \n" + e.what());
      }
      log(LogLevel::Error, error + ": " + e.what());
      failed.push_back(r);
    }
  }
  if (!failed.empty()) {
    withdrawAll();
    throwDistError("[Rank 0]: Ranks " + joinRanks(failed) + " failed to pass monitoredBarrier in " + ms);
  }
  std::vector<RequestPtr> releases;
  for (int r = 1; r < size_; ++r) releases.push_back(transport_->isend(r, base | kStepRelease, &barrierBytes_[0], 1));
  try {
    waitAll(releases, Clock::now() + timeout);
  } catch (const std::exception& e) {
    throwDistError("[Rank 0]: releasing the ranks from monitoredBarrier failed: " + std::string(e.what()));
  }
}

}  // namespace myccl::cpu
