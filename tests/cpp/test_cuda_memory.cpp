// Unit tests of the seam's shared device memory on the strict double (src/cuda/double/Memory.cpp)
// and of SharedRegion (src/cuda/SharedRegion.cpp), which whole-memory DEVICE and CUDA CHUNKED
// tensors are built on. "Processes" are SharedRegions of one machine: an exported descriptor is
// imported by another region exactly as it is after SCM_RIGHTS carried it to another process.
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "expect.hpp"
#include "myccl/cuda/SharedRegion.hpp"
#include "myccl/cuda/double/CudaDouble.hpp"

using namespace myccl::cuda;
namespace td = myccl::cuda::testdouble;


namespace {

constexpr size_t G = td::kMemoryGranularity;

std::string joined(const std::vector<std::string>& vs) {
  std::string s;
  for (const auto& v : vs) s += "\n  " + v;
  return s;
}

bool mentions(const std::vector<std::string>& vs, const std::string& part) {
  for (const auto& v : vs) {
    if (v.find(part) != std::string::npos) return true;
  }
  return false;
}

int64_t counter(const td::Machine& m, const char* name) {
  auto c = td::counters(m);
  auto it = c.find(name);
  return it == c.end() ? 0 : it->second;
}

// Descriptors of this process that name the double's device memory.
int memoryFds() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    auto target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().find("myccl-double-cuda") != std::string::npos) ++n;
  }
  return n;
}

// Whether `call` throws a c10::Error whose text contains `part`.
template <class F>
bool throws(F&& call, const std::string& part) {
  try {
    call();
  } catch (const c10::Error& e) {
    return std::string(e.what()).find(part) != std::string::npos;
  }
  return false;
}

// Three "processes" (regions) on devices 0, 1, 0 make their parts and map everyone's, contiguous:
// each sees the same memory; once all are dropped no handle, mapping or descriptor is left.
void contiguousRegionIsShared() {
  auto m = td::newMachine();
  auto mem = td::memory(m);
  const int fdsBefore = memoryFds();
  {
    std::vector<size_t> sizes = {2 * G, G, 0};  // the last process holds no pages
    std::vector<std::shared_ptr<SharedRegion>> procs;
    for (int i = 0; i < 3; ++i) procs.push_back(std::make_shared<SharedRegion>(mem, i % 2, sizes[i]));
    std::vector<int> fds;
    for (auto& p : procs) fds.push_back(p->exportFd());
    EXPECT(fds[2] == -1 && fds[0] >= 0 && fds[1] >= 0, "fds " << fds[0] << " " << fds[1] << " " << fds[2]);
    for (int i = 0; i < 3; ++i) procs[i]->map(fds, sizes, i, /*contiguous=*/true);
    for (int fd : fds) {
      if (fd >= 0) close(fd);
    }
    const int64_t n = 3 * G / sizeof(float);
    std::vector<at::Tensor> views;
    for (int i = 0; i < 3; ++i) views.push_back(procs[i]->view(-1, 0, {n}, {1}, at::kFloat, i % 2));
    views[2].copy_(at::arange(n, at::kFloat));  // written by the process with no pages of its own
    for (int i = 0; i < 2; ++i) EXPECT(at::equal(views[i], at::arange(n, at::kFloat)), "view " << i);
    // a row straddling the boundary of two processes' pages reads whole
    auto row = procs[0]->view(-1, 2 * G - 8, {4}, {1}, at::kFloat, 0);
    EXPECT(row[3].item<float>() == static_cast<float>((2 * G + 4) / 4), "straddling row");
    EXPECT(counter(*m, "mem_mapped") == 6 && counter(*m, "mem_imports") == 4, "counters");
    // a view from a device nobody asked for is granted first
    auto other = procs[1]->view(-1, 0, {4}, {1}, at::kFloat, 0);
    EXPECT(other[3].item<float>() == 3.0f, "view from cuda:0");
    EXPECT(throws([&] { procs[0]->view(-1, 0, {n + 1}, {1}, at::kFloat, 0); }, "does not fit"), "oversized view");
  }
  quiesceSharedMemory();  // released on the releaser thread, after a device synchronisation
  // every device given access, before unmapping: process 1 (cuda:1) was viewed from cuda:0 too
  EXPECT(counter(*m, "mem_synchronize_cuda0") == 3 && counter(*m, "mem_synchronize_cuda1") == 1,
         "synchronised before unmapping: cuda:0 " << counter(*m, "mem_synchronize_cuda0") << " times, cuda:1 "
                                                  << counter(*m, "mem_synchronize_cuda1"));
  EXPECT(counter(*m, "mem_mapped") == 0 && counter(*m, "mem_handles") == 0, "left mapped/held");
  EXPECT(memoryFds() == fdsBefore, "descriptors left: " << memoryFds() - fdsBefore);
  EXPECT(td::violations(*m).empty(), joined(td::violations(*m)));
}

// Chunked: one range per part; a view of part i only.
void chunkedRegionHasOneRangePerPart() {
  auto m = td::newMachine();
  auto mem = td::memory(m);
  {
    std::vector<size_t> sizes = {G, G};
    auto a = std::make_shared<SharedRegion>(mem, 0, G), b = std::make_shared<SharedRegion>(mem, 1, G);
    std::vector<int> fds = {a->exportFd(), b->exportFd()};
    a->map(fds, sizes, 0, false);
    b->map(fds, sizes, 1, false);
    for (int fd : fds) close(fd);
    a->view(1, 0, {16}, {1}, at::kFloat, 0).fill_(7.0f);
    EXPECT(b->view(1, 0, {16}, {1}, at::kFloat, 1).sum().item<float>() == 112.0f, "chunk 1 is shared");
    EXPECT(b->view(0, 0, {16}, {1}, at::kFloat, 1).sum().item<float>() == 0.0f, "chunk 0 is zeroed");
    EXPECT(throws([&] { a->view(-1, 0, {16}, {1}, at::kFloat, 0); }, "contiguous"), "whole view of chunks");
    EXPECT(throws([&] { a->map(fds, sizes, 0, false); }, "already"), "second map");
  }
  quiesceSharedMemory();
  EXPECT(counter(*m, "mem_mapped") == 0 && counter(*m, "mem_handles") == 0, "left mapped/held");
  EXPECT(td::violations(*m).empty(), joined(td::violations(*m)));
}

// A tensor keeps its region: dropping the region object first leaves the memory usable.
void tensorKeepsRegion() {
  auto m = td::newMachine();
  auto mem = td::memory(m);
  at::Tensor t;
  {
    auto r = std::make_shared<SharedRegion>(mem, 0, 1);
    EXPECT(r->bytes() == G, "rounded to the granularity: " << r->bytes());
    r->map({-1}, {G}, 0, true);
    t = r->view(-1, 0, {8}, {1}, at::kLong, 0);
  }
  t.fill_(5);
  EXPECT(t.sum().item<int64_t>() == 40, "usable after the region object went");
  EXPECT(counter(*m, "mem_mapped") == 1, "still mapped");
  t = at::Tensor();
  quiesceSharedMemory();
  EXPECT(counter(*m, "mem_mapped") == 0 && counter(*m, "mem_handles") == 0, "freed with its tensor");
}

// Every misuse the double must not let pass silently: a violation, and the call fails as CUDA's.
void misuseIsReported() {
  auto m = td::newMachine();
  auto mem = td::memory(m);
  EXPECT(throws([&] { mem->create(0, G + 1); }, "granularity"), "create of a partial granule");
  EXPECT(throws([&] { mem->create(5, G); }, "invalid device"), "create on no device");
  MemHandle h = mem->create(0, G);
  const uintptr_t va = mem->reserve(2 * G);
  EXPECT(throws([&] { mem->map(va + 2 * G, G, h); }, "outside every reservation"), "map outside");
  mem->map(va, G, h);
  EXPECT(throws([&] { mem->map(va, G, h); }, "already mapped"), "map over a mapping");
  EXPECT(throws([&] { mem->tensorAt(reinterpret_cast<void*>(va), {4}, {1}, at::kFloat, 0, [] {}); }, "never given access"),
         "a view before setAccess");
  mem->setAccess(va, G, 1);
  EXPECT(throws([&] { mem->tensorAt(reinterpret_cast<void*>(va), {4}, {1}, at::kFloat, 0, [] {}); }, "never given access"),
         "a view from a device without access");
  EXPECT(throws([&] { mem->tensorAt(reinterpret_cast<void*>(va + G - 4), {4}, {1}, at::kFloat, 1, [] {}); },
                "never given access"),
         "a view running past the mapping");
  (void)mem->tensorAt(reinterpret_cast<void*>(va), {4}, {1}, at::kFloat, 1, [] {});
  EXPECT(throws([&] { mem->unreserve(va, 2 * G); }, "still mapped"), "free of a range still mapped");
  mem->release(h);  // allowed while mapped: the mapping keeps the memory
  EXPECT(throws([&] { mem->release(h); }, "no longer"), "a second release");
  EXPECT(throws([&] { mem->exportFd(h); }, "no longer"), "export after release");
  EXPECT(throws([&] { mem->unmap(va, 2 * G); }, "not one mapping"), "unmap of a wrong size");
  mem->unmap(va, G);
  mem->unreserve(va, 2 * G);
  EXPECT(throws([&] { mem->importFd(0); }, "no memory a process exported"), "import of stdin");
  std::vector<char> host(3 * 4096);
  (void)mem->hostRegister(host.data(), 4096);
  EXPECT(throws([&] { mem->hostRegister(host.data() + 100, 4096); }, "already registered"), "overlapping register");
  (void)mem->tensorAt(host.data(), {16}, {1}, at::kFloat, 1, [] {});
  mem->hostUnregister(host.data());
  EXPECT(throws([&] { mem->hostUnregister(host.data()); }, "not registered"), "second unregister");
  const auto v = td::violations(*m);
  EXPECT(v.size() == 13, "violations:" << joined(v));
  EXPECT(mentions(v, "cuMemMap at") && mentions(v, "cuMemAddressFree of a range with memory still mapped") &&
             mentions(v, "cudaHostRegister of") && mentions(v, "cuMemRelease of handle"),
         joined(v));
}

// Memory used after it was unmapped faults, and the handler names it before the process dies
// (run in a child: the fault is the point).
void useAfterUnmapFaultsLoudly(const char* self) {
  const std::string cmd = std::string(self) + " --use-after-unmap 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT(p != nullptr, "popen");
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int status = pclose(p);
  EXPECT(WIFEXITED(status) == 0 || WEXITSTATUS(status) != 0, "the child survived: " << out);
  EXPECT(out.find("device memory that is not mapped for use") != std::string::npos, "no report: " << out);
  EXPECT(out.find("still alive") == std::string::npos, "read after unmap went through: " << out);
}

int useAfterUnmapChild() {
  auto m = td::newMachine();
  auto mem = td::memory(m);
  float* p = nullptr;
  {
    auto r = std::make_shared<SharedRegion>(mem, 0, G);
    r->map({-1}, {G}, 0, true);
    auto t = r->view(-1, 0, {4}, {1}, at::kFloat, 0);
    p = t.data_ptr<float>();
    p[0] = 1.0f;
  }
  quiesceSharedMemory();
  volatile float x = p[0];  // after the last tensor went: unmapped
  std::printf("still alive: %f\n", static_cast<double>(x));
  return 0;
}

struct Test {
  const char* name;
  void (*fn)();
};

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--use-after-unmap") return useAfterUnmapChild();
  static const char* self = argv[0];
  const Test tests[] = {
      {"contiguous_region_is_shared", contiguousRegionIsShared},
      {"chunked_region_has_one_range_per_part", chunkedRegionHasOneRangePerPart},
      {"tensor_keeps_region", tensorKeepsRegion},
      {"misuse_is_reported", misuseIsReported},
      {"use_after_unmap_faults_loudly", [] { useAfterUnmapFaultsLoudly(self); }},
  };
  int failed = 0;
  for (const auto& t : tests) {
    try {
      t.fn();
      std::printf("ok   %s\n", t.name);
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", t.name, e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d of %zu tests failed\n", failed, sizeof tests / sizeof tests[0]);
  return failed == 0 ? 0 : 1;
}
