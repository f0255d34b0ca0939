// Registered memory: segments a rank publishes in its control block's slots (allocate_tensor's
// tensors) so that peers on the host map them and read or write the rank's tensors in place.
#include "myccl/cpu/transport/Shm.hpp"

#include <sys/mman.h>

#include <cstring>

#include "ShmLayout.hpp"

namespace myccl::cpu {

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

}  // namespace myccl::cpu
