// The double's shared device memory (CudaDouble.hpp: memory()): CUDA's virtual memory calls with
// "physical memory" in memfd files, address ranges from mmap, and every rule CUDA has that would
// otherwise fail silently checked and reported as a violation (the call then fails as CUDA's
// would). Address ranges are never given back, so that a late use always faults; the fault
// handler names the range before the process dies.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "Machine.hpp"

namespace myccl::cuda::testdouble {

namespace {

// Every range the double ever reserved, for the fault handler (which takes no lock).
constexpr size_t kMaxRanges = 4096;
std::array<std::atomic<uintptr_t>, kMaxRanges> rangeStart{};
std::array<std::atomic<uintptr_t>, kMaxRanges> rangeEnd{};
std::atomic<size_t> rangeCount{0};
struct sigaction previousSegv;
std::once_flag installOnce;

void onSegv(int sig, siginfo_t* info, void* ctx) {
  const auto a = reinterpret_cast<uintptr_t>(info->si_addr);
  const size_t n = std::min(rangeCount.load(), kMaxRanges);
  for (size_t i = 0; i < n; ++i) {
    if (a >= rangeStart[i].load() && a < rangeEnd[i].load()) {
      char msg[256];
      const int len = std::snprintf(msg, sizeof msg,
                                    "[myccl cuda double] violation: access to %#lx, device memory that is not mapped "
                                    "for use (after cuMemUnmap / cuMemAddressFree, or before cuMemMap / "
                                    "cuMemSetAccess); range [%#lx, %#lx)\n",
                                    static_cast<unsigned long>(a), static_cast<unsigned long>(rangeStart[i].load()),
                                    static_cast<unsigned long>(rangeEnd[i].load()));
      if (len > 0) (void)!write(2, msg, static_cast<size_t>(std::min(len, 255)));
      signal(SIGSEGV, SIG_DFL);  // the access runs again and kills the process
      return;
    }
  }
  if (previousSegv.sa_flags & SA_SIGINFO) {
    previousSegv.sa_sigaction(sig, info, ctx);
  } else if (previousSegv.sa_handler == SIG_DFL || previousSegv.sa_handler == SIG_IGN) {
    signal(SIGSEGV, SIG_DFL);
  } else {
    previousSegv.sa_handler(sig);
  }
}

void remember(uintptr_t va, size_t bytes) {
  std::call_once(installOnce, [] {
    struct sigaction sa = {};
    sa.sa_sigaction = onSegv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previousSegv);
  });
  const size_t i = rangeCount.fetch_add(1);
  if (i >= kMaxRanges) return;
  rangeStart[i].store(va);
  rangeEnd[i].store(va + bytes);
}

// holdMemoryReleases: the gate every synchronize() passes first.
std::mutex holdMu;
std::condition_variable holdCv;
bool held = false;

std::string hex(uintptr_t p) {
  std::ostringstream os;
  os << "0x" << std::hex << p;
  return os.str();
}

class DoubleMemory final : public Memory {
 public:
  explicit DoubleMemory(std::shared_ptr<Machine> m) : m_(std::move(m)) {}

  ~DoubleMemory() override {
    for (auto& kv : handles_) close(kv.second.fd);
  }

  std::string kind() override { return "double"; }
  int currentDevice() override { return m_->thread().device; }

  std::function<void()> useDevice(int device) override {
    m_->checkIndex(device, "cudaSetDevice");
    const int previous = m_->thread().device;
    m_->thread().device = device;  // as cudaSetDevice: the thread's device until someone sets another
    return [m = m_, previous] { m->thread().device = previous; };
  }

  bool shareable(int device, std::string*) override {
    m_->checkIndex(device, "cuDeviceGetAttribute");
    return true;
  }
  size_t granularity(int device) override {
    m_->checkIndex(device, "cuMemGetAllocationGranularity");
    return kMemoryGranularity;
  }

  MemHandle create(int device, size_t bytes) override {
    m_->checkIndex(device, "cuMemCreate");
    if (bytes == 0 || bytes % kMemoryGranularity != 0) fail("cuMemCreate of " + std::to_string(bytes) + " bytes, not a positive multiple of the granularity");
    const std::string name = "myccl-double-cuda" + std::to_string(device);
    const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    TORCH_CHECK(fd >= 0, "myccl: cuda double: memfd_create: ", std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      close(fd);
      TORCH_CHECK(false, "myccl: cuda double: cuMemCreate of ", bytes, " bytes: ", std::strerror(e));
    }
    // Fresh device memory holds whatever was there before: here 0xA5 bytes, so that reading memory
    // nobody cleared shows (a new memfd reads as zeros and would hide it).
    void* fresh = mmap(nullptr, bytes, PROT_WRITE, MAP_SHARED, fd, 0);
    if (fresh == MAP_FAILED) {
      const int e = errno;
      close(fd);
      TORCH_CHECK(false, "myccl: cuda double: cuMemCreate of ", bytes, " bytes: ", std::strerror(e));
    }
    std::memset(fresh, 0xA5, bytes);
    munmap(fresh, bytes);
    m_->count("mem_creates");
    return add(fd, bytes);
  }

  int exportFd(MemHandle h) override {
    std::lock_guard<std::mutex> lk(mu_);
    const Phys& p = handle(h, "cuMemExportToShareableHandle");
    const int fd = fcntl(p.fd, F_DUPFD_CLOEXEC, 0);
    TORCH_CHECK(fd >= 0, "myccl: cuda double: cuMemExportToShareableHandle: ", std::strerror(errno));
    return fd;
  }

  MemHandle importFd(int fd) override {
    struct stat st = {};
    char link[128] = {};
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = readlink(path.c_str(), link, sizeof link - 1);
    const char* tag = std::strstr(link, "myccl-double-cuda");
    if (fstat(fd, &st) != 0 || n <= 0 || tag == nullptr) {
      fail("cuMemImportFromShareableHandle of descriptor " + std::to_string(fd) +
           ", which is no memory a process exported (cuMemExportToShareableHandle)");
    }
    const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    TORCH_CHECK(mine >= 0, "myccl: cuda double: cuMemImportFromShareableHandle: ", std::strerror(errno));
    m_->count("mem_imports");
    return add(mine, static_cast<size_t>(st.st_size));
  }

  void release(MemHandle h) override {
    int fd = -1;
    {
      std::lock_guard<std::mutex> lk(mu_);
      fd = handle(h, "cuMemRelease").fd;
      handles_.erase(h);
    }
    close(fd);  // the memory itself lives on in the mappings made of it, as CUDA's does
    m_->count("mem_handles", -1);
  }

  uintptr_t reserve(size_t bytes) override {
    if (bytes == 0 || bytes % kMemoryGranularity != 0) fail("cuMemAddressReserve of " + std::to_string(bytes) + " bytes, not a positive multiple of the granularity");
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "myccl: cuda double: cuMemAddressReserve of ", bytes, " bytes: ", std::strerror(errno));
    const auto va = reinterpret_cast<uintptr_t>(p);
    remember(va, bytes);
    std::lock_guard<std::mutex> lk(mu_);
    reserved_[va] = bytes;
    return va;
  }

  void unreserve(uintptr_t va, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = reserved_.find(va);
    if (it == reserved_.end() || it->second != bytes) fail("cuMemAddressFree of [" + hex(va) + ", +" + std::to_string(bytes) + "), which is no reservation");
    auto m = mapped_.lower_bound(va);
    if (m != mapped_.end() && m->first < va + bytes) fail("cuMemAddressFree of a range with memory still mapped at " + hex(m->first));
    reserved_.erase(it);  // the addresses stay reserved in this process: a late use faults
  }

  void map(uintptr_t va, size_t bytes, MemHandle h) override {
    std::lock_guard<std::mutex> lk(mu_);
    const Phys& p = handle(h, "cuMemMap");
    if (bytes == 0 || bytes % kMemoryGranularity != 0 || bytes > p.bytes) fail("cuMemMap of " + std::to_string(bytes) + " bytes of a handle of " + std::to_string(p.bytes));
    auto r = reserved_.upper_bound(va);
    if (r == reserved_.begin() || std::prev(r)->first + std::prev(r)->second < va + bytes) fail("cuMemMap at " + hex(va) + ", outside every reservation");
    auto next = mapped_.lower_bound(va);
    const bool overlapsNext = next != mapped_.end() && next->first < va + bytes;
    const bool overlapsPrev = next != mapped_.begin() && std::prev(next)->first + std::prev(next)->second.bytes > va;
    if (overlapsNext || overlapsPrev) fail("cuMemMap at " + hex(va) + " over memory already mapped");
    void* got = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, p.fd, 0);
    TORCH_CHECK(got != MAP_FAILED, "myccl: cuda double: cuMemMap: ", std::strerror(errno));
    mapped_[va] = Mapping{bytes, {}};
    m_->count("mem_maps");
    m_->count("mem_mapped");
  }

  void setAccess(uintptr_t va, size_t bytes, int device) override {
    m_->checkIndex(device, "cuMemSetAccess");
    std::lock_guard<std::mutex> lk(mu_);
    auto it = mapped_.find(va);
    if (it == mapped_.end() || it->second.bytes != bytes) fail("cuMemSetAccess on [" + hex(va) + ", +" + std::to_string(bytes) + "), which is not one mapping");
    if (it->second.access.empty()) TORCH_CHECK(mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) == 0, "myccl: cuda double: cuMemSetAccess: ", std::strerror(errno));
    it->second.access.insert(device);
  }

  void unmap(uintptr_t va, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = mapped_.find(va);
    if (it == mapped_.end() || it->second.bytes != bytes) fail("cuMemUnmap of [" + hex(va) + ", +" + std::to_string(bytes) + "), which is not one mapping");
    void* got = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(got != MAP_FAILED, "myccl: cuda double: cuMemUnmap: ", std::strerror(errno));
    mapped_.erase(it);
    m_->count("mem_mapped", -1);
  }

  void zero(uintptr_t va, size_t bytes, int device) override {
    m_->checkIndex(device, "cudaMemsetAsync");
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!usable(va, va + bytes, device)) {
        fail("cudaMemsetAsync on cuda:" + std::to_string(device) + " of [" + hex(va) + ", +" + std::to_string(bytes) +
             "), memory that device was never given access to");
      }
    }
    std::memset(reinterpret_cast<void*>(va), 0, bytes);
    m_->count("mem_zeroed");
  }

  void synchronize(int device) override {
    m_->checkIndex(device, "cudaDeviceSynchronize");
    {
      std::unique_lock<std::mutex> lk(holdMu);
      if (!holdCv.wait_for(lk, m_->hang(), [] { return !held; })) m_->violation("hang: memory releases held past hangMs");
    }
    Machine* m = m_.get();
    for (auto& w : m->workers()) {  // every stream of this device, as CUDA's; none of another's
      if (w->stream.device_index() != device) continue;
      (void)w->waitPassed(
          w->held(), [m] { return m->stopping.load(); }, m->hang(), [&] {
            m->violation("hang: cudaDeviceSynchronize(" + std::to_string(device) + ") waits for " +
                         streamName(w->stream) + " for more than " + std::to_string(m->opts.hangMs) + " ms");
          });
    }
    m_->count("mem_synchronize");
    m_->count("mem_synchronize_cuda" + std::to_string(device));
  }

  void* hostRegister(void* p, size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto next = host_.lower_bound(a);
    if ((next != host_.end() && next->first < a + bytes) ||
        (next != host_.begin() && std::prev(next)->first + std::prev(next)->second > a)) {
      fail("cudaHostRegister of [" + hex(a) + ", +" + std::to_string(bytes) + "), which overlaps memory already registered");
    }
    host_[a] = bytes;
    m_->count("host_registered");
    return p;  // unified addressing: the device sees host memory at its host address
  }

  void hostUnregister(void* p) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (host_.erase(reinterpret_cast<uintptr_t>(p)) == 0) fail("cudaHostUnregister of " + hex(reinterpret_cast<uintptr_t>(p)) + ", which is not registered");
    m_->count("host_registered", -1);
  }

  at::Tensor tensorAt(void* p, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype, int device,
                      std::function<void()> onFree) override {
    m_->checkIndex(device, "tensor");
    int64_t extent = 1;
    for (size_t d = 0; d < sizes.size(); ++d) extent += (sizes[d] - 1) * strides[d];
    const auto a = reinterpret_cast<uintptr_t>(p);
    const auto end = a + static_cast<uintptr_t>(extent) * c10::elementSize(dtype);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!usable(a, end, device)) {
        fail("a tensor of cuda:" + std::to_string(device) + " over [" + hex(a) + ", " + hex(end) +
                   "), memory that device was never given access to (cuMemSetAccess / cudaHostRegister)");
      }
    }
    return at::from_blob(p, sizes, strides, [onFree = std::move(onFree)](void*) mutable { onFree(); },
                         at::TensorOptions().dtype(dtype));
  }

 private:
  struct Phys {
    int fd;
    size_t bytes;
  };
  struct Mapping {
    size_t bytes;
    std::set<int> access;  // devices that may use it
  };

  MemHandle add(int fd, size_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    const MemHandle h = next_++;
    handles_[h] = Phys{fd, bytes};
    m_->count("mem_handles");
    return h;
  }

  const Phys& handle(MemHandle h, const char* call) {
    auto it = handles_.find(h);
    if (it == handles_.end()) fail(std::string(call) + " of handle " + std::to_string(h) + ", which is not (or no longer) a handle");
    return it->second;
  }

  // Whether [a, end) is covered, without gaps, by mappings `device` may use, or lies in registered host memory.
  bool usable(uintptr_t a, uintptr_t end, int device) const {
    auto h = host_.upper_bound(a);
    if (h != host_.begin() && std::prev(h)->first + std::prev(h)->second >= end) return true;
    auto it = mapped_.upper_bound(a);
    if (it == mapped_.begin()) return false;
    --it;
    uintptr_t at = a;
    while (at < end) {
      if (it == mapped_.end() || it->first > at || it->first + it->second.bytes <= at) return false;
      if (!it->second.access.count(device)) return false;
      at = it->first + it->second.bytes;
      ++it;
    }
    return true;
  }

  // Reports a violation and fails as CUDA would (callers may hold mu_: the log has its own lock).
  void fail(const std::string& what) {
    m_->violation(what);
    TORCH_CHECK(false, "myccl: cuda double: ", what);
  }

  std::shared_ptr<Machine> m_;
  std::mutex mu_;
  MemHandle next_ = 1;
  std::map<MemHandle, Phys> handles_;
  std::map<uintptr_t, size_t> reserved_;
  std::map<uintptr_t, Mapping> mapped_;
  std::map<uintptr_t, size_t> host_;
};

}  // namespace

std::shared_ptr<Memory> Machine::memory() {
  std::lock_guard<std::mutex> lk(memoryMu_);
  auto m = memory_.lock();
  if (!m) {
    m = std::make_shared<DoubleMemory>(shared_from_this());
    memory_ = m;
  }
  return m;
}

void holdMemoryReleases(bool on) {
  {
    std::lock_guard<std::mutex> lk(holdMu);
    held = on;
  }
  holdCv.notify_all();
}

std::shared_ptr<Memory> memory(const std::shared_ptr<Machine>& m) {
  TORCH_CHECK(m != nullptr, "myccl: cuda double: memory() needs a machine");
  return m->memory();
}

}  // namespace myccl::cuda::testdouble
