// Shared-memory transport for the ranks of one host. Each local rank owns one segment (mode
// 0600, random name) holding its control block, two staging buffers and its point-to-point
// mailbox slots (ShmMailbox, committed on first use); every local rank
// maps every segment, after which the names are unlinked, so nothing stays in /dev/shm even
// if a process is killed. Ranks advance through numbered steps: a rank posts step s in its
// control block after writing that step's data, and waits for the peers it reads from to
// have posted s. Waiting spins briefly, then sleeps on a futex (no core burnt while idle).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

// One mapped POSIX shared-memory object.
class ShmSegment {
 public:
  // Creates a fresh segment with an unguessable name, mode 0600, backed by real pages
  // (fallocate) so running out of /dev/shm is an error here and never a SIGBUS later. Only the
  // first `commitBytes` get pages now; the rest must be commit()ted before it is touched.
  static std::unique_ptr<ShmSegment> create(size_t size, size_t commitBytes = SIZE_MAX);
  static std::unique_ptr<ShmSegment> open(const std::string& name, size_t size);
  // Removes the names that processes of this pid namespace which no longer exist left behind.
  static void sweepStale();
  ~ShmSegment();

  void unlink();  // remove the name; the mapping stays valid
  // Gives [offset, offset + len) real pages; false (errno set) if /dev/shm has no room.
  bool commit(size_t offset, size_t len);
  char* data() const { return static_cast<char*>(base_); }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, void* base, size_t size, bool owner, int fd = -1)
      : name_(std::move(name)), base_(base), size_(size), owner_(owner), fd_(fd) {}
  std::string name_;
  void* base_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = true;
  int fd_ = -1;  // kept while part of the segment is not committed yet
};

// Raised (on every local rank alike) when some rank cannot set up shared memory.
class ShmUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a rank publishes with each step, so peers detect at once that ranks disagree about the
// op (different op, sequence, size or dtype) instead of reading the wrong bytes.
struct StepDesc {
  uint64_t op = 0;   // collective tag base: op code + op sequence number
  uint64_t arg = 0;  // op-specific agreement value (e.g. element count and dtype)
  // An agreed op's offer (shmalg::allreduceAgreed): compared by allAgree(), never by checkDesc,
  // so ranks whose offers differ all learn it in step instead of failing the group.
  uint64_t agree[2] = {0, 0};
};

// How the local ranks of a new shared-memory group trade one string each, collectively (the
// segment names, then whether every mapping worked): `step` numbers the trades (0, 1); returns
// every local rank's string, by local index. Through the store, or, for a group split from
// another, over the links it shares with it (Bootstrap.cpp).
using ShmExchange = std::function<std::vector<std::string>(int step, const std::string& mine)>;

class ShmGroup {
 public:
  struct Options {
    int rank = 0;                  // rank within the local group (0..localSize-1)
    std::vector<int> groupRanks;   // local index -> rank in the process group
    size_t stagingBytes = 1 << 20;  // each of the two staging buffers per rank
    int64_t spinUs = -1;            // -1: adapt to ranks per core
    std::chrono::milliseconds timeout{30000};
    // Bytes of each point-to-point mailbox slot (see ShmMailbox; 0: no mailbox). Every local
    // rank must use the same value, like stagingBytes: a rank whose geometry differs fails
    // the setup (and the group falls back to TCP).
    size_t mailboxSlotBytes = 0;
    // Testing only: a waiting thread pauses this long between finding a peer behind and asking
    // whether the peer is gone (the window in which the peer can finish and leave).
    int64_t testRecheckDelayMs = 0;
  };
  static constexpr int kMailboxSlots = 4;  // per ordered pair of local ranks

  // Collective over the local ranks: create, publish, map, unlink.
  ShmGroup(const ShmExchange& exchange, Options opts);
  ~ShmGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int groupRank(int local) const { return groupRanks_[local]; }
  size_t stagingBytes() const { return staging_; }

  // Staging buffer `which` (0/1) of local rank `r`.
  char* buffer(int r, int which) const;
  // Four words rank r publishes with `step` (indexed by step parity, like the buffers).
  uint64_t* scratch(int r, uint32_t step) const;

  // Step protocol. begin() returns the next step number after making sure every peer has
  // finished reading the data of two steps ago (whose buffers this step may overwrite).
  uint32_t begin(const StepDesc& d, Deadline deadline);
  void post(uint32_t step);
  // Waits until local rank `peer` posted `step`, and checks it runs the same op.
  void wait(int peer, uint32_t step, Deadline deadline);
  void waitAll(uint32_t step, Deadline deadline);
  // After waitAll(step): whether every rank published the same nonzero offer with it (the same
  // answer on every rank, since each compares the same values).
  bool allAgree(uint32_t step) const;

  // ---- point-to-point mailbox slots (used through ShmMailbox) ----
  size_t mailboxSlotBytes() const { return mailboxSlot_; }
  // Slot `k` of messages from local rank `owner` to local rank `dest` (owner's segment), and
  // its state word (0 free, 1 being filled, 2 holds a message the receiver has not taken).
  char* mailboxData(int owner, int dest, int k) const;
  // Gives this rank's slot to `dest` real pages (before its first use); false: no room.
  bool commitMailbox(int dest, int k);
  std::atomic<uint32_t>* mailboxState(int owner, int dest, int k) const;

  // ---- registered memory (zero copy) ----
  // A place in some rank's registered memory, as published to peers.
  struct Region {
    int32_t slot = -1;  // -1: not registered
    uint32_t gen = 0;
    uint64_t offset = 0;
  };
  // Shared memory this rank's peers can read directly (tensors from allocateTensor): a fresh
  // segment registered in this rank's table, or nullptr if the table is full. The caller
  // keeps the mapping alive (it may outlive the group) and calls release() when done.
  std::shared_ptr<ShmSegment> allocate(size_t nbytes);
  void release(const void* ptr);
  // Whether [p, p+n) lies in this rank's registered memory.
  Region locate(const void* p, size_t n) const;
  // Pointer, in this process, to `r` of local rank `peer` (maps the peer's segment on first use).
  char* resolve(int peer, const Region& r);
  static void packRegion(const Region& r, uint64_t* words);
  static Region unpackRegion(const uint64_t* words);

  // Liveness: returns a reason if the peer is known to be gone (wired to the TCP links,
  // which the kernel closes when a process dies). Checked while waiting.
  void setPeerMonitor(std::function<std::string(int groupRank)> monitor) { monitor_ = std::move(monitor); }
  // How to name a StepDesc in error messages (the transport does not know op names).
  void setDescriber(std::function<std::string(const StepDesc&)> d) { describer_ = std::move(d); }
  // Makes every current and future wait fail at once (group aborted).
  void abort(const std::string& why);

 private:
  struct Ctrl;
  Ctrl* ctrl(int r) const;
  size_t mailboxOffset() const;  // where a segment's mailbox area starts
  void waitSlow(int peer, uint32_t step, Deadline deadline);
  void checkDesc(int peer, uint32_t step) const;

  struct Owned {
    std::shared_ptr<ShmSegment> seg;
    int slot;
    uint32_t gen;
  };
  struct Mapped {
    uint32_t gen = 0;
    std::unique_ptr<ShmSegment> seg;
  };

  int rank_;
  int size_;
  std::vector<int> groupRanks_;
  mutable std::mutex regMu_;       // owned_ and this rank's table
  std::vector<Owned> owned_;
  std::mutex mapMu_;                         // mapped_
  std::vector<std::vector<Mapped>> mapped_;  // [peer][slot]
  size_t staging_;
  size_t mailboxSlot_ = 0;
  size_t mailboxStates_ = 0;  // bytes of the state words' area, page-rounded
  size_t segBytes_;
  std::unique_ptr<ShmSegment> mine_;
  std::vector<std::unique_ptr<ShmSegment>> peers_;
  std::vector<char*> bases_;
  uint32_t step_ = 0;
  int64_t spinNs_;
  bool yieldFirst_;
  std::chrono::milliseconds testRecheckDelay_{0};
  std::function<std::string(int)> monitor_;
  std::function<std::string(const StepDesc&)> describer_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abortMu_;
  std::string abortReason_;
};

// Point-to-point payloads between the ranks of one host, for the TCP transport: every rank
// owns ShmGroup::kMailboxSlots slots per local peer in its segment. The sender claims a free
// slot, copies its message in and announces it on its TCP link, which keeps the message order,
// tag matching and liveness; the receiver copies it out and frees the slot. Two copies through
// cache-resident memory instead of a loopback socket's kernel copies and wake-ups. Slots are a
// fast path, never a queue: with none free a message goes over the socket as before.
class ShmMailbox {
 public:
  explicit ShmMailbox(std::shared_ptr<ShmGroup> group);
  size_t slotBytes() const { return group_->mailboxSlotBytes(); }
  // Whether `peer` (a rank of the process group) has slots with this rank.
  bool reaches(int peer) const { return peer >= 0 && peer < static_cast<int>(local_.size()) && local_[peer] >= 0; }
  // Sender: claims a free slot to `peer` and copies `n` (<= slotBytes) bytes into it; -1 when
  // every slot to that peer still holds a message.
  int put(int peer, const void* data, size_t n);
  // Sender: frees a slot it filled but could not announce.
  void unclaim(int peer, int slot);
  // Receiver: whether `slot` of messages from `peer` holds an announced message.
  bool holds(int peer, int slot) const;
  // Receiver: copies `n` bytes of the message in `slot` from `peer` to `dst` and frees the slot.
  void take(int peer, int slot, void* dst, size_t n);
  // Receiver: frees the slot without reading it (a receive that refused the message).
  void drop(int peer, int slot);

 private:
  std::atomic<uint32_t>* state(int owner, int dest, int slot) const;
  std::shared_ptr<ShmGroup> group_;
  std::vector<int> local_;  // process-group rank -> local index (-1: another host)
  // Whether this rank's slot [dest * kMailboxSlots + k] has its pages: each is committed on
  // first use, so groups that send nothing point-to-point cost no memory. Touched only by the
  // thread that holds the slot.
  std::vector<char> committed_;
};

// Online CPUs this process may run on.
int usableCpus();

}  // namespace myccl::cpu
