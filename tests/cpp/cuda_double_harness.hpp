// The harness of test_cuda_double.cpp: ranks as threads, each with its own machine, meeting in
// one HashStore; a watchdog that ends a hung test with its name; helpers to make communicators,
// hold streams and compute expected reductions with plain torch.
#pragma once

#include <ATen/TensorOperators.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/div.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <iostream>
#include <sstream>
#include <thread>

#include "expect.hpp"
#include "myccl/cuda/double/CudaDouble.hpp"

using namespace myccl::cuda;
namespace td = myccl::cuda::testdouble;
using R = NcclResult;

#define OK(expr)                                                                          \
  do {                                                                                    \
    const R r_ = (expr);                                                                  \
    EXPECT(r_ == R::Success, #expr " returned " << static_cast<int>(r_));                  \
  } while (0)

// Test-only helpers, one translation unit: internal linkage keeps them out of everyone's way.
namespace {

// ---- harness ----------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

std::mutex gWatchMu;
std::string gTest;
Clock::time_point gDeadline = Clock::time_point::max();

// A test that hangs must fail with its name, not stall the suite.
void watchdog() {
  const auto start = Clock::now();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lk(gWatchMu);
    if (Clock::now() > gDeadline || Clock::now() - start > std::chrono::seconds(120)) {
      std::fprintf(stderr, "FAIL %s: timed out\n", gTest.c_str());
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
}

c10::intrusive_ptr<c10d::Store> sharedStore() {
  static auto s = c10::make_intrusive<c10d::HashStore>();
  return s;
}

td::Options quick(int64_t hangMs = 5000) {
  td::Options o;
  o.seed = 12345;
  o.maxDelayUs = 50;
  o.hangMs = hangMs;
  return o;
}

bool contains(const std::vector<std::string>& vs, const std::string& part) {
  for (const auto& v : vs) {
    if (v.find(part) != std::string::npos) return true;
  }
  return false;
}

std::string joined(const std::vector<std::string>& vs) {
  std::string s;
  for (const auto& v : vs) s += "\n  " + v;
  return s;
}

// Waits (up to 10 s) until the machine reported a violation containing `part`.
bool awaitViolation(const td::Machine& m, const std::string& part) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < until) {
    if (contains(td::violations(m), part)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Holds a stream until opened, so a test decides when queued work runs.
struct Gate {
  std::promise<void> p;
  std::shared_future<void> f = p.get_future().share();
  void open() { p.set_value(); }
  void hold(Device& dev, const Stream& s) {
    auto fut = f;
    dev.enqueue(s, [fut] { fut.wait_for(std::chrono::seconds(10)); });
  }
};

struct Rank {
  int rank = 0;
  std::shared_ptr<td::Machine> m;
  Runtime rt;
  Device& dev() { return *rt.device; }
  Nccl& nccl() { return *rt.nccl; }
};

struct Cluster {
  Cluster(int n, const std::string& tag, td::Options o = quick())
      : store(c10::make_intrusive<c10d::PrefixStore>(tag, sharedStore())) {
    for (int r = 0; r < n; ++r) {
      auto m = td::newMachine(o);
      ranks.push_back(Rank{r, m, td::runtime(m, store)});
    }
  }

  // fn on one thread per rank, each on device rank % devices; rethrows the first failure.
  void run(const std::function<void(Rank&)>& fn) {
    std::vector<std::thread> ts;
    std::mutex mu;
    std::string error;
    for (auto& r : ranks) {
      ts.emplace_back([&, rp = &r] {
        try {
          rp->dev().set(rp->rank % rp->dev().count());
          fn(*rp);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lk(mu);
          if (error.empty()) error = "rank " + std::to_string(rp->rank) + ": " + e.what();
        }
      });
    }
    for (auto& t : ts) t.join();
    if (!error.empty()) throw std::runtime_error(error);
  }

  void expectClean() {
    for (auto& r : ranks) {
      td::synchronize(*r.m);
      auto v = td::violations(*r.m);
      EXPECT(v.empty(), "rank " << r.rank << " reported violations:" << joined(v));
    }
  }

  c10::intrusive_ptr<c10d::Store> store;
  std::vector<Rank> ranks;
};

NcclResult poll(Nccl& nccl, NcclCommHandle c) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  NcclResult st = R::InProgress;
  while (Clock::now() < until) {
    OK(nccl.commGetAsyncError(c, &st));
    if (st != R::InProgress) return st;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return st;
}

// Communicator over `n` ranks: rank 0's id travels through the store under `tag`.
NcclCommHandle makeComm(Rank& r, c10d::Store& store, const std::string& tag, int n, int rank, bool blocking = true) {
  NcclUniqueId id{};
  if (rank == 0) {
    OK(r.nccl().getUniqueId(&id));
    store.set(tag, std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
  } else {
    store.wait({tag});
    auto v = store.get(tag);
    std::memcpy(id.internal, v.data(), sizeof id.internal);
  }
  NcclCommConfig cfg;
  cfg.blocking = blocking;
  NcclCommHandle c = nullptr;
  const R res = r.nccl().commInitRank(&c, n, id, rank, cfg);
  if (blocking) {
    OK(res);
  } else {
    EXPECT(res == R::InProgress, "nonblocking init returned " << static_cast<int>(res));
    EXPECT(poll(r.nccl(), c) == R::Success, "nonblocking init did not settle");
  }
  return c;
}

void settle(Nccl& nccl, NcclCommHandle c, R r) {
  EXPECT(r == R::Success || r == R::InProgress, "call returned " << static_cast<int>(r));
  if (r == R::InProgress) EXPECT(poll(nccl, c) == R::Success, "did not settle");
}

void closeComm(Nccl& nccl, NcclCommHandle c) {
  settle(nccl, c, nccl.commFinalize(c));
  OK(nccl.commDestroy(c));
}

// Host-waits for everything enqueued on `s` so far.
void drain(Device& dev, const Stream& s) {
  auto e = dev.newEvent();
  e->record(s);
  e->synchronize();
}

at::ScalarType st(NcclType t) {
  static const at::ScalarType m[] = {at::kChar,     at::kByte,          at::kInt,         at::kUInt32,
                                     at::kLong,     at::kUInt64,        at::kHalf,        at::kFloat,
                                     at::kDouble,   at::kBFloat16,      at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  return m[static_cast<int>(t)];
}

bool isUnsigned(NcclType t) { return t == NcclType::Uint8 || t == NcclType::Uint32 || t == NcclType::Uint64; }
bool isIntegral(NcclType t) { return static_cast<int>(t) <= static_cast<int>(NcclType::Uint64); }

// Small values (products of three stay in int8's range), negative ones for signed types.
at::Tensor input(int rank, NcclType t, int64_t n) {
  auto i = at::arange(n, at::kLong) + 7 * rank;
  auto v = isUnsigned(t) ? at::remainder(i, 5) + 1 : at::remainder(i, 7) - 3;
  return v.to(st(t));
}

// The reference: rank order, rounded to the type at each step; avg divides once, exactly.
at::Tensor expected(const std::vector<at::Tensor>& in, NcclType t, NcclRedOp op) {
  const auto type = st(t);
  at::Tensor acc = in[0].to(at::kDouble);
  for (size_t r = 1; r < in.size(); ++r) {
    const at::Tensor x = in[r].to(at::kDouble);
    if (op == kNcclSum || op == kNcclAvg) acc = acc + x;
    if (op == kNcclProd) acc = acc * x;
    if (op == kNcclMax) acc = at::maximum(acc, x);
    if (op == kNcclMin) acc = at::minimum(acc, x);
    acc = acc.to(type).to(at::kDouble);
  }
  if (op == kNcclAvg) {
    const auto n = static_cast<int64_t>(in.size());
    acc = isIntegral(t) ? at::div(acc, n, "trunc") : acc / static_cast<double>(n);
  }
  return acc.to(type).to(at::kDouble);
}

}  // namespace
