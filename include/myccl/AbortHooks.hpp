// The registries of torch's Backend hooks, keyed by the caller's id. Abort hooks
// (registerAbortHook) run, each once per failure, in id order, outside any engine lock, before a
// group that failed on a timeout or an error aborts, so users can capture debug state while the
// peers' links still exist. Completion hooks (registerCompletionHook, torch 2.15) run once per
// Work that completed successfully, with its completion key and duration (torch's flight
// recorder retires its entry with them). A hook that throws is logged and stops nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace myccl {

class AbortHooks {
 public:
  void add(int64_t id, std::function<void()> hook);
  void remove(int64_t id);  // unknown ids are ignored
  void run(const std::string& why);

 private:
  std::mutex mu_;
  std::map<int64_t, std::function<void()>> hooks_;
};

class CompletionHooks {
 public:
  using Hook = std::function<void(uint64_t completionKey, std::optional<float> durationMs)>;
  void add(int64_t id, Hook hook);
  void remove(int64_t id);
  // Without the lock: checked on every op's path.
  bool empty() const { return count_.load(std::memory_order_acquire) == 0; }
  void run(uint64_t completionKey, std::optional<float> durationMs);

 private:
  using List = std::vector<std::pair<int64_t, std::shared_ptr<const Hook>>>;

  std::mutex mu_;
  std::map<int64_t, std::shared_ptr<const Hook>> hooks_;
  // What run() reads: rebuilt by add/remove, so that running the hooks copies no callable.
  std::shared_ptr<const List> snapshot_;
  std::atomic<size_t> count_{0};
};

}  // namespace myccl
