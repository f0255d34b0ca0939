// A fork-join pool: persistent helpers woken per op, no allocation on the hot path.
#include "myccl/cpu/Parallel.hpp"

#include <pthread.h>

#include <algorithm>

namespace myccl::cpu {

Parallel::Parallel(int threads) {
  try {
    for (int i = 1; i < std::max(1, threads); ++i) {
      workers_.emplace_back([this, i] { work(i); });
      pthread_setname_np(workers_.back().native_handle(), "myccl-helper");
    }
  } catch (...) {
    stopAll();  // the threads already started must not outlive a constructor that failed
    throw;
  }
}

Parallel::~Parallel() {
  stopAll();
}

void Parallel::stopAll() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void Parallel::run(size_t total, size_t minPiece, const std::function<void(size_t, size_t)>& fn) {
  const size_t n = std::min<size_t>(threads(), std::max<size_t>(1, total / std::max<size_t>(1, minPiece)));
  if (n <= 1) {
    if (total) fn(0, total);
    return;
  }
  std::vector<std::pair<size_t, size_t>> pieces(n);
  const size_t step = (total + n - 1) / n;
  for (size_t i = 0; i < n; ++i) pieces[i] = {std::min(total, i * step), std::min(total, (i + 1) * step)};
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    pieces_ = pieces;
    pending_ = static_cast<int>(n) - 1;
    error_ = nullptr;
    ++generation_;
  }
  cv_.notify_all();
  std::exception_ptr mine;
  try {
    fn(pieces[0].first, pieces[0].second);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lk(mu_);
  doneCv_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void Parallel::work(int idx) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (static_cast<size_t>(idx) >= pieces_.size()) continue;  // this op needs fewer helpers
    auto piece = pieces_[idx];
    auto* fn = fn_;
    lk.unlock();
    std::exception_ptr err;
    try {
      (*fn)(piece.first, piece.second);
    } catch (...) {
      err = std::current_exception();
    }
    lk.lock();
    if (err && !error_) error_ = err;
    if (--pending_ == 0) doneCv_.notify_all();
  }
}

}  // namespace myccl::cpu
