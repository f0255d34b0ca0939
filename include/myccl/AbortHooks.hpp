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
  using Map = std::map<int64_t, Hook>;
  // Replaced whole by add/remove (copy on write): run() takes the current one under the lock and
  // calls the hooks without copying any.
  void replace(const std::function<void(Map&)>& change);

  std::mutex mu_;
  std::shared_ptr<const Map> hooks_ = std::make_shared<const Map>();
  std::atomic<size_t> count_{0};
};

}  // namespace myccl
