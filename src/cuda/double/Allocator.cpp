// The double's allocator: host memory with the CUDA caching allocator's stream-ordered reuse rule,
// poisoned when handed out and when freed, and a registry that NCCL ops consult to report reads
// and writes of memory released under them.
#include "Allocator.hpp"

#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "Machine.hpp"

namespace myccl::cuda::testdouble {

namespace {
constexpr size_t kGranule = 512;                  // size classes, like the caching allocator's
constexpr size_t kMaxPooled = size_t{256} << 20;  // freed bytes kept for detection
constexpr unsigned char kFreshPoison = 0xCB;      // uninitialized memory reads as garbage
constexpr unsigned char kFreedPoison = 0xDD;      // and freed memory as different garbage
}  // namespace

Allocator::~Allocator() {
  for (auto& [base, b] : blocks_) {
    if (b.state != State::Alive) std::free(reinterpret_cast<void*>(base));
  }
}

at::Tensor Allocator::empty(at::IntArrayRef sizes, at::ScalarType dtype, const Stream& s) {
  for (auto d : sizes) TORCH_CHECK(d >= 0, "myccl: cuda double: empty: negative dimension ", d, " in ", sizes);
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  const size_t capacity = std::max(kGranule, (nbytes + kGranule - 1) / kGranule * kGranule);
  uintptr_t base = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pool_.find(capacity);
    if (it != pool_.end() && !it->second.empty()) {
      base = it->second.front();
      it->second.pop_front();
      pooled_ -= capacity;
    }
  }
  if (base == 0) {
    void* p = std::aligned_alloc(64, capacity);
    TORCH_CHECK(p != nullptr, "myccl: cuda double: out of host memory allocating ", capacity, " bytes");
    base = reinterpret_cast<uintptr_t>(p);
  }
  std::memset(reinterpret_cast<void*>(base), kFreshPoison, capacity);
  {
    std::lock_guard<std::mutex> lk(mu_);
    Block b;
    b.capacity = capacity;
    b.nbytes = nbytes;
    b.stream = s;
    blocks_.insert_or_assign(base, std::move(b));
  }
  m_.count("allocations");
  std::weak_ptr<Machine> weak = m_.weak_from_this();
  auto deleter = [weak, base](void*) {
    // A machine already gone (or going) no longer runs streams: nothing can still use the memory.
    if (auto m = weak.lock(); m && !m->stopping) {
      m->allocator().drop(base);
    } else {
      std::free(reinterpret_cast<void*>(base));
    }
  };
  return at::from_blob(reinterpret_cast<void*>(base), sizes, deleter, at::TensorOptions(at::kCPU).dtype(dtype));
}

void Allocator::recordStream(const at::Tensor& t, const Stream& s) {
  if (!t.defined() || !t.has_storage()) return;
  const auto base = reinterpret_cast<uintptr_t>(t.storage().data());
  std::lock_guard<std::mutex> lk(mu_);
  auto it = blocks_.find(base);
  if (it == blocks_.end() || it->second.state != State::Alive) return;  // not ours: CUDA ignores it too
  Block& b = it->second;
  if (b.stream == s || std::find(b.uses.begin(), b.uses.end(), s) != b.uses.end()) return;
  b.uses.push_back(s);
  m_.count("record_streams");
}

void Allocator::drop(uintptr_t base) {
  std::vector<Stream> streams;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = blocks_.find(base);
    if (it == blocks_.end() || it->second.state != State::Alive) return;
    it->second.state = State::Releasing;
    streams.push_back(it->second.stream);
    streams.insert(streams.end(), it->second.uses.begin(), it->second.uses.end());
  }
  // Released once every stream has passed what it held at the drop: one item per stream, the
  // last to run frees.
  auto left = std::make_shared<std::atomic<size_t>>(streams.size());
  Machine* m = &m_;
  for (const auto& s : streams) {
    auto w = m_.worker(s);
    if (!w) {
      if (--*left == 0) release(base);
      continue;
    }
    w->enqueue([m, base, left] {
      if (--*left == 0) m->allocator().release(base);
    });
  }
}

void Allocator::release(uintptr_t base) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = blocks_.find(base);
  if (it == blocks_.end() || it->second.state != State::Releasing) return;
  Block& b = it->second;
  std::memset(reinterpret_cast<void*>(base), kFreedPoison, b.capacity);
  b.state = State::Freed;
  pool_[b.capacity].push_back(base);
  pooled_ += b.capacity;
  m_.count("frees");
  // Past the cap, the oldest freed blocks go back to the heap and leave the registry: memory the
  // heap may hand to anyone must not be reported as ours.
  while (pooled_ > kMaxPooled) {
    auto biggest = std::prev(pool_.end());
    if (biggest->second.empty()) {
      pool_.erase(biggest);
      continue;
    }
    const uintptr_t old = biggest->second.front();
    biggest->second.pop_front();
    pooled_ -= biggest->first;
    blocks_.erase(old);
    std::free(reinterpret_cast<void*>(old));
  }
}

void Allocator::check(const void* p, size_t n, const std::string& use, const Stream& on) {
  if (p == nullptr || n == 0) return;
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::string msg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = blocks_.upper_bound(a);
    if (it == blocks_.begin()) return;
    --it;
    const Block& b = it->second;
    if (a >= it->first + b.capacity || b.state == State::Alive) return;
    if (b.state == State::Releasing) {
      // Dropped, release queued: fine only if the release waits for this stream too.
      if (b.stream == on || std::find(b.uses.begin(), b.uses.end(), on) != b.uses.end()) return;
    }
    std::ostringstream os;
    os << "buffer " << p << " (" << b.nbytes << " bytes, allocated on " << streamName(b.stream)
       << ") was freed before " << streamName(on) << " ran " << use;
    if (b.state == State::Releasing) os << " (dropped without recordStream on " << streamName(on) << ")";
    msg = os.str();
  }
  m_.violation(msg);
}

}  // namespace myccl::cuda::testdouble
