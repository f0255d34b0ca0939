// Op numbering and what every Work of the group gets: sequence numbers (collectives and
// point-to-point apart, the same on every rank), the op's timeout with torch's ephemeral
// extensions, and on the way out its completion hooks, extension and coalescing block.
#include "myccl/Errors.hpp"
#include "myccl/backend/ProcessGroupMyccl.hpp"

namespace myccl {

OpInfo MycclBackend::info(c10d::OpType type, const char* op, std::chrono::milliseconds timeout, bool asyncOp,
                          bool p2p) {
  OpInfo i;
  // Validate before taking a sequence number: a rejected call must not put this rank's
  // numbering out of step with its peers.
  MYCCL_CHECK_ARG(timeout == c10d::kUnsetTimeout || timeout.count() > 0, where(op), ": timeout must be positive, got ",
                  timeout.count(), " ms");
  i.asyncOp = asyncOp;
  i.type = type;
  i.op = op;
  i.name = op;
  i.seq = p2p ? p2pSeq_.fetch_add(1) : collSeq_.fetch_add(1) + 1;
  i.rank = rank_;
  i.size = size_;
  i.rankStart = rankStart_;
  i.rankStride = rankStride_;
  i.group = group_;
  i.timeout = (timeout == c10d::kUnsetTimeout) ? timeout_.load() : timeout;
  // Extensions are rare: the flag keeps the lock off every op's path.
  if (anyExtensions_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(extensionsMu_);
    // An extension ends when the first op created after it completes.
    std::erase_if(extensions_, [](const Extension& x) { return x.first && x.first->isCompleted(); });
    for (const auto& x : extensions_) i.timeout += x.extra;
    if (extensions_.empty()) anyExtensions_.store(false, std::memory_order_release);
  }
  return i;
}

c10::intrusive_ptr<c10d::Work> MycclBackend::record(c10::intrusive_ptr<c10d::Work> w) {
  if (!completionHooks_->empty()) {
    if (auto* mw = dynamic_cast<MycclWork*>(w.get())) mw->setCompletionHooks(completionHooks_);
  }
  if (anyExtensions_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(extensionsMu_);
    for (auto& x : extensions_)
      if (!x.first) x.first = w;
  }
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(coalesceMu_);
    if (coalescing_) coalesced_.push_back(w);
  }
  return w;
}

}  // namespace myccl
