// The shared-memory group of one host's ranks: setup (every rank maps every rank's segment, then
// the names go) and the step protocol (a rank posts step s when what it wrote for s is in place;
// peers wait for it spinning, then on a futex, watching the peer's TCP link for a death).
#include "myccl/cpu/transport/Shm.hpp"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "ShmLayout.hpp"
#include "myccl/Log.hpp"
#include "myccl/cpu/transport/Net.hpp"

namespace myccl::cpu {

int usableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

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
  testRecheckDelay_ = std::chrono::milliseconds(opts.testRecheckDelayMs);
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

// ---- the step protocol ---------------------------------------------------------------------

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

bool ShmGroup::allAgree(uint32_t step) const {
  const StepDesc& mine = ctrl(rank_)->desc[step % 4];
  if (mine.agree[0] == 0) return false;  // this rank offered nothing
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const StepDesc& theirs = ctrl(r)->desc[step % 4];
    if (theirs.agree[0] != mine.agree[0] || theirs.agree[1] != mine.agree[1]) return false;
  }
  return true;
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
    if (testRecheckDelay_.count() > 0) std::this_thread::sleep_for(testRecheckDelay_);
    if (monitor_) {
      std::string why = monitor_(groupRanks_[peer]);
      // Between the check above and this one the peer may have posted the step, finished its op
      // and left (this thread was descheduled): what it posted stands, as what a TCP peer sent
      // before its goodbye does, and its segment stays mapped here. Look again before failing.
      if (!why.empty()) {
        if (ok()) return;
        throw CommError(CommErrorKind::PeerGone, why, groupRanks_[peer]);
      }
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      if (ok()) return;
      throw CommError(CommErrorKind::Timeout, "Timed out", groupRanks_[peer]);
    }
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
