// Helper threads for one group's large copies and reductions (MYCCL_NUM_THREADS). With the
// default of 1 everything runs on the thread that executes the op; more threads only pay off
// when the machine has cores the training does not use.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace myccl::cpu {

class Parallel {
 public:
  explicit Parallel(int threads);
  ~Parallel();
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // fn(begin, end) over [0, total) in up to threads() pieces of at least minPiece; the caller
  // runs the first piece. Returns when every piece is done; rethrows the first exception.
  void run(size_t total, size_t minPiece, const std::function<void(size_t, size_t)>& fn);

 private:
  void work(int idx);
  void stopAll();
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, doneCv_;
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  std::vector<std::pair<size_t, size_t>> pieces_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace myccl::cpu
