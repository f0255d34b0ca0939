// NcclEngine: communicators per device (ids through the store), the NCCL stream per device,
// and every op expressed as three phases on one stream: staging copies into contiguous
// buffers, the NCCL calls inside one ncclGroupStart/End, copies back into the caller's
// tensors (the ops: NcclOps.cpp; the launch path: EngineImpl.hpp). Works complete by CUDA
// event; the watchdog enforces timeouts. This file: construction, coalescing, lifecycle.
#include "EngineImpl.hpp"

namespace myccl::cuda {

NcclEngine::NcclEngine(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string group,
                       const Config& cfg, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(std::move(store), rank, size, std::move(group), cfg, timeout)) {}

NcclEngine::~NcclEngine() {
  if (!impl_->closed) abort("the process group was destroyed without shutdown()");
  impl_->watchdog->stop();
}

// ---- coalescing ----------------------------------------------------------------------------

void NcclEngine::startCoalescing() {
  // A block left open by an exception never reached endCoalescing: its ops were never issued.
  impl_->dropDeferred("its coalescing block was abandoned (a new one started before end_coalescing)");
  std::lock_guard<std::mutex> lk(impl_->coalesceMu);
  impl_->coalescing = true;
}

NcclEngine::WorkPtr NcclEngine::endCoalescing(const OpInfo& info) {
  std::vector<Item> items;
  std::optional<c10::Device> dev;
  {
    std::lock_guard<std::mutex> lk(impl_->coalesceMu);
    impl_->coalescing = false;
    items.swap(impl_->deferred);
    dev.swap(impl_->deferredDevice);
  }
  if (items.empty()) {
    // No CUDA op in the block (or the engine was created inside it, after the start): nothing to cover.
    auto w = c10::make_intrusive<MycclWork>(info, std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
    w->markDone();
    return w;
  }
  std::vector<at::Tensor> outs;
  for (auto& it : items) {
    for (auto& t : it.work->result()) outs.push_back(t);
  }
  auto batch = impl_->makeWork(info, {}, outs, *dev);
  try {
    impl_->checkOpen(info);
  } catch (const std::exception& e) {
    for (auto& it : items) it.work->fail("myccl: " + it.work->info().describe() + ": not issued: " + errorText(e));
    throw;
  }
  std::optional<Impl::Issued> issued;
  {
    std::lock_guard<std::mutex> lk(impl_->issueMu);
    issued.emplace(impl_->run(items, *dev, /*asyncOp=*/true, info, {batch}));
  }
  impl_->publish(items, {batch}, *issued);
  return batch;
}

// ---- lifecycle -----------------------------------------------------------------------------

void NcclEngine::eagerConnect(at::Device device) {
  if (!device.has_index()) device = at::Device(at::kCUDA, c10::cuda::current_device());
  OpInfo info;
  info.op = info.name = "eager_connect";
  info.rank = impl_->rank;
  info.group = impl_->group;
  info.timeout = impl_->timeout.load();
  std::lock_guard<std::mutex> lk(impl_->issueMu);
  impl_->checkOpen(info);
  c10::cuda::CUDAGuard guard(device.index());
  try {
    impl_->deviceState(device, info.timeout, info.describe());
  } catch (const std::exception& e) {
    impl_->watchdog->fail(info.describe() + ": " + errorText(e), false);
    throw;
  }
}

void NcclEngine::setTimeout(std::chrono::milliseconds timeout) {
  impl_->timeout = timeout;
  impl_->timeoutFixed = true;
}

void NcclEngine::abort(const std::string& why) {
  // Deliberately without issueMu: an issuing thread may be the one that is stuck.
  impl_->closed = true;
  impl_->dropDeferred("the group was aborted");
  impl_->watchdog->fail("rank " + std::to_string(impl_->rank) + ", group '" + impl_->group + "': " + why, false);
  impl_->watchdog->stop();
}

void NcclEngine::shutdown() {
  std::lock_guard<std::mutex> lk(impl_->issueMu);
  if (impl_->closed.exchange(true)) return;
  impl_->dropDeferred("the group was shut down");
  auto& wd = *impl_->watchdog;
  if (!wd.failed()) {
    // Outstanding ops finish or hit their own timeout (the watchdog enforces it), then each
    // communicator is finalized (flushed, globally quiescent) and destroyed.
    wd.drain();
    const auto deadline = Clock::now() + impl_->timeout.load();
    for (auto& [idx, ds] : impl_->devices) {
      // false: an error or the deadline (a peer gone or aborted); the communicator was aborted instead.
      (void)ds->comm->finalize(deadline);
    }
  }
  wd.stop();
  wd.failOutstanding("the group was shut down before the op finished");
}

bool NcclEngine::failed() const {
  return impl_->watchdog->failed();
}

bool NcclEngine::timedOut() const {
  return impl_->watchdog->timedOut();
}

std::string NcclEngine::version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
  int major, minor, patch;
  if (v >= 10000) {
    major = v / 10000;
    minor = (v % 10000) / 100;
  } else {
    major = v / 1000;
    minor = (v % 1000) / 100;
  }
  patch = v % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace myccl::cuda
