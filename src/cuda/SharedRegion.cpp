// Device memory shared by the processes of one host (SharedRegion.hpp): the order of the calls
// on the seam's Memory, and the cleanup when a step fails half way.
#include "myccl/cuda/SharedRegion.hpp"

#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <thread>

namespace myccl::cuda {

namespace {
size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The calls on a region's memory act on the current device's context: the region's device is
// current for them, and the caller's device current again afterwards (a tensor made on cuda:1
// must not move the caller's later work there).
class DeviceScope {
 public:
  DeviceScope(Memory& mem, int device) : restore_(mem.useDevice(device)) {}
  ~DeviceScope() {
    try {
      restore_();
    } catch (const std::exception&) {
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  std::function<void()> restore_;
};
}  // namespace

SharedRegion::SharedRegion(std::shared_ptr<Memory> memory, int device, size_t bytes)
    : mem_(std::move(memory)), device_(device) {
  TORCH_CHECK(mem_, "myccl: shared device memory: this build has no CUDA memory (no NCCL engine, no test double)");
  DeviceScope scope(*mem_, device_);
  std::string why;
  TORCH_CHECK(mem_->shareable(device, &why), "myccl: shared device memory: cuda:", device,
              " cannot share memory between processes: ", why);
  gran_ = mem_->granularity(device);
  bytes_ = roundUp(bytes, gran_);
  if (bytes_ > 0) {
    own_ = mem_->create(device, bytes_);
    haveOwn_ = true;
  }
}

namespace {

// One thread per process that gives shared memory back, in order; never destroyed (a release
// still queued at exit is the driver's to finish).
class Releaser {
 public:
  static Releaser& get() {
    static Releaser* r = new Releaser();
    return *r;
  }
  void add(std::function<void()> job) {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.push_back(std::move(job));
    ++pending_;
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return pending_ == 0; });
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        job();
      } catch (const std::exception&) {  // a failed release leaks address space or a handle; the double reports it
      }
      std::lock_guard<std::mutex> lk(mu_);
      --pending_;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t pending_ = 0;
  bool started_ = false;
};

}  // namespace

void releaseLater(std::shared_ptr<Memory> memory, std::vector<int> devices, std::function<void()> release) {
  Releaser::get().add([memory = std::move(memory), devices = std::move(devices), release = std::move(release)] {
    for (int device : devices) {
      try {
        memory->synchronize(device);  // kernels queued on the memory before its last tensor went
      } catch (const std::exception&) {
      }
    }
    std::function<void()> restore;
    try {
      if (!devices.empty()) restore = memory->useDevice(devices.front());  // a context for the calls
    } catch (const std::exception&) {
    }
    release();
    try {
      if (restore) restore();
    } catch (const std::exception&) {
    }
  });
}

void quiesceSharedMemory() {
  Releaser::get().drain();
}

namespace {

// One registered host range, shared by every view of its storage.
struct HostRegistration {
  void* dbase = nullptr;  // the devices' address of it
  size_t bytes = 0;
  int views = 0;          // live views
  uint64_t drops = 0;     // times `views` fell to 0: a queued unregistration acts only for the latest
  std::set<int> devices;  // devices views were made for: synchronised before it is unregistered
  at::Tensor keep;        // the host memory stays while registered
};

std::mutex hostMu;
std::map<void*, HostRegistration>& hostRegistrations() {
  static auto* r = new std::map<void*, HostRegistration>();  // never destroyed (releases may run at exit)
  return *r;
}

void dropHostView(const std::shared_ptr<Memory>& mem, void* base) {
  std::vector<int> devices;
  uint64_t drop = 0;
  {
    std::lock_guard<std::mutex> lk(hostMu);
    auto it = hostRegistrations().find(base);
    if (it == hostRegistrations().end() || --it->second.views > 0) return;
    drop = ++it->second.drops;
    devices.assign(it->second.devices.begin(), it->second.devices.end());
  }
  // after the kernels still queued on the views, off this thread
  releaseLater(mem, std::move(devices), [mem, base, drop] {
    at::Tensor keep;  // dropped outside the lock
    std::lock_guard<std::mutex> lk(hostMu);
    auto it = hostRegistrations().find(base);
    if (it == hostRegistrations().end() || it->second.views > 0 || it->second.drops != drop) return;  // taken back
    try {
      mem->hostUnregister(base);
    } catch (const std::exception&) {
    }
    keep = std::move(it->second.keep);
    hostRegistrations().erase(it);
  });
}

}  // namespace

at::Tensor hostView(std::shared_ptr<Memory> mem, const at::Tensor& host, int device) {
  TORCH_CHECK(mem, "myccl: host memory view: this build has no CUDA memory");
  TORCH_CHECK(host.device().is_cpu(), "myccl: host memory view: expected a CPU tensor, got one on ", host.device());
  const auto& storage = host.storage();
  void* base = storage.mutable_data();
  const size_t bytes = storage.nbytes();
  void* dbase = nullptr;
  {
    std::lock_guard<std::mutex> lk(hostMu);
    auto& regs = hostRegistrations();
    auto it = regs.find(base);
    if (it == regs.end()) {
      HostRegistration r;
      r.dbase = mem->hostRegister(base, bytes);
      r.bytes = bytes;
      r.keep = host;
      it = regs.emplace(base, std::move(r)).first;
    } else {
      TORCH_CHECK(it->second.bytes == bytes, "myccl: host memory view: the host memory at ", base, " is registered as ",
                  it->second.bytes, " bytes, this storage has ", bytes);
    }
    ++it->second.views;
    it->second.devices.insert(device);
    dbase = it->second.dbase;
  }
  const int64_t offset = host.storage_offset() * static_cast<int64_t>(host.element_size());
  try {
    return mem->tensorAt(static_cast<char*>(dbase) + offset, host.sizes(), host.strides(), host.scalar_type(), device,
                         [mem, base]() { dropHostView(mem, base); });
  } catch (...) {
    dropHostView(mem, base);
    throw;
  }
}

SharedRegion::~SharedRegion() {
  auto ranges = std::move(ranges_);
  const bool mapped = !ranges.empty();
  auto handles = std::move(imported_);
  if (haveOwn_) handles.push_back(own_);
  auto mem = mem_;
  auto release = [mem, ranges = std::move(ranges), handles = std::move(handles)] {
    // Each step alone: one that fails must not keep the others from giving back what they can.
    for (auto& r : ranges) {
      for (auto& [va, n] : r.mapped) {
        try {
          mem->unmap(va, n);
        } catch (const std::exception&) {
        }
      }
      try {
        mem->unreserve(r.va, r.bytes);
      } catch (const std::exception&) {
      }
    }
    for (MemHandle h : handles) {
      try {
        mem->release(h);
      } catch (const std::exception&) {
      }
    }
  };
  if (!mapped) {  // nothing mapped: no kernel can use it, give the handles back now
    try {
      DeviceScope scope(*mem_, device_);
      release();
    } catch (const std::exception&) {
    }
  } else {
    releaseLater(mem_, std::vector<int>(granted_.begin(), granted_.end()), std::move(release));
  }
}

int SharedRegion::exportFd() {
  if (!haveOwn_) return -1;
  DeviceScope scope(*mem_, device_);
  return mem_->exportFd(own_);
}

void SharedRegion::map(const std::vector<int>& fds, const std::vector<size_t>& sizes, int mine, bool contiguous) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!mapped_, "myccl: shared device memory: map() was already called");
  DeviceScope scope(*mem_, device_);
  TORCH_CHECK(fds.size() == sizes.size() && mine >= 0 && mine < static_cast<int>(sizes.size()),
              "myccl: shared device memory: map() needs one descriptor and size per part and this process's index");
  TORCH_CHECK(sizes[mine] == bytes_, "myccl: shared device memory: part ", mine, " is ", sizes[mine],
              " bytes but this process made ", bytes_);
  mapped_ = true;
  contiguous_ = contiguous;
  size_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] % gran_ == 0, "myccl: shared device memory: part ", i, " has ", sizes[i],
                " bytes, not a multiple of the granularity ", gran_);
    TORCH_CHECK(sizes[i] == 0 || static_cast<int>(i) == mine || fds[i] >= 0,
                "myccl: shared device memory: no descriptor for part ", i);
    total += sizes[i];
  }
  partRange_.assign(sizes.size(), -1);
  if (contiguous && total > 0) {
    ranges_.push_back(Range{mem_->reserve(total), total, {}});
  }
  size_t offset = 0;
  uintptr_t ownVa = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    MemHandle h = own_;
    if (static_cast<int>(i) != mine) {
      h = mem_->importFd(fds[i]);
      imported_.push_back(h);
    }
    if (!contiguous) {
      ranges_.push_back(Range{mem_->reserve(sizes[i]), sizes[i], {}});
      offset = 0;
    }
    Range& r = ranges_.back();
    mem_->map(r.va + offset, sizes[i], h);
    r.mapped.emplace_back(r.va + offset, sizes[i]);
    if (static_cast<int>(i) == mine) ownVa = r.va + offset;
    partRange_[i] = static_cast<int>(ranges_.size()) - 1;
    offset += sizes[i];
  }
  grant(device_);
  if (haveOwn_) mem_->zero(ownVa, bytes_, device_);  // each process clears its own pages, once
}

void SharedRegion::grant(int device) {
  if (!granted_.insert(device).second) return;
  for (auto& r : ranges_) {
    for (auto& [va, n] : r.mapped) mem_->setAccess(va, n, device);
  }
}

at::Tensor SharedRegion::view(int part, int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides,
                              at::ScalarType dtype, int device) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(mapped_, "myccl: shared device memory: view() before map()");
  const Range* r = nullptr;
  if (part < 0) {
    TORCH_CHECK(contiguous_, "myccl: shared device memory: a whole view needs a contiguous region");
    r = ranges_.empty() ? nullptr : &ranges_[0];
  } else {
    TORCH_CHECK(part < static_cast<int>(partRange_.size()), "myccl: shared device memory: no part ", part);
    r = partRange_[part] < 0 ? nullptr : &ranges_[partRange_[part]];
  }
  TORCH_CHECK(r != nullptr, "myccl: shared device memory: part ", part, " has no pages");
  int64_t extent = 1;
  for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
  const int64_t end = offset + (sizes.empty() || c10::multiply_integers(sizes) == 0 ? 0 : extent * c10::elementSize(dtype));
  TORCH_CHECK(offset >= 0 && end <= static_cast<int64_t>(r->bytes), "myccl: shared device memory: a view of ", end - offset,
              " bytes at ", offset, " does not fit the ", r->bytes, " bytes of part ", part);
  {
    DeviceScope scope(*mem_, device_);
    grant(device);
  }
  auto self = shared_from_this();
  return mem_->tensorAt(reinterpret_cast<void*>(r->va + offset), sizes, strides, dtype, device,
                        [self]() mutable { self.reset(); });
}

}  // namespace myccl::cuda
