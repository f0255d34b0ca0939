// The CUDA engine's communicators: the group's on each device (collective: all ranks make their
// n-th one at the same op), and a two-rank one per peer pair for point-to-point (made by those
// two alone, so a send between two ranks never waits for the others, and each pair has its own
// stream). Ids travel through the store under the incarnation's key space; before the (blocking)
// NCCL init every member announces itself there, so a member that never comes is named in a
// timeout error instead of hanging inside NCCL's init, and abort() can interrupt the wait.
#include <algorithm>
#include <cstring>

#include "EngineImpl.hpp"
#include "myccl/StoreWait.hpp"

namespace myccl::cuda {

void NcclEngine::Impl::awaitKeys(const std::vector<std::string>& keys, const std::vector<int>& ranks,
                                 Clock::time_point deadline, const std::string& what, const Described& where) {
  constexpr auto kSlice = std::chrono::milliseconds(100);
  // What the error reports: how long this wait lasted, to 10 ms (the op's timeout less the few
  // microseconds the op spent before getting here).
  const auto total = std::chrono::round<std::chrono::duration<int64_t, std::centi>>(deadline - Clock::now());
  for (;;) {
    if (closed) throwDistError("myccl: " + where + ": aborted while waiting for " + what);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      const std::string missing = missingRanks(*store, keys, ranks);
      throwDistError("myccl: " + where + ": Timed out after " + std::to_string(total.count() * 10) + " ms waiting for " +
                     (missing.empty() ? std::string("the other ranks") : "rank(s) " + missing) + " to reach " + what +
                     ": NCCL needs every member to make the communicator together. A rank that never calls a "
                     "matching op, is stuck, or has died leaves the others waiting here");
    }
    try {
      store->wait(keys, std::min<std::chrono::milliseconds>(left, kSlice));
      return;
    } catch (const c10::Error&) {
      // A slice ran out (or the store hiccuped): look at abort and the deadline, then go on.
    }
  }
}

CommSlot& NcclEngine::Impl::create(const std::string& key, const std::vector<int>& members, bool pair, int device,
                                   Clock::time_point deadline, const Described& where) {
  const int nranks = static_cast<int>(members.size());
  const int myRank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  // A fresh store key per attempt of this slot, so a communicator made again never reads an old id.
  const std::string base = prefix + "nccl/" + key + "/" + std::to_string(creations[key]++) + "/";
  NcclUniqueId id{};
  if (myRank == 0) {
    NcclResult r = rt.nccl->getUniqueId(&id);
    if (r != NcclResult::Success) {
      throwDistError("myccl: " + where + ": ncclGetUniqueId failed: " + ncclErrorText(*rt.nccl, r));
    }
    const auto* p = reinterpret_cast<const uint8_t*>(&id);
    store->set(base + "id", std::vector<uint8_t>(p, p + sizeof id));
  }
  store->set(base + "here/" + std::to_string(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys{base + "id"};
  std::vector<int> owners{members[0]};
  for (int m : members) {
    keys.push_back(base + "here/" + std::to_string(m));
    owners.push_back(m);
  }
  const std::string what = pair ? "its first point-to-point op with rank " + std::to_string(rank) + " on this group"
                                : "its first CUDA op on this group (or eager_connect)";
  awaitKeys(keys, owners, deadline, what, where);
  if (myRank != 0) {
    auto v = store->get(base + "id");
    MYCCL_CHECK(v.size() == sizeof id, where, ": the NCCL id under store key '", base, "id' has ", v.size(),
                " bytes, expected ", sizeof id);
    std::memcpy(&id, v.data(), sizeof id);
  }
  auto comm = std::make_shared<NcclComm>(rt, device, "myccl:" + group + ":" + key, !cfg.ncclNonblocking);
  {
    std::lock_guard<std::mutex> lk(creatingMu);
    creating.push_back(comm);
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lk(creatingMu);
    creating.erase(std::remove(creating.begin(), creating.end(), comm), creating.end());
  };
  try {
    if (closed) throwDistError("myccl: " + where + ": the group was aborted");
    comm->init(id, myRank, nranks, deadline, where);
  } catch (...) {
    forget();
    throw;
  }
  forget();
  return addSlot(key, std::move(comm), device, pair ? members[0] : -1);
}

CommSlot& NcclEngine::Impl::addSlot(const std::string& key, std::shared_ptr<NcclComm> comm, int device, int lowRank) {
  watchdog->start(device);
  watchdog->addComm(comm);
  auto slot = std::make_unique<CommSlot>();
  slot->key = key;
  slot->comm = std::move(comm);
  slot->device = device;
  slot->stream = rt.device->newStream(device, cfg.highPriorityStream);
  slot->ready = rt.device->newEvent();
  slot->lowRank = lowRank;
  auto& ref = *slot;
  slots[key] = std::move(slot);
  return ref;
}

namespace {

// The group communicators of a split, by device, in the order the parent made them.
struct NcclSplitParts final : SplitParts {
  std::vector<std::pair<int, std::shared_ptr<NcclComm>>> comms;
};

}  // namespace

std::shared_ptr<SplitParts> NcclEngine::splitParts(int color, int key, std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  OpInfo info;
  info.op = info.name = "split";
  info.rank = I.rank;
  info.group = I.group;
  info.timeout = timeout;
  const std::string where = info.describe();
  std::lock_guard<std::mutex> lk(I.issueMu);
  I.checkOpen(info);
  auto parts = std::make_shared<NcclSplitParts>();
  const auto deadline = Clock::now() + timeout;
  if (I.groupComms > 0) {
    // ncclCommSplit blocks until every rank of the parent calls it: meet in the store first, so a
    // rank that never comes is named in a timeout error instead of hanging inside NCCL.
    const std::string base = I.prefix + "nccl/split" + std::to_string(I.splits) + "/here/";
    I.store->set(base + std::to_string(I.rank), std::vector<uint8_t>{1});
    std::vector<std::string> keys;
    std::vector<int> owners;
    for (int r = 0; r < I.size; ++r) {
      keys.push_back(base + std::to_string(r));
      owners.push_back(r);
    }
    I.awaitKeys(keys, owners, deadline, "split_group on this group", where);
  }
  // Every rank of this group made its n-th group communicator at the same op: split them in that
  // order ("group0", "group1", ...), so that each ncclCommSplit meets its peers' (NCCL: collective).
  for (int n = 0; n < I.groupComms; ++n) {
    const std::string parentKey = "group" + std::to_string(n);
    CommSlot& parent = *I.slots.at(parentKey);
    auto child = std::make_shared<NcclComm>(I.rt, parent.device, "myccl:" + I.group + ":split" +
                                            std::to_string(I.splits) + ":" + parentKey, !I.cfg.ncclNonblocking);
    {
      std::lock_guard<std::mutex> clk(I.creatingMu);
      I.creating.push_back(child);  // abort() reaches it while NCCL makes it
    }
    auto forget = [&] {
      std::lock_guard<std::mutex> clk(I.creatingMu);
      I.creating.erase(std::remove(I.creating.begin(), I.creating.end(), child), I.creating.end());
    };
    try {
      DeviceGuard guard(I.dev, parent.device);
      const bool made = child->split(*parent.comm, color, key, deadline, where);
      forget();
      if (made) parts->comms.emplace_back(parent.device, std::move(child));
    } catch (const std::exception& e) {
      forget();
      // The parent's communicator took part in a collective that failed: the group cannot go on.
      I.watchdog->fail(where + ": " + errorText(e), false);
      throw;
    }
  }
  ++I.splits;
  if (color < 0 || parts->comms.empty()) return nullptr;
  return parts;
}

void NcclEngine::adoptSplit(std::shared_ptr<SplitParts> parts) {
  auto* p = dynamic_cast<NcclSplitParts*>(parts.get());
  MYCCL_CHECK(p != nullptr, "adopt_split (rank ", impl_->rank, "): not the CUDA engine's split");
  auto& I = *impl_;
  std::lock_guard<std::mutex> lk(I.issueMu);
  MYCCL_CHECK(I.groupComms == 0, "adopt_split (rank ", I.rank, "): the group already has communicators");
  for (auto& [device, comm] : p->comms) {
    const std::string key = "group" + std::to_string(I.groupComms++);
    I.slotAt(I.groupSlotOf, device) = &I.addSlot(key, comm, device, -1);
  }
}

CommSlot& NcclEngine::Impl::groupSlot(int device, Clock::time_point deadline, const Described& where) {
  if (CommSlot* known = slotAt(groupSlotOf, device)) return *known;
  MYCCL_CHECK(!rt.device->isCapturing(rt.device->currentStream(device)), where, ": the first CUDA op on cuda:",
              device, " of this group is being captured into a CUDA graph, and NCCL communicators cannot be created "
              "during capture; run one op (or eager_connect) on this device before capturing");
  // Keyed by the engine's creation count, not by the device index: rank r usually drives
  // cuda:r, so the index differs across ranks, while every rank makes its n-th group
  // communicator at the same op.
  const std::string key = "group" + std::to_string(groupComms);
  std::vector<int> members(size);
  for (int r = 0; r < size; ++r) members[r] = r;
  CommSlot& slot = create(key, members, /*pair=*/false, device, deadline, where);
  ++groupComms;
  slotAt(groupSlotOf, device) = &slot;
  return slot;
}

CommSlot& NcclEngine::Impl::pairSlot(int peer, int device, Clock::time_point deadline, const Described& where) {
  if (CommSlot* known = slotAt(pairSlotOf, peer)) {
    MYCCL_CHECK(known->device == device, where, ": point-to-point with rank ", peer, " uses cuda:", device,
                " but this pair's NCCL communicator was made on cuda:", known->device, "; use one device per rank");
    return *known;
  }
  MYCCL_CHECK(!rt.device->isCapturing(rt.device->currentStream(device)), where,
              ": the first point-to-point op with rank ", peer, " on cuda:", device,
              " is being captured into a CUDA graph, and NCCL communicators cannot be created during capture; "
              "run one such op before capturing");
  const int lo = std::min(rank, peer), hi = std::max(rank, peer);
  // The same key on both sides, whatever device each drives.
  const std::string key = "p2p" + std::to_string(lo) + "-" + std::to_string(hi);
  CommSlot& slot = create(key, {lo, hi}, /*pair=*/true, device, deadline, where);
  slotAt(pairSlotOf, peer) = &slot;
  connectPair(slot, deadline, where);
  return slot;
}

void NcclEngine::Impl::connectPair(CommSlot& slot, Clock::time_point deadline, const Described& where) {
  // NCCL connects a pair at its first send or receive, in a handshake in which each side offers
  // the directions its own first op needs. When both sides start with a send (isend to each
  // other, then irecv: common, and torch allows it) each reads the other's send offer as a
  // receive offer, and NCCL fails with "ncclSocketInit: connecting to address with family 0"
  // (seen on an H100 with NCCL 2.28 over sockets). So both directions are connected here, the same
  // way on both sides: one byte each way, in one group.
  const int other = slot.lowRank == rank ? 1 : 0;
  at::Tensor buf = rt.device->empty({2}, at::kByte, slot.stream);
  uint8_t* p = static_cast<uint8_t*>(buf.data_ptr());
  NcclComm& comm = *slot.comm;
  Nccl& api = comm.nccl();
  const std::string what = where + ": connecting the pair communicator '" + comm.name() + "'";
  auto lk = comm.lock(where);
  NcclCommHandle h = comm.get();
  checkNccl(api, api.groupStart(), "ncclGroupStart", what, h);
  NcclResult r = api.send(p, 1, NcclType::Uint8, other, h, slot.stream);
  NcclResult q = r == NcclResult::Success ? api.recv(p + 1, 1, NcclType::Uint8, other, h, slot.stream) : r;
  NcclResult e = api.groupEnd();  // always: this thread's group depth stays right
  checkNccl(api, r, "ncclSend", what, h);
  checkNccl(api, q, "ncclRecv", what, h);
  checkNccl(api, e, "ncclGroupEnd", what, h);
  comm.settle(lk, e, deadline, what);
  rt.device->recordStream(buf, slot.stream);  // freed for reuse only after the stream ran the exchange
}

CommSlot& NcclEngine::Impl::slotFor(const Target& target, int device, Clock::time_point deadline,
                                    const Described& where) {
  return target.kind == Target::Pair ? pairSlot(target.peer, device, deadline, where)
                                     : groupSlot(device, deadline, where);
}

void NcclEngine::Impl::abortComms() {
  std::vector<std::shared_ptr<NcclComm>> comms;
  {
    std::lock_guard<std::mutex> lk(creatingMu);
    comms = creating;
  }
  for (auto& c : comms) c->abort();
}

}  // namespace myccl::cuda
