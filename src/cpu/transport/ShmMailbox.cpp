// The mailbox: per ordered pair of a host's ranks, kMailboxSlots slots in the sender's segment that
// carry mid-size point-to-point messages (copied in, announced over TCP, copied out).
#include "myccl/cpu/transport/Shm.hpp"

#include <cerrno>
#include <cstring>

#include "myccl/Log.hpp"

namespace myccl::cpu {

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

}  // namespace myccl::cpu
