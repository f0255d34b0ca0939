// Stopping a worker thread from wherever the stop runs: joined, or detached when the stop runs
// on that very thread (a completion callback that shuts its own group down), which then leaves
// its loop on its own.
#pragma once

#include <thread>

namespace myccl {

inline void joinOrDetach(std::thread& t) {
  if (!t.joinable()) return;
  if (t.get_id() == std::this_thread::get_id()) {
    t.detach();
  } else {
    t.join();
  }
}

}  // namespace myccl
