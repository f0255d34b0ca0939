// The double's communicators: creation and split through the store (settled when polled, so a
// nonblocking creation needs no thread), state and errors, finalize, destroy and abort, with
// the violations NCCL would answer with a hang or a crash.
#include <algorithm>
#include <cstring>
#include <thread>
#include <random>
#include <sstream>

#include "NcclApi.hpp"

namespace myccl::cuda::testdouble {

std::shared_ptr<NcclState> Machine::nccl() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!nccl_) nccl_ = std::make_shared<NcclState>();
  return nccl_;
}

void Comm::fail(NcclResult r, const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (error == NcclResult::Success) error = r;
    lastError = why;
  }
  cv.notify_all();
}

namespace {

NcclCommHandle handleOf(const Comm* c) {
  // The handle is the Comm's address, opaque to callers; only this file turns it back.
  return reinterpret_cast<NcclCommHandle>(const_cast<Comm*>(c));
}

std::string hex(const char* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    const auto b = static_cast<unsigned char>(p[i]);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

std::string rankList(const std::vector<int>& ranks) {
  std::string s = "{";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "}";
}

}  // namespace

Use::Use(Machine& m, const std::shared_ptr<Comm>& c, const char* call) : c_(c) {
  const uint64_t me = threadNumber();
  uint64_t other = 0;
  if (c->user.compare_exchange_strong(other, me)) {
    owned_ = true;
    return;
  }
  if (other == me || c->overlapReported.exchange(true)) return;
  std::ostringstream os;
  os << "communicator " << c->name << " used from two threads at once: " << call << " on thread " << me
     << " while thread " << other << " is inside a call on it or holds it in an open group";
  m.violation(os.str());
}

Use::~Use() {
  if (owned_) c_->user.store(0);
}

void Use::keep(GroupState& g) {
  if (!owned_) return;
  owned_ = false;
  g.held.push_back(c_);
}

NcclResult DoubleNccl::getUniqueId(NcclUniqueId* id) {
  if (id == nullptr) return report(NcclResult::InvalidArgument, "ncclGetUniqueId: null id");
  // The first 16 bytes name the communicator's key space: a scrambled counter (distinct for
  // every id of this process, and readable as a name), then a salt drawn once per process.
  static const uint64_t salt = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }();
  static std::atomic<uint64_t> counter{0};
  // splitmix64's finalizer: a bijection, so distinct counters stay distinct.
  uint64_t z = salt + ++counter * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  std::mt19937_64 rng(z);
  for (size_t i = 16; i < sizeof id->internal; i += 8) {
    const uint64_t v = rng();
    std::memcpy(id->internal + i, &v, 8);
  }
  std::memcpy(id->internal, &z, 8);
  std::memcpy(id->internal + 8, &salt, 8);
  return NcclResult::Success;
}

NcclResult DoubleNccl::commInitRank(NcclCommHandle* comm, int nranks, const NcclUniqueId& id, int rank,
                                    const NcclCommConfig& config) {
  m_->requireDevice("ncclCommInitRank");
  if (comm == nullptr) return report(NcclResult::InvalidArgument, "ncclCommInitRank: null comm pointer");
  *comm = nullptr;
  const std::string key = "dbl/" + hex(id.internal, 16);
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return report(NcclResult::InvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) +
                                                   " is out of range for " + std::to_string(nranks) + " ranks");
  }
  auto c = makeComm(key, config.name ? config.name : "comm-" + key.substr(4, 8), store_, config.blocking);
  c->nranks = nranks;
  c->rank = rank;
  try {
    if (store_->add(key + "/claim" + std::to_string(rank), 1) > 1) {
      return report(NcclResult::InvalidUsage, "communicator " + c->name + ": rank " + std::to_string(rank) +
                                                  " joined twice (another process or thread already joined as "
                                                  "rank " + std::to_string(rank) + " with this id)");
    }
    store_->set(key + "/rank" + std::to_string(rank), bytesOf(std::to_string(nranks)));
    store_->add(key + "/joined", 1);
  } catch (const std::exception& e) {
    return setError(NcclResult::SystemError, std::string("ncclCommInitRank: the store failed: ") + e.what());
  }
  *comm = add(c);
  if (!config.blocking) return NcclResult::InProgress;
  return waitSettled(*c);
}

NcclResult DoubleNccl::commSplit(NcclCommHandle comm, int color, int key, NcclCommHandle* newcomm,
                                 const NcclCommConfig& config) {
  const char* call = "ncclCommSplit";
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto parent = enter(comm, call, &r);
  if (!parent) return r;
  Use use(*m_, parent, call);
  if ((r = usable(*parent, call)) != NcclResult::Success) return r;
  if (newcomm == nullptr) return report(NcclResult::InvalidArgument, "ncclCommSplit: null newcomm pointer");
  *newcomm = nullptr;
  if (color < -1) {
    return report(NcclResult::InvalidArgument,
                  "ncclCommSplit: color " + std::to_string(color) + " is negative (only -1, NCCL_SPLIT_NOCOLOR)");
  }
  uint64_t n = 0;
  int parentRank = 0, parentRanks = 0;
  {
    std::lock_guard<std::mutex> lk(parent->mu);
    n = parent->splits++;
    parentRank = parent->rank;
    parentRanks = parent->nranks;
  }
  const std::string base = parent->key + "/split" + std::to_string(n);
  try {
    parent->store->set(base + "/" + std::to_string(parentRank),
                       bytesOf(std::to_string(color) + " " + std::to_string(key)));
  } catch (const std::exception& e) {
    return setError(NcclResult::SystemError, std::string("ncclCommSplit: the store failed: ") + e.what(),
                    parent.get());
  }
  m_->count("splits");
  if (color == -1) return NcclResult::Success;  // in no new communicator
  const std::string suffix = "split" + std::to_string(n) + "." + std::to_string(color);
  auto c = makeComm(base + "c" + std::to_string(color), config.name ? config.name : parent->name + "/" + suffix,
                    parent->store, config.blocking);
  c->device = parent->device;
  c->split = true;
  c->splitBase = base;
  c->parentRanks = parentRanks;
  c->parentRank = parentRank;
  c->color = color;
  c->parentName = parent->name;
  *newcomm = add(c);
  if (!config.blocking) return NcclResult::InProgress;
  return waitSettled(*c);
}

NcclResult DoubleNccl::commGetAsyncError(NcclCommHandle comm, NcclResult* asyncError) {
  const char* call = "ncclCommGetAsyncError";
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  if (asyncError == nullptr) return report(NcclResult::InvalidArgument, "ncclCommGetAsyncError: null asyncError");
  Use use(*m_, c, call);
  *asyncError = state(*c);
  return NcclResult::Success;
}

NcclResult DoubleNccl::commCount(NcclCommHandle comm, int* count) {
  const char* call = "ncclCommCount";
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  if (count == nullptr) return report(NcclResult::InvalidArgument, "ncclCommCount: null count");
  Use use(*m_, c, call);
  NcclResult st = state(*c);
  if (st != NcclResult::Success) {
    // as NCCL: a communicator still being made (or failed) has no attributes to read yet
    return report(NcclResult::InvalidArgument, "ncclCommCount on communicator " + c->name +
                                                   " before its creation returned ncclSuccess");
  }
  *count = c->nranks;
  return NcclResult::Success;
}

NcclResult DoubleNccl::commFinalize(NcclCommHandle comm) {
  const char* call = "ncclCommFinalize";
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  Use use(*m_, c, call);
  if ((r = usable(*c, call)) != NcclResult::Success) return r;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    c->finalized = true;
    if (!c->blocking) return c->finished < c->launched ? NcclResult::InProgress : NcclResult::Success;
  }
  waitFinished(*c, call);
  return NcclResult::Success;
}

NcclResult DoubleNccl::commDestroy(NcclCommHandle comm) {
  const char* call = "ncclCommDestroy";
  if (comm == nullptr) return NcclResult::Success;  // as NCCL
  m_->requireDevice(call);
  NcclResult r = NcclResult::Success;
  auto c = enter(comm, call, &r);
  if (!c) return r;
  Use use(*m_, c, call);
  uint64_t pending = 0;
  bool finalized = false, inProgress = false;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    pending = c->launched - c->finished;
    finalized = c->finalized;
    inProgress = c->joining || c->busy;
  }
  if (inProgress) {
    // NCCL: the state must have reached ncclSuccess first; the communicator stays usable.
    return report(NcclResult::InvalidUsage,
                  std::string(call) + " on communicator " + c->name +
                      " while it is still in progress (ncclInProgress): poll ncclCommGetAsyncError until "
                      "ncclSuccess first");
  }
  if (pending > 0) {
    std::ostringstream os;
    if (finalized) {
      os << "ncclCommDestroy on communicator " << c->name << " before its ncclCommFinalize completed (" << pending
         << " launched operations not finished): poll ncclCommGetAsyncError until ncclSuccess first";
    } else {
      os << "ncclCommDestroy on communicator " << c->name << " with " << pending
         << " launched operations not finished and no ncclCommFinalize: NCCL finalizes implicitly here and "
            "blocks until they finish (forever if a peer is gone)";
    }
    m_->violation(os.str());
    waitFinished(*c, call);
  }
  c->destroyed = true;
  m_->count("comms_destroyed");
  return NcclResult::Success;
}

NcclResult DoubleNccl::commAbort(NcclCommHandle comm) {
  if (comm == nullptr) return NcclResult::Success;  // as NCCL
  auto c = find(comm);
  if (!c) {
    return report(NcclResult::InvalidArgument,
                  "ncclCommAbort: " + pointer(comm) + " is no communicator of this machine");
  }
  if (c->destroyed || c->aborted.exchange(true)) {
    return report(NcclResult::InvalidUsage, "ncclCommAbort on communicator " + c->name +
                                                " after ncclCommAbort or ncclCommDestroy, which free it "
                                                "(use after free)");
  }
  m_->count("aborts");
  c->fail(NcclResult::InvalidUsage, "communicator " + c->name + " was aborted (ncclCommAbort)");
  // Like NCCL, return once the communicator's running kernels have stopped: its items see the
  // flag within one poll.
  std::unique_lock<std::mutex> lk(c->mu);
  const auto until = Clock::now() + m_->hang();
  while (c->active > 0 && Clock::now() < until) c->cv.wait_for(lk, std::chrono::milliseconds(5));
  lk.unlock();
  // ... and, like NCCL's, only after tearing down the rest: later stream items (the events after
  // the stopped kernels) run meanwhile.
  std::this_thread::sleep_for(std::chrono::milliseconds(m_->opts.abortTailMs));
  return NcclResult::Success;
}

const char* DoubleNccl::errorString(NcclResult r) {
  switch (r) {
    case NcclResult::Success: return "no error";
    case NcclResult::UnhandledCudaError: return "unhandled cuda error (the double: a stream of another device)";
    case NcclResult::SystemError: return "unhandled system error (the double: its store failed)";
    case NcclResult::InternalError: return "internal error";
    case NcclResult::InvalidArgument: return "invalid argument";
    case NcclResult::InvalidUsage: return "invalid usage";
    case NcclResult::RemoteError: return "remote process exited or there was a network error";
    case NcclResult::InProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* DoubleNccl::lastError(NcclCommHandle comm) {
  // NCCL returns a buffer of its own that stays valid until the next call on the thread.
  thread_local std::string text;
  std::shared_ptr<Comm> c = comm ? find(comm) : nullptr;
  if (c) {
    std::lock_guard<std::mutex> lk(c->mu);
    text = c->lastError;
  }
  if (!c || text.empty()) {
    std::lock_guard<std::mutex> lk(st_->mu);
    text = st_->lastError;
  }
  return text.c_str();
}

std::string DoubleNccl::pointer(const void* p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

NcclResult DoubleNccl::setError(NcclResult r, const std::string& why, Comm* c) {
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    st_->lastError = why;
  }
  if (c != nullptr) {
    std::lock_guard<std::mutex> lk(c->mu);
    c->lastError = why;
  }
  return r;
}

// A misuse: a violation, and NCCL's result code with the text for lastError.
NcclResult DoubleNccl::report(NcclResult r, const std::string& why) {
  m_->violation(why);
  return setError(r, why);
}

std::shared_ptr<Comm> DoubleNccl::makeComm(const std::string& key, const std::string& name,
                                           const c10::intrusive_ptr<c10d::Store>& store, bool blocking) {
  auto c = std::make_shared<Comm>();
  c->machine = m_.get();
  c->key = key;
  c->name = name;
  c->store = store;
  c->blocking = blocking;
  const int d = m_->thread().device;
  c->device = d < 0 ? 0 : d;  // NCCL binds a communicator to the current device
  c->joining = true;
  c->joinStart = Clock::now();
  return c;
}

NcclCommHandle DoubleNccl::add(const std::shared_ptr<Comm>& c) {
  {
    std::lock_guard<std::mutex> lk(st_->mu);
    st_->comms.emplace(c.get(), c);
  }
  m_->count("comms_created");
  m_->count(c->blocking ? "comms_blocking" : "comms_nonblocking");
  return handleOf(c.get());
}

std::shared_ptr<Comm> DoubleNccl::find(NcclCommHandle h) {
  std::lock_guard<std::mutex> lk(st_->mu);
  auto it = st_->comms.find(h);
  return it == st_->comms.end() ? nullptr : it->second;
}

// The communicator behind `h` for `call`, or null with *r set: a null or unknown handle, or
// one used after abort or destroy (NCCL has freed it), is a violation.
std::shared_ptr<Comm> DoubleNccl::enter(NcclCommHandle h, const char* call, NcclResult* r) {
  if (h == nullptr) {
    *r = report(NcclResult::InvalidArgument, std::string(call) + ": the communicator is null");
    return nullptr;
  }
  auto c = find(h);
  if (!c) {
    *r = report(NcclResult::InvalidArgument,
                std::string(call) + ": " + pointer(h) + " is no communicator of this machine");
    return nullptr;
  }
  if (c->destroyed || c->aborted) {
    *r = report(NcclResult::InvalidUsage, std::string(call) + " on communicator " + c->name + " after " +
                                              (c->destroyed ? "ncclCommDestroy" : "ncclCommAbort") +
                                              ", which frees it (use after free)");
    return nullptr;
  }
  return c;
}

// Whether `call` may use the communicator now: not while a nonblocking call on it is in
// progress, not after finalize; a communicator in error returns its error.
NcclResult DoubleNccl::usable(Comm& c, const char* call) {
  std::string misuse;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    if (c.joining || c.busy) {
      misuse = std::string(call) + " on communicator " + c.name +
               " while it is still in progress (ncclInProgress): poll ncclCommGetAsyncError until ncclSuccess first";
    } else if (c.error != NcclResult::Success) {
      return c.error;
    } else if (c.finalized) {
      misuse = std::string(call) + " on communicator " + c.name + " after ncclCommFinalize";
    }
  }
  if (misuse.empty()) return NcclResult::Success;
  return report(NcclResult::InvalidUsage, misuse);
}

// ncclCommGetAsyncError: creation still settling, an in-progress launch or finalize, or the error.
NcclResult DoubleNccl::state(Comm& c) {
  const NcclResult r = settle(c);
  if (r != NcclResult::Success) return r;
  std::lock_guard<std::mutex> lk(c.mu);
  if (c.error != NcclResult::Success) return c.error;
  if (c.busy) {
    if (Clock::now() < c.busyUntil) return NcclResult::InProgress;
    c.busy = false;
  }
  if (c.finalized && !c.blocking && c.finished < c.launched) return NcclResult::InProgress;
  return NcclResult::Success;
}

NcclResult DoubleNccl::waitSettled(Comm& c) {
  NcclResult r = NcclResult::InProgress;
  (void)pollUntil([&] { return (r = settle(c)) != NcclResult::InProgress; }, [&] { return c.stopped(); },
                  std::chrono::hours(24), {});
  return r;
}

// Advances creation: all ranks joined (init), or all parent ranks' colors known (split).
NcclResult DoubleNccl::settle(Comm& c) {
  std::lock_guard<std::mutex> sg(c.settleMu);
  {
    std::lock_guard<std::mutex> lk(c.mu);
    if (!c.joining) return c.error;
  }
  if (c.stopped()) return NcclResult::InvalidUsage;
  try {
    return c.split ? settleSplit(c) : settleInit(c);
  } catch (const std::exception& e) {
    const std::string why = "communicator " + c.name + ": the store failed during creation: " + e.what();
    c.fail(NcclResult::RemoteError, why);
    std::lock_guard<std::mutex> lk(c.mu);
    c.joining = false;
    return NcclResult::RemoteError;
  }
}

NcclResult DoubleNccl::settleInit(Comm& c) {
  const int64_t joined = c.store->add(c.key + "/joined", 0);
  if (joined < c.nranks) {
    reportJoinHang(c, "creation", c.nranks, [&](int r) { return c.key + "/rank" + std::to_string(r); });
    return NcclResult::InProgress;
  }
  std::string disagree;
  for (int r = 0; r < c.nranks; ++r) {
    const std::string k = c.key + "/rank" + std::to_string(r);
    if (!c.store->check({k})) continue;
    const auto v = c.store->get(k);
    const std::string says(v.begin(), v.end());
    if (says != std::to_string(c.nranks)) disagree += ", rank " + std::to_string(r) + " says " + says;
  }
  return settled(c, disagree.empty() ? "" : "communicator " + c.name + ": ranks disagree on its size: rank " +
                                               std::to_string(c.rank) + " says " + std::to_string(c.nranks) + disagree);
}

NcclResult DoubleNccl::settleSplit(Comm& c) {
  std::vector<std::string> keys;
  for (int r = 0; r < c.parentRanks; ++r) keys.push_back(c.splitBase + "/" + std::to_string(r));
  if (!c.store->check(keys)) {
    reportJoinHang(c, "creation (a split of " + c.parentName + ")", c.parentRanks,
                   [&](int r) { return keys[static_cast<size_t>(r)]; });
    return NcclResult::InProgress;
  }
  // Members: the parent ranks of this color, ordered by (key, parent rank).
  std::vector<std::pair<int, int>> members;
  for (int r = 0; r < c.parentRanks; ++r) {
    const auto v = c.store->get(keys[static_cast<size_t>(r)]);
    std::istringstream in(std::string(v.begin(), v.end()));
    int color = 0, key = 0;
    in >> color >> key;
    if (color == c.color) members.emplace_back(key, r);
  }
  std::sort(members.begin(), members.end());
  {
    std::lock_guard<std::mutex> lk(c.mu);
    c.nranks = static_cast<int>(members.size());
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i].second == c.parentRank) c.rank = static_cast<int>(i);
    }
  }
  return settled(c, "");
}

NcclResult DoubleNccl::settled(Comm& c, const std::string& misuse) {
  int n = 0;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    c.joining = false;
    n = c.nranks;
  }
  m_->count("comm_nranks_" + std::to_string(n));
  if (misuse.empty()) return NcclResult::Success;
  m_->violation(misuse);
  c.fail(NcclResult::InvalidUsage, misuse);
  return NcclResult::InvalidUsage;
}

void DoubleNccl::reportJoinHang(Comm& c, const std::string& what, int ranks,
                                const std::function<std::string(int)>& keyOf) {
  if (c.joinHangReported || Clock::now() - c.joinStart <= m_->hang()) return;
  c.joinHangReported = true;
  std::vector<int> joined;
  for (int r = 0; r < ranks; ++r) {
    if (c.store->check({keyOf(r)})) joined.push_back(r);
  }
  m_->violation("hang: communicator " + c.name + " " + what + " joined by ranks " + rankList(joined) + " of " +
                std::to_string(ranks) + " for more than " + std::to_string(m_->opts.hangMs) + " ms");
  m_->count("hangs");
}

// Blocks until every launch of `c` has run (finalize, or destroy's implicit finalize).
void DoubleNccl::waitFinished(Comm& c, const char* call) {
  const auto start = Clock::now();
  bool reported = false;
  std::unique_lock<std::mutex> lk(c.mu);
  while (c.finished < c.launched && !c.stopped()) {
    c.cv.wait_for(lk, std::chrono::milliseconds(20));
    if (!reported && Clock::now() - start > m_->hang()) {
      reported = true;
      const std::string msg = std::string("hang: ") + call + " on communicator " + c.name + " waits for " +
                              std::to_string(c.launched - c.finished) + " launched operations for more than " +
                              std::to_string(m_->opts.hangMs) + " ms";
      lk.unlock();
      m_->violation(msg);
      lk.lock();
    }
  }
}

Runtime runtime(const std::shared_ptr<Machine>& m, c10::intrusive_ptr<c10d::Store> store) {
  TORCH_CHECK(m != nullptr, "myccl: cuda double: runtime() needs a machine");
  TORCH_CHECK(store, "myccl: cuda double: runtime() needs a store (the communicators' wire)");
  Runtime rt;
  rt.device = device(m);
  rt.nccl = std::make_shared<DoubleNccl>(m, std::move(store));
  rt.kind = "double";
  return rt;
}

}  // namespace myccl::cuda::testdouble
