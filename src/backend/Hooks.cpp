// torch's hooks on a backend, with torch's semantics: abort hooks (run before the group aborts
// on a failed op, on the thread that saw it), completion hooks (once per Work that completes
// successfully) and ephemeral timeout extensions.
#include "myccl/Errors.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"

namespace myccl {

#if MYCCL_HAS_ABORT_HOOKS
void MycclBackend::addEphemeralTimeout(const std::chrono::milliseconds& timeout) {
  MYCCL_CHECK_ARG(timeout.count() >= 0, where("add_ephemeral_timeout"), ": the extension must not be negative, got ",
                  timeout.count(), " ms");
  std::lock_guard<std::mutex> lk(extensionsMu_);
  extensions_.push_back({timeout, {}});
  anyExtensions_.store(true, std::memory_order_release);
}

void MycclBackend::registerAbortHook(int64_t hookId, c10d::AbortHook hook) {
  MYCCL_CHECK_ARG(hook != nullptr, where("register_abort_hook"), ": hook ", hookId, " is empty");
  abortHooks_->add(hookId, std::move(hook));
}

void MycclBackend::unregisterAbortHook(int64_t hookId) {
  abortHooks_->remove(hookId);
}
#endif

#if MYCCL_HAS_COMPLETION_HOOKS
void MycclBackend::registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) {
  MYCCL_CHECK_ARG(hook != nullptr, where("register_completion_hook"), ": hook ", hookId, " is empty");
  completionHooks_->add(hookId, [hook = std::move(hook)](uint64_t key, std::optional<float> ms) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    args.duration_ms = ms;
    hook(args);
  });
}

void MycclBackend::unregisterCompletionHook(int64_t hookId) {
  completionHooks_->remove(hookId);
}
#endif

}  // namespace myccl
