// NcclEngine: every op expressed as three phases on one stream (staging copies into contiguous
// buffers, the NCCL calls inside one group, copies back into the caller's tensors; the ops are
// in NcclOps.cpp, the communicators in Comms.cpp). This file: issuing and publishing Works,
// coalescing, sends to self, lifecycle. Works complete by event; the watchdog enforces timeouts.
#include <sstream>

#include "EngineImpl.hpp"

namespace myccl::cuda {

NcclEngine::Impl::Impl(c10::intrusive_ptr<c10d::Store> s, std::string keyPrefix, int r, int n, std::string g,
                       const Config& c, std::chrono::milliseconds t, Runtime runtime,
                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> rec)
    : store(std::move(s)),
      prefix(std::move(keyPrefix)),
      rank(r),
      size(n),
      group(std::move(g)),
      cfg(c),
      rt(std::move(runtime)),
      dev(*rt.device),
      timeout(t),
      timeoutFixed(t.count() > 0),
      recorder(std::move(rec)) {
  if (!timeoutFixed) timeout = store->getTimeout();
  WatchdogPolicy policy;
  policy.handling = static_cast<ErrorHandling>(cfg.asyncErrorHandling);
  policy.blockingWait = cfg.blockingWait;
  policy.hooks = std::move(hooks);
  policy.recorder = recorder;
  policy.dumpDir = cfg.flightRecorderDump;
  watchdog = std::make_shared<Watchdog>(rank, group, rt.device, policy);
  // The watchdog's thread starts with the first communicator, on that communicator's device.
}

bool NcclEngine::Impl::isCoalescing() {
  std::lock_guard<std::mutex> lk(coalesceMu);
  return coalescing;
}

void NcclEngine::Impl::checkOpen(const OpInfo& info) const {
  watchdog->throwIfFailed(info);
  if (closed) throwDistError("myccl: " + info.describe() + ": the group has been shut down");
}

NcclWorkPtr NcclEngine::Impl::makeWork(OpInfo info, std::vector<at::Tensor>&& inputs,
                                      std::vector<at::Tensor>&& outputs, c10::Device device) {
  auto w = c10::make_intrusive<NcclWork>(std::move(info), std::move(inputs), std::move(outputs), device, rt.device,
                                         watchdog, cfg.blockingWait);
  if (recorder) {
    const auto type = w->info().type;
    const bool p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV;
    w->setRecord(recorder, recorder->queued(w->info(), p2p));
  }
  return w;
}

NcclReduce NcclEngine::Impl::plan(const Reduction& red, const OpInfo& info, c10::Device device) {
  if (isFloat8(red.spec.dtype)) {
    const auto [version, capability] = float8Facts(device.index());
    checkFloat8(red.spec.dtype, argWhere(info), version, capability);
  }
  NcclReduce p = planReduce(red, argWhere(info));
  // The average of one rank is its value: a plain sum, which NCCL does for every type (its
  // one-rank path refuses ncclAvg of float8).
  if (size == 1 && p.op == kNcclAvg) p.op = kNcclSum;
  return p;
}

std::pair<int, int> NcclEngine::Impl::float8Facts(int device) {
  std::lock_guard<std::mutex> lk(factsMu);
  if (ncclVersion < 0) ncclVersion = rt.nccl->version();
  auto it = capabilityOf.find(device);
  if (it == capabilityOf.end()) it = capabilityOf.emplace(device, dev.computeCapability(device)).first;
  return {ncclVersion, it->second};
}

std::shared_ptr<Event> NcclEngine::Impl::pooledEvent(bool timing) {
  constexpr size_t kLook = 4;      // candidates looked at before making another
  constexpr size_t kMax = 1 << 12;  // past this many in flight, events are not kept
  std::lock_guard<std::mutex> lk(eventMu);
  auto& pool = eventPool[timing];
  size_t& next = eventNext[timing];
  for (size_t k = 0; k < std::min(kLook, pool.size()); ++k) {
    next = (next + 1) % pool.size();
    // Held by the pool alone: no Work (nor anything a Work gave it to) can still query it, and
    // no new holder can appear but through this lock.
    if (pool[next].use_count() == 1) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return pool[next];
    }
  }
  std::shared_ptr<Event> e(dev.newEvent(timing));
  if (pool.size() < kMax) pool.push_back(e);
  return e;
}

NcclEngine::Impl::Issued NcclEngine::Impl::run(c10::function_ref<void(Launch&)> prepare,
                                               c10::ArrayRef<NcclWorkPtr> works, c10::Device device,
                                               const Target& target, bool asyncOp, const OpInfo& info) {
  const Described where(info);  // the op's description, built only if an error names it
  const int idx = device.index();
  try {
    DeviceGuard deviceGuard(dev, idx);
    CommSlot& slot = slotFor(target, idx, Clock::now() + info.timeout, where);
    const Stream current = dev.currentStream(idx);
    const bool captured = dev.isCapturing(current);
    // A synchronous op runs on the caller's current stream itself (as torch's does): nothing to
    // order it after, no second stream for the allocator to know about.
    const Stream stream = asyncOp ? slot.stream : current;
    if (asyncOp) {
      // The op's stream starts after everything the caller enqueued so far (inputs are ready).
      slot.ready->record(current);
      slot.ready->block(stream);
    }
    const bool timing = cfg.enableTiming && !captured;
    std::shared_ptr<Event> start;
    if (timing) {
      start = pooledEvent(/*timing=*/true);
      start->record(stream);
    }
    Launch launch(dev, slot, stream);
    prepare(launch);
    launch.issue(Clock::now() + info.timeout, where);
    launch.finish();
    std::shared_ptr<Event> end = captured ? std::shared_ptr<Event>(dev.newEvent(false)) : pooledEvent(timing);
    end->record(stream);
    // A captured Work is never tracked (nothing sees it finish), so it cannot be what keeps its
    // tensors: those are recordStream'ed whatever the setting.
    if (asyncOp && (!cfg.avoidRecordStreams || captured)) {
      // The caller may drop its tensors at once; the allocator must not hand their memory to
      // the caller's stream before the op's stream is done with it. Once per storage (in place,
      // inputs and outputs are the same tensors; a block's Work repeats its ops' outputs).
      c10::SmallVector<const c10::StorageImpl*, 8> seen;
      auto once = [&](const at::Tensor& t) {
        if (!t.defined() || t.storage().nbytes() == 0) return;
        const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
        if (std::find(seen.begin(), seen.end(), s) != seen.end()) return;
        seen.push_back(s);
        dev.recordStream(t, stream);
      };
      for (const auto& w : works) {
        for (const auto& t : w->inputs()) once(t);
        for (const auto& t : w->outputs()) once(t);
      }
    }
    // (Otherwise each Work holds its tensors until the watchdog sees it finished, as torch's
    // stashes them: no allocator call per op.)
    lastDevice = idx;
    return Issued{std::move(start), std::move(end), stream, slot.comm, captured};
  } catch (const CommError& e) {
    failGroup(works, e.what(), e.kind() == CommErrorKind::Timeout);
    throwDistError(std::string("myccl: ") + e.what());
  } catch (const std::exception& e) {
    // Keep the exception's type (OutOfMemoryError, DistBackendError, ...) for the caller.
    failGroup(works, where + ": could not be issued: " + errorText(e), false);
    throw;
  }
}

void NcclEngine::Impl::publish(c10::ArrayRef<NcclWorkPtr> works, const Issued& where) {
  std::exception_ptr callbackError;
  for (const auto& w : works) {
    try {
      w->launched(where.start, where.end, where.stream, where.comm, where.captured);
    } catch (...) {
      if (!callbackError) callbackError = std::current_exception();  // a callback threw; the op is issued
    }
    if (!where.captured) watchdog->track(w);
  }
  if (callbackError) std::rethrow_exception(callbackError);
}

void NcclEngine::Impl::failGroup(c10::ArrayRef<NcclWorkPtr> works, const std::string& why, bool timedOut) {
  // A failure while issuing surfaces to the caller as an exception: nothing to take down.
  watchdog->fail(why, timedOut);
  for (const auto& w : works) {
    if (!w->isLaunched()) w->fail("myccl: " + why);
  }
}

NcclWorkPtr NcclEngine::Impl::admit(OpInfo&& info, c10::Device device, std::vector<at::Tensor>&& inputs,
                                    std::vector<at::Tensor>&& outputs, bool hostSync, bool groupOp) {
  checkOpen(info);
  if (agree && groupOp) agree(info);
  if (!timeoutFixed && timeout.load() != info.timeout) timeout = info.timeout;
  auto work = makeWork(std::move(info), std::move(inputs), std::move(outputs), device);
  if (hostSync) work->setHostSync();
  return work;
}

bool NcclEngine::Impl::defer(const NcclWorkPtr& work, Prepare& prepare, c10::Device device) {
  std::lock_guard<std::mutex> lk(coalesceMu);
  if (!coalescing) return false;
  MYCCL_CHECK(!deferredDevice || *deferredDevice == device, work->info().describe(),
              ": all CUDA ops of one coalescing block must use one device; this one uses ", device,
              ", earlier ones ", *deferredDevice);
  deferredDevice = device;
  work->setInBlock();
  deferred.push_back(Item{work, std::move(prepare)});
  return true;
}

void NcclEngine::Impl::issueOne(const NcclWorkPtr& work, PrepareRef prepare, c10::Device device, const Target& target,
                                bool asyncOp) {
  const OpInfo& info = work->info();
  const c10::ArrayRef<NcclWorkPtr> works(work);
  std::optional<Issued> issued;
  {
    std::lock_guard<std::mutex> lk(issueMu);
    checkOpen(info);
    issued.emplace(run([&](Launch& L) { prepare(L, *work); }, works, device, target, asyncOp, info));
  }
  publish(works, *issued);
}

void NcclEngine::Impl::dropDeferred(const std::string& why) {
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lk(coalesceMu);
    items.swap(deferred);
    deferredDevice.reset();
    coalescing = false;
  }
  for (auto& it : items) it.work->fail("myccl: " + it.work->info().describe() + ": not issued: " + why);
}

NcclEngine::WorkPtr NcclEngine::Impl::postSelf(const OpInfo& info, at::Tensor t, int tag, bool isSend) {
  checkOpen(info);
  const c10::Device device = dev.deviceOf(t);
  auto work = makeWork(info, isSend ? std::vector<at::Tensor>{t} : std::vector<at::Tensor>{},
                       std::vector<at::Tensor>{t}, device);
  DeviceGuard guard(dev, device.index());
  auto ready = std::shared_ptr<Event>(dev.newEvent());
  ready->record(dev.currentStream(device.index()));
  SelfPost mine{work, t, ready, device.index()};
  std::optional<SelfPost> other;
  {
    std::lock_guard<std::mutex> lk(selfMu);
    auto& theirs = isSend ? selfRecvs[tag] : selfSends[tag];
    if (theirs.empty()) {
      (isSend ? selfSends[tag] : selfRecvs[tag]).push_back(std::move(mine));
    } else {
      other = std::move(theirs.front());
      theirs.pop_front();
    }
  }
  // Until its partner is posted the op is pending: the watchdog bounds that by its timeout.
  if (!other) {
    watchdog->start(device.index());
    watchdog->track(work);
    return work;
  }
  const SelfPost& send = isSend ? mine : *other;
  const SelfPost& recv = isSend ? *other : mine;
  if (nbytesOf(send.tensor) != nbytesOf(recv.tensor) || send.tensor.scalar_type() != recv.tensor.scalar_type()) {
    std::ostringstream os;
    os << "myccl: " << argWhere(info) << ": a send to self and its receive (tag " << tag << ") differ: sent "
       << nbytesOf(send.tensor) << " bytes of " << send.tensor.scalar_type() << ", receiving " << nbytesOf(recv.tensor)
       << " bytes of " << recv.tensor.scalar_type();
    other->work->fail(os.str());
    TORCH_CHECK_VALUE(false, os.str());
  }
  std::lock_guard<std::mutex> lk(issueMu);
  if (!selfStream) selfStream = dev.newStream(device.index(), cfg.highPriorityStream);
  const Stream s = *selfStream;
  send.ready->block(s);
  recv.ready->block(s);
  dev.enqueue(s, [from = send.tensor, to = recv.tensor]() mutable { to.copy_(from.reshape(to.sizes())); });
  auto end = std::shared_ptr<Event>(dev.newEvent());
  end->record(s);
  if (!cfg.avoidRecordStreams) {
    dev.recordStream(send.tensor, s);
    dev.recordStream(recv.tensor, s);
  }
  watchdog->start(device.index());
  for (const SelfPost* p : {&send, &recv}) {
    p->work->launched(nullptr, end, s, nullptr, false);
    if (p == &mine) watchdog->track(p->work);  // the partner is tracked since it was posted
  }
  return work;
}

// ---- the engine -----------------------------------------------------------------------------

NcclEngine::NcclEngine(c10::intrusive_ptr<c10d::Store> store, std::string keyPrefix, int rank, int size,
                       std::string group, const Config& cfg, std::chrono::milliseconds timeout, Runtime runtime,
                       std::shared_ptr<AbortHooks> hooks, std::shared_ptr<Recorder> recorder)
    : impl_(std::make_unique<Impl>(std::move(store), std::move(keyPrefix), rank, size, std::move(group), cfg, timeout,
                                   std::move(runtime), std::move(hooks), std::move(recorder))) {}

NcclEngine::~NcclEngine() {
  if (!impl_->closed) abort("the process group was destroyed without shutdown()");
  impl_->watchdog->stop();
}

const Runtime& NcclEngine::runtime() const {
  return impl_->rt;
}

void NcclEngine::setAgreement(std::function<void(const OpInfo&)> agree) {
  impl_->agree = std::move(agree);
}

int NcclEngine::lastDevice() const {
  return impl_->lastDevice.load();
}

std::shared_ptr<Device> NcclEngine::deviceSeam() const {
  return impl_->rt.device;
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
  std::optional<c10::Device> device;
  {
    std::lock_guard<std::mutex> lk(impl_->coalesceMu);
    impl_->coalescing = false;
    items.swap(impl_->deferred);
    device.swap(impl_->deferredDevice);
  }
  if (items.empty()) return {};  // no CUDA op in the block
  std::vector<at::Tensor> outs;
  for (auto& it : items) {
    for (auto& t : it.work->outputs()) outs.push_back(t);
  }
  auto batch = impl_->makeWork(info, {}, std::move(outs), *device);
  try {
    impl_->checkOpen(info);
  } catch (const std::exception& e) {
    for (auto& it : items) it.work->fail("myccl: " + it.work->info().describe() + ": not issued: " + errorText(e));
    throw;
  }
  std::vector<NcclWorkPtr> works;
  works.reserve(items.size() + 1);
  for (auto& it : items) works.push_back(it.work);
  works.push_back(batch);
  auto prepareAll = [&items](Launch& L) {
    for (auto& it : items) it.prepare(L, *it.work);
  };
  std::optional<Impl::Issued> issued;
  {
    std::lock_guard<std::mutex> lk(impl_->issueMu);
    // A batch (batch_isend_irecv, or collectives) runs on the group's communicator, as torch's
    // does: its sends and receives may involve any ranks, self included.
    issued.emplace(impl_->run(prepareAll, works, *device, Target{}, /*asyncOp=*/true, info));
  }
  impl_->publish(works, *issued);
  return batch;
}

// ---- lifecycle -----------------------------------------------------------------------------

void NcclEngine::eagerConnect(at::Device device) {
  const int idx = device.has_index() ? device.index() : impl_->dev.current();
  OpInfo info;
  info.op = info.name = "eager_connect";
  info.rank = impl_->rank;
  info.group = impl_->group;
  info.timeout = impl_->timeout.load();
  std::lock_guard<std::mutex> lk(impl_->issueMu);
  impl_->checkOpen(info);
  try {
    DeviceGuard guard(impl_->dev, idx);
    impl_->groupSlot(idx, Clock::now() + info.timeout, info.describe());
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
  impl_->abortComms();  // those still being made
  impl_->watchdog->fail("rank " + std::to_string(impl_->rank) + ", group '" + impl_->group + "': " + why, false,
                        nullptr, /*userAbort=*/true);
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
    for (auto& [key, slot] : impl_->slots) {
      // false: an error or the deadline (a peer gone or aborted); the communicator was aborted instead.
      (void)slot->comm->finalize(deadline);
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

size_t NcclEngine::inFlight() const {
  return impl_->watchdog->outstanding();
}

}  // namespace myccl::cuda
