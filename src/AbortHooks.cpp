// The abort-hook registry (AbortHooks.hpp).
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

}  // namespace myccl
