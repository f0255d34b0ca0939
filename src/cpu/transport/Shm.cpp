// Shared-memory segments and the step protocol between the ranks of one host.
#include "myccl/cpu/transport/Shm.hpp"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "myccl/Log.hpp"
#include "myccl/cpu/transport/Net.hpp"

namespace myccl::cpu {

namespace {

constexpr uint32_t kCtrlMagic = 0x4d434353;  // "MCCS"
constexpr size_t kCtrlBytes = 4096;
constexpr int kSlots = 32;  // registered segments per rank

bool reached(uint32_t have, uint32_t want) {
  return static_cast<int32_t>(have - want) >= 0;
}

void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

int usableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// ---- segments ------------------------------------------------------------------------------

namespace {

// This process's pid namespace, in hex ("0" where it cannot be told): a pid in a segment's name
// means something only within it (containers may share /dev/shm and not their pids).
const std::string& pidNamespaceTag() {
  static const std::string tag = [] {
    struct stat st {};
    if (::stat("/proc/self/ns/pid", &st) != 0) return std::string("0");
    char buf[32];
    snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(st.st_ino));
    return std::string(buf);
  }();
  return tag;
}

// Whether `pid` is a process that still runs: not one that is gone, nor a zombie (dead, its exit
// status not yet collected by its parent).
bool processExists(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return true;  // cannot tell: keep its names
  char buf[512];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char* close = strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces and ')'
  return !(close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

}  // namespace

void ShmSegment::sweepStale() {
  // Names are "myccl-<pid>-<pid namespace>-<random>". A process killed while its name was still
  // in /dev/shm (during a group's setup, or with registered memory no peer has mapped yet) leaves
  // it behind, holding memory until reboot: remove those of processes of our pid namespace that
  // no longer exist. Live ones, other namespaces' and unreadable names are left alone.
  const std::string& ns = pidNamespaceTag();
  if (ns == "0") return;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("myccl-", 0) != 0) continue;
    const size_t a = n.find('-', 6), b = a == std::string::npos ? a : n.find('-', a + 1);
    if (b == std::string::npos || n.compare(a + 1, b - a - 1, ns) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(n.c_str() + 6, &end, 10);
    if (end != n.c_str() + a || pid <= 0) continue;
    if (!processExists(static_cast<pid_t>(pid))) shm_unlink(("/" + n).c_str());
  }
  closedir(d);
}

std::unique_ptr<ShmSegment> ShmSegment::create(size_t size, size_t commitBytes) {
  commitBytes = std::min(commitBytes, size);
  for (int attempt = 0; attempt < 8; ++attempt) {
    // The creator's pid (in its namespace) tells a leaked segment's owner (sweepStale); the random
    // part makes it unguessable.
    std::string name = "/myccl-" + std::to_string(getpid()) + "-" + pidNamespaceTag() + "-" + randomHex(12);
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    MYCCL_CHECK(fd >= 0, "shared memory: shm_open(", name, ") failed: ", strerror(errno),
                " (set MYCCL_TRANSPORT=tcp to run without shared memory)");
    fchmod(fd, 0600);  // exactly owner-only, whatever the umask
    int err = 0;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) err = errno;
    // Real pages now: a full /dev/shm must fail here, not as SIGBUS on first touch.
    if (!err && commitBytes > 0) err = posix_fallocate(fd, 0, static_cast<off_t>(commitBytes));
    void* base = err ? MAP_FAILED : mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!err && base == MAP_FAILED) err = errno;
    if (err || commitBytes == size) ::close(fd), fd = -1;
    if (err) {
      shm_unlink(name.c_str());
      MYCCL_CHECK(false, "shared memory: cannot allocate ", commitBytes, " bytes in /dev/shm: ", strerror(err),
                  " (free space in /dev/shm, lower MYCCL_SHM_BUFFER_BYTES, or set MYCCL_TRANSPORT=tcp)");
    }
    return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, size, true, fd));
  }
  MYCCL_CHECK(false, "shared memory: could not find a free segment name");
}

std::unique_ptr<ShmSegment> ShmSegment::open(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  MYCCL_CHECK(fd >= 0, "shared memory: cannot open a peer's segment ", name, ": ", strerror(errno));
  struct stat st {};
  fstat(fd, &st);
  if (static_cast<size_t>(st.st_size) < size) {
    ::close(fd);
    MYCCL_CHECK(false, "shared memory: peer segment ", name, " has ", st.st_size, " bytes, expected ", size);
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  MYCCL_CHECK(base != MAP_FAILED, "shared memory: mmap of ", name, " failed: ", strerror(err));
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, size, false));
}

bool ShmSegment::commit(size_t offset, size_t len) {
  if (fd_ < 0) return true;  // created fully committed
  const int err = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(len));
  errno = err;
  return err == 0;
}

ShmSegment::~ShmSegment() {
  if (fd_ >= 0) ::close(fd_);
  if (owner_) unlink();
  if (base_) munmap(base_, size_);
}

void ShmSegment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

// ---- the step protocol ---------------------------------------------------------------------

struct alignas(64) ShmGroup::Ctrl {
  std::atomic<uint32_t> seq;      // last posted step; also the futex word
  std::atomic<uint32_t> waiters;  // processes sleeping on `seq`
  uint32_t magic;
  int32_t pid;
  uint64_t staging;      // geometry, checked by every peer that maps this segment
  uint64_t mailboxSlot;
  char pad0[32];
  StepDesc desc[4];        // desc[s % 4]: what this rank runs at step s (peers are <= 1 step apart)
  uint64_t scratch[2][4];  // per-step words peers read, by step parity
  // Registered memory: segments peers may map to read this rank's tensors in place.
  struct Slot {
    std::atomic<uint32_t> gen;       // changes whenever the slot is (re)used or freed
    std::atomic<uint32_t> live;
    uint64_t size;
    std::atomic<uint64_t> mappedBy;  // bit per local rank that mapped it; the last one unlinks
    char name[64];
  } slots[kSlots];
};


ShmGroup::ShmGroup(const ShmExchange& exchange, Options opts)
    : rank_(opts.rank), size_(static_cast<int>(opts.groupRanks.size())), groupRanks_(opts.groupRanks) {
  staging_ = (std::max<size_t>(opts.stagingBytes, 4096) + 4095) / 4096 * 4096;
  if (size_ > 1 && opts.mailboxSlotBytes > 0) {
    mailboxSlot_ = (opts.mailboxSlotBytes + 4095) / 4096 * 4096;
    // One cache line per state word: a receiver freeing one slot does not disturb the sender
    // filling the next.
    mailboxStates_ = (static_cast<size_t>(size_) * kMailboxSlots * 64 + 4095) / 4096 * 4096;
  }
  segBytes_ = mailboxOffset() + mailboxStates_ +
              static_cast<size_t>(size_ > 1 ? size_ - 1 : 0) * kMailboxSlots * mailboxSlot_;
  const int cpus = usableCpus();
  if (opts.spinUs >= 0) {
    spinNs_ = opts.spinUs * 1000;
    yieldFirst_ = false;
  } else if (size_ <= cpus) {
    spinNs_ = 50'000;  // a peer on its own core answers within microseconds
    yieldFirst_ = false;
  } else {
    spinNs_ = 0;  // more ranks than cores: spinning only steals the core a peer needs
    yieldFirst_ = true;
  }

  // Every rank learns whether every other rank succeeded, so all of them reach the same
  // decision (shared memory or not) instead of some waiting for a segment that never comes.
  auto trade = [&](int step, const std::string& mine) {
    auto out = exchange(step, mine);
    for (int r = 0; r < size_; ++r) {
      if (!out[r].empty() && out[r][0] == '!') {
        throw ShmUnavailable("rank " + std::to_string(groupRanks_[r]) + ": " + out[r].substr(1));
      }
    }
    return out;
  };
  std::string failure;
  try {
    ShmSegment::sweepStale();  // what crashed processes of earlier groups left on this host
    // The mailbox slots get their pages when first used (ShmMailbox::put).
    mine_ = ShmSegment::create(segBytes_, mailboxOffset() + mailboxStates_);
    auto* c = reinterpret_cast<Ctrl*>(mine_->data());
    new (c) Ctrl();
    c->seq.store(0);
    c->waiters.store(0);
    c->magic = kCtrlMagic;
    c->pid = getpid();
    c->staging = staging_;
    c->mailboxSlot = mailboxSlot_;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  auto names = trade(0, failure.empty() ? mine_->name() : "!" + failure);

  peers_.resize(size_);
  bases_.assign(size_, nullptr);
  bases_[rank_] = mine_->data();
  try {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      peers_[r] = ShmSegment::open(names[r], segBytes_);
      bases_[r] = peers_[r]->data();
      MYCCL_CHECK(ctrl(r)->magic == kCtrlMagic, "shared memory: segment of rank ", groupRanks_[r], " is not initialised");
      MYCCL_CHECK(ctrl(r)->staging == staging_ && ctrl(r)->mailboxSlot == mailboxSlot_, "shared memory: rank ",
                  groupRanks_[r], " uses staging buffers of ", ctrl(r)->staging, " bytes and mailbox slots of ",
                  ctrl(r)->mailboxSlot, ", this rank ", staging_, " and ", mailboxSlot_,
                  " (MYCCL_SHM_BUFFER_BYTES and MYCCL_LOCAL_EAGER_BYTES must be the same on every rank)");
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Once everybody has mapped everything the names can go: from here on a crash leaves
  // nothing behind in /dev/shm.
  try {
    trade(1, failure.empty() ? std::string("ok") : "!" + failure);
  } catch (...) {
    mine_->unlink();
    throw;
  }
  mine_->unlink();
}

ShmGroup::~ShmGroup() {
  abort("shared-memory group destroyed");
}

ShmGroup::Ctrl* ShmGroup::ctrl(int r) const {
  static_assert(sizeof(Ctrl) <= kCtrlBytes, "control block too large");
  return reinterpret_cast<Ctrl*>(bases_[r]);
}

char* ShmGroup::buffer(int r, int which) const {
  return bases_[r] + kCtrlBytes + static_cast<size_t>(which) * staging_;
}

uint64_t* ShmGroup::scratch(int r, uint32_t step) const {
  return ctrl(r)->scratch[step & 1];
}

// A segment: control block, two staging buffers, then the mailbox's state words and slots.
size_t ShmGroup::mailboxOffset() const {
  return kCtrlBytes + 2 * staging_;
}

std::atomic<uint32_t>* ShmGroup::mailboxState(int owner, int dest, int k) const {
  char* states = bases_[owner] + mailboxOffset();
  return reinterpret_cast<std::atomic<uint32_t>*>(states + (static_cast<size_t>(dest) * kMailboxSlots + k) * 64);
}

char* ShmGroup::mailboxData(int owner, int dest, int k) const {
  const int d = dest < owner ? dest : dest - 1;  // no slots to oneself
  return bases_[owner] + mailboxOffset() + mailboxStates_ +
         (static_cast<size_t>(d) * kMailboxSlots + k) * mailboxSlot_;
}

bool ShmGroup::commitMailbox(int dest, int k) {
  const size_t off = static_cast<size_t>(mailboxData(rank_, dest, k) - bases_[rank_]);
  return mine_->commit(off, mailboxSlot_);
}

// ---- mailbox -------------------------------------------------------------------------------

namespace {
// kSlotOff: /dev/shm had no room for the slot's pages; it is never used.
constexpr uint32_t kSlotFree = 0, kSlotFilling = 1, kSlotFull = 2, kSlotOff = 3;
}

ShmMailbox::ShmMailbox(std::shared_ptr<ShmGroup> group) : group_(std::move(group)) {
  int maxRank = -1;
  for (int l = 0; l < group_->size(); ++l) maxRank = std::max(maxRank, group_->groupRank(l));
  local_.assign(maxRank + 1, -1);
  for (int l = 0; l < group_->size(); ++l)
    if (l != group_->rank()) local_[group_->groupRank(l)] = l;
  committed_.assign(static_cast<size_t>(group_->size()) * ShmGroup::kMailboxSlots, 0);
}

std::atomic<uint32_t>* ShmMailbox::state(int owner, int dest, int slot) const {
  return group_->mailboxState(owner, dest, slot);
}

int ShmMailbox::put(int peer, const void* data, size_t n) {
  const int me = group_->rank(), to = local_[peer];
  for (int k = 0; k < ShmGroup::kMailboxSlots; ++k) {
    uint32_t expect = kSlotFree;
    // Several threads may send to one peer at once: the exchange gives each slot one owner.
    if (!state(me, to, k)->compare_exchange_strong(expect, kSlotFilling, std::memory_order_acquire)) continue;
    char& committed = committed_[static_cast<size_t>(to) * ShmGroup::kMailboxSlots + k];
    if (!committed) {
      if (!group_->commitMailbox(to, k)) {
        logOnce("shm-mailbox-full", LogLevel::Warning,
                std::string("no room in /dev/shm for a point-to-point slot (") + strerror(errno) +
                    "); those messages go through TCP");
        state(me, to, k)->store(kSlotOff, std::memory_order_release);
        continue;
      }
      committed = 1;
    }
    std::memcpy(group_->mailboxData(me, to, k), data, n);
    state(me, to, k)->store(kSlotFull, std::memory_order_release);
    return k;
  }
  return -1;
}

void ShmMailbox::unclaim(int peer, int slot) {
  state(group_->rank(), local_[peer], slot)->store(kSlotFree, std::memory_order_release);
}

bool ShmMailbox::holds(int peer, int slot) const {
  return reaches(peer) && slot >= 0 && slot < ShmGroup::kMailboxSlots &&
         state(local_[peer], group_->rank(), slot)->load(std::memory_order_acquire) == kSlotFull;
}

void ShmMailbox::take(int peer, int slot, void* dst, size_t n) {
  const int from = local_[peer], me = group_->rank();
  std::memcpy(dst, group_->mailboxData(from, me, slot), n);
  state(from, me, slot)->store(kSlotFree, std::memory_order_release);
}

void ShmMailbox::drop(int peer, int slot) {
  state(local_[peer], group_->rank(), slot)->store(kSlotFree, std::memory_order_release);
}

// ---- registered memory ---------------------------------------------------------------------

std::shared_ptr<ShmSegment> ShmGroup::allocate(size_t nbytes) {
  std::lock_guard<std::mutex> lk(regMu_);
  Ctrl* c = ctrl(rank_);
  int slot = -1;
  for (int i = 0; i < kSlots && slot < 0; ++i)
    if (!c->slots[i].live.load()) slot = i;
  if (slot < 0) return nullptr;
  std::shared_ptr<ShmSegment> seg = ShmSegment::create(std::max<size_t>(nbytes, 64));
  auto& e = c->slots[slot];
  MYCCL_CHECK(seg->name().size() < sizeof(e.name), "shared memory: segment name too long");
  std::memset(e.name, 0, sizeof(e.name));
  std::memcpy(e.name, seg->name().data(), seg->name().size());
  e.size = seg->size();
  e.mappedBy.store(uint64_t{1} << rank_);
  const uint32_t gen = e.gen.load() + 1;
  e.gen.store(gen, std::memory_order_release);
  e.live.store(1, std::memory_order_release);
  if (size_ == 1) seg->unlink();
  owned_.push_back(Owned{seg, slot, gen});
  return seg;
}

void ShmGroup::release(const void* ptr) {
  std::lock_guard<std::mutex> lk(regMu_);
  for (auto it = owned_.begin(); it != owned_.end(); ++it) {
    if (it->seg->data() != ptr) continue;
    auto& e = ctrl(rank_)->slots[it->slot];
    e.live.store(0, std::memory_order_release);
    e.gen.fetch_add(1, std::memory_order_acq_rel);  // peers drop their mapping on next look
    it->seg->unlink();
    owned_.erase(it);  // the caller's reference keeps the mapping until it lets go
    return;
  }
}

ShmGroup::Region ShmGroup::locate(const void* p, size_t n) const {
  std::lock_guard<std::mutex> lk(regMu_);
  auto addr = reinterpret_cast<uintptr_t>(p);
  for (const auto& o : owned_) {
    auto base = reinterpret_cast<uintptr_t>(o.seg->data());
    if (addr >= base && addr + n <= base + o.seg->size()) return Region{o.slot, o.gen, addr - base};
  }
  return Region{};
}

char* ShmGroup::resolve(int peer, const Region& r) {
  if (peer == rank_) {
    std::lock_guard<std::mutex> lk(regMu_);
    for (const auto& o : owned_)
      if (o.slot == r.slot && o.gen == r.gen) return o.seg->data() + r.offset;
    throw CommError(CommErrorKind::Local, "registered buffer freed during an op");
  }
  std::lock_guard<std::mutex> lk(mapMu_);  // the engine thread and windows (on callers' threads)
  if (mapped_.empty()) mapped_.resize(size_);
  auto& table = mapped_[peer];
  if (table.empty()) table.resize(kSlots);
  MYCCL_CHECK(r.slot >= 0 && r.slot < kSlots, "shared memory: bad registered slot ", r.slot);
  Mapped& m = table[r.slot];
  if (!m.seg || m.gen != r.gen) {
    m.seg.reset();
    auto& e = ctrl(peer)->slots[r.slot];
    // The owner keeps the buffer alive for the whole op, so gen and name are stable here.
    MYCCL_CHECK(e.gen.load(std::memory_order_acquire) == r.gen && e.live.load(),
                "shared memory: rank ", groupRanks_[peer], " freed a buffer it is using in this op");
    std::string name(e.name, strnlen(e.name, sizeof(e.name)));
    m.seg = ShmSegment::open(name, e.size);
    m.gen = r.gen;
    const uint64_t all = (size_ >= 64) ? ~uint64_t{0} : ((uint64_t{1} << size_) - 1);
    const uint64_t before = e.mappedBy.fetch_or(uint64_t{1} << rank_);
    if ((before | (uint64_t{1} << rank_)) == all) shm_unlink(name.c_str());  // last mapper removes the name
  }
  return m.seg->data() + r.offset;
}

void ShmGroup::packRegion(const Region& r, uint64_t* w) {
  w[0] = static_cast<uint32_t>(r.slot) | (static_cast<uint64_t>(r.gen) << 32);
  w[1] = r.offset;
}

ShmGroup::Region ShmGroup::unpackRegion(const uint64_t* w) {
  return Region{static_cast<int32_t>(static_cast<uint32_t>(w[0])), static_cast<uint32_t>(w[0] >> 32), w[1]};
}

uint32_t ShmGroup::begin(const StepDesc& d, Deadline deadline) {
  const uint32_t s = ++step_;
  // Peers at step >= s-1 have finished reading everything of step s-2, whose buffers
  // (same parity as s) this step may overwrite.
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    if (!reached(ctrl(r)->seq.load(std::memory_order_acquire), s - 1)) waitSlow(r, s - 1, deadline);
    // Steps in which this rank read nothing from r (a broadcast root, say) were never checked:
    // r must have run the same thing at step s-1 too.
    if (s > 1) checkDesc(r, s - 1);
  }
  ctrl(rank_)->desc[s % 4] = d;
  return s;
}

void ShmGroup::post(uint32_t step) {
  Ctrl* c = ctrl(rank_);
  c->seq.store(step, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c->waiters.load(std::memory_order_relaxed) > 0) futexWakeAll(&c->seq);
}

void ShmGroup::wait(int peer, uint32_t step, Deadline deadline) {
  if (!reached(ctrl(peer)->seq.load(std::memory_order_acquire), step)) waitSlow(peer, step, deadline);
  checkDesc(peer, step);
}

void ShmGroup::waitAll(uint32_t step, Deadline deadline) {
  for (int r = 0; r < size_; ++r)
    if (r != rank_) wait(r, step, deadline);
}

void ShmGroup::checkDesc(int peer, uint32_t step) const {
  const StepDesc& theirs = ctrl(peer)->desc[step % 4];
  const StepDesc& mine = ctrl(rank_)->desc[step % 4];
  if (theirs.op == mine.op && theirs.arg == mine.arg) return;
  auto name = [&](const StepDesc& d) {
    if (describer_) return describer_(d);
    std::ostringstream os;
    os << "op 0x" << std::hex << d.op << " (arg 0x" << d.arg << ")";
    return os.str();
  };
  throw CommError(CommErrorKind::Protocol,
                  "rank " + std::to_string(groupRanks_[peer]) + " is running " + name(theirs) +
                      " while this rank runs " + name(mine),
                  groupRanks_[peer]);
}

void ShmGroup::waitSlow(int peer, uint32_t step, Deadline deadline) {
  Ctrl* c = ctrl(peer);
  auto ok = [&] { return reached(c->seq.load(std::memory_order_acquire), step); };
  if (yieldFirst_) {
    for (int i = 0; i < 32; ++i) {
      if (ok()) return;
      sched_yield();
    }
  } else if (spinNs_ > 0) {
    const auto until = Clock::now() + std::chrono::nanoseconds(spinNs_);
    do {
      for (int i = 0; i < 128; ++i) {
        if (ok()) return;
        cpuRelax();
      }
    } while (Clock::now() < until);
  }
  for (;;) {
    if (ok()) return;
    if (aborted_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lk(abortMu_);
      throw CommError(CommErrorKind::Aborted, abortReason_, -1);
    }
    if (monitor_) {
      std::string why = monitor_(groupRanks_[peer]);
      if (!why.empty()) throw CommError(CommErrorKind::PeerGone, why, groupRanks_[peer]);
    }
    const auto now = Clock::now();
    if (now >= deadline) throw CommError(CommErrorKind::Timeout, "Timed out", groupRanks_[peer]);
    c->waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = c->seq.load(std::memory_order_seq_cst);
    if (!reached(v, step)) {
      auto slice = std::min<std::chrono::nanoseconds>(std::chrono::milliseconds(20), deadline - now);
      futexWait(&c->seq, v, slice);
    }
    c->waiters.fetch_sub(1, std::memory_order_relaxed);
  }
}

void ShmGroup::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(abortMu_);
    if (aborted_.load()) return;
    abortReason_ = why;
    aborted_.store(true, std::memory_order_release);
  }
  // Wake our own sleepers; they notice `aborted_` (other processes notice through TCP).
  for (int r = 0; r < size_; ++r)
    if (bases_[r]) futexWakeAll(&ctrl(r)->seq);
}

}  // namespace myccl::cpu
