// The abort- and completion-hook registries (AbortHooks.hpp).
#include "myccl/AbortHooks.hpp"

#include <exception>
#include <vector>

#include "myccl/Log.hpp"

namespace myccl {

void AbortHooks::add(int64_t id, std::function<void()> hook) {
  std::lock_guard<std::mutex> lk(mu_);
  hooks_[id] = std::move(hook);
}

void AbortHooks::remove(int64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  hooks_.erase(id);
}

void AbortHooks::run(const std::string& why) {
  std::vector<std::pair<int64_t, std::function<void()>>> hooks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    hooks.assign(hooks_.begin(), hooks_.end());
  }
  for (auto& [id, hook] : hooks) {
    try {
      hook();
    } catch (const std::exception& e) {
      log(LogLevel::Warning, "abort hook " + std::to_string(id) + " raised: " + e.what() + " (abort: " + why + ")");
    } catch (...) {
      log(LogLevel::Warning, "abort hook " + std::to_string(id) + " raised (abort: " + why + ")");
    }
  }
}

void CompletionHooks::replace(const std::function<void(Map&)>& change) {
  std::lock_guard<std::mutex> lk(mu_);
  auto next = std::make_shared<Map>(*hooks_);
  change(*next);
  count_.store(next->size(), std::memory_order_release);
  hooks_ = std::move(next);
}

void CompletionHooks::add(int64_t id, Hook hook) {
  replace([&](Map& m) { m[id] = std::move(hook); });
}

void CompletionHooks::remove(int64_t id) {
  replace([&](Map& m) { m.erase(id); });
}

void CompletionHooks::run(uint64_t completionKey, std::optional<float> durationMs) {
  std::shared_ptr<const Map> hooks;
  {
    std::lock_guard<std::mutex> lk(mu_);
    hooks = hooks_;
  }
  for (const auto& [id, hook] : *hooks) {
    try {
      hook(completionKey, durationMs);
    } catch (const std::exception& e) {
      log(LogLevel::Warning, "completion hook " + std::to_string(id) + " raised: " + e.what());
    } catch (...) {
      log(LogLevel::Warning, "completion hook " + std::to_string(id) + " raised");
    }
  }
}

}  // namespace myccl
