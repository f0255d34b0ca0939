// Coalescing blocks (torch's start_coalescing / end_coalescing, batch_isend_irecv): the ops of a
// block are issued together by the engines that hold them back (CUDA) and the block's Work
// covers them all. A block whose body raised is abandoned, never left open.
#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"

namespace myccl {

CoalescingGuard::CoalescingGuard(MycclBackend* b) : b_(b), unwinding_(std::uncaught_exceptions()) {}

CoalescingGuard::~CoalescingGuard() {
  if (std::uncaught_exceptions() > unwinding_) {
    try {
      b_->abandonCoalescing("an op of the block raised on rank " + std::to_string(b_->getRank()));
    } catch (...) {
    }
  }
}

void MycclBackend::abandonCoalescing(const std::string& why) {
  std::vector<c10::intrusive_ptr<c10d::Work>> held;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    if (!coalescing_) return;
    coalescing_ = false;
    held.swap(coalesced_);
  }
  logOnce("coalescing-abandoned", LogLevel::Warning,
          "group '" + group_ + "': a coalescing block was left without end_coalescing (" + why +
              "); its held CUDA ops are dropped and later ops run on their own");
  for (auto& e : engines_.all()) {
    try {
      e->startCoalescing();  // drops whatever the engine held back ...
      (void)e->endCoalescing(info(c10d::OpType::COALESCED, "coalesced", c10d::kUnsetTimeout, true, true));
    } catch (...) {
      // ... and issuing nothing cannot fail in a way the caller could act on.
    }
  }
}

void MycclBackend::startCoalescing() {
  bool open;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    open = coalescing_;
  }
  if (open) abandonCoalescing("a new block started before the previous one ended");
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    coalescing_ = true;
    coalesced_.clear();
  }
  for (auto& e : engines_.all()) e->startCoalescing();
}

c10::intrusive_ptr<c10d::Work> MycclBackend::endCoalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    MYCCL_CHECK(coalescing_, where("end_coalescing"), ": end_coalescing without start_coalescing");
    coalescing_ = false;
    works.swap(coalesced_);
  }
  auto i = info(c10d::OpType::COALESCED, "coalesced", c10d::kUnsetTimeout, true, true);
  c10::intrusive_ptr<c10d::Work> cudaBatch;
  for (auto& e : engines_.all()) {
    if (auto held = e->endCoalescing(i)) cudaBatch = held;
  }
  if (!cudaBatch) return record(combineWorks(std::move(i), std::move(works)));
  // The CUDA engine's batch Work covers every CUDA op of the block and keeps its Future
  // CUDA-aware; only CPU ops of the same block need combining with it.
  std::vector<c10::intrusive_ptr<c10d::Work>> cpuWorks;
  for (auto& w : works) {
    auto* mw = dynamic_cast<MycclWork*>(w.get());
    if (!mw || !mw->onDevice()) cpuWorks.push_back(w);
  }
  if (cpuWorks.empty()) return record(cudaBatch);
  cpuWorks.push_back(cudaBatch);
  return record(combineWorks(std::move(i), std::move(cpuWorks)));
}

}  // namespace myccl
