// Backend::registerAbortHook's registry: callbacks keyed by the caller's id, run (each once per
// failure, in id order, outside any engine lock) before a group that failed on a timeout or an
// error aborts, so users can capture debug state while the peers' links still exist. A hook that
// throws is logged and does not stop the others or the abort.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
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

}  // namespace myccl
