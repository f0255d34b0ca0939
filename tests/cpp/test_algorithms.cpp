// Unit tests of the flat algorithms (src/cpu/algorithms: Direct, Ring, Bruck, HalvingDoubling,
// Tree, Chain) without sockets or processes: the ranks of a group are threads over the in-process
// loopback transport (loopback_transport.hpp), each algorithm is called directly (not through
// Select.cpp's choice), at several rank counts, with uneven and empty blocks and tiny segments so
// that every pipeline has several segments, on both a buffering and a rendezvous transport. Every
// rank's result is compared with an expectation computed here with plain loops: sums that fold in
// rank order must match bit for bit; the ring and halving-doubling run on integers (any order).
// tests/cpp/test_algorithms.py builds and runs it; it prints each failed check and exits 1 if any.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cpu/algorithms/Flat.hpp"
#include "loopback_transport.hpp"
#include "myccl/Topology.hpp"

using namespace myccl;
using namespace myccl::cpu;
using myccl::cpu::testing::LoopbackHub;
using myccl::cpu::testing::LoopbackTransport;

namespace {

int failures = 0;
int checks = 0;

void fail(const std::string& what) {
  if (++failures <= 60) std::printf("FAIL %s\n", what.c_str());
}

void check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) fail(what);
}

const int kRankCounts[] = {1, 2, 3, 4, 5, 7, 8};
const LoopbackHub::Mode kModes[] = {LoopbackHub::Mode::Eager, LoopbackHub::Mode::Rendezvous};

std::string modeName(LoopbackHub::Mode m) {
  return m == LoopbackHub::Mode::Eager ? "eager" : "rendezvous";
}

// Two hosts, ranks split alternately (0, 2, 4.. on host 0): the chain must order ranks by host.
Topology twoHosts(int n, int rank) {
  Topology t;
  t.rank = rank;
  t.size = n;
  t.crossSize = n > 1 ? 2 : 1;
  for (int r = 0; r < n; ++r) t.hostOfRank.push_back(n > 1 ? r % 2 : 0);
  for (int r = 0; r < n; ++r)
    if (t.hostOfRank[r] == t.hostOfRank[rank]) t.localRanks.push_back(r);
  t.localSize = static_cast<int>(t.localRanks.size());
  t.localRank = static_cast<int>(std::find(t.localRanks.begin(), t.localRanks.end(), rank) - t.localRanks.begin());
  t.crossRank = t.hostOfRank[rank];
  return t;
}

struct Run {
  int n;
  LoopbackHub::Mode mode;
  size_t chunkBytes = 64;  // tiny: every pipelined message is cut in several segments
  bool hosts = false;      // give the context a two-host topology
  std::chrono::milliseconds timeout{20000};
};

// Runs body(ctx) on every rank of a group at once; returns each rank's error ("" if none).
std::vector<std::string> runRanks(const Run& run, const std::function<void(CollCtx&)>& body) {
  auto hub = std::make_shared<LoopbackHub>(run.n, run.mode);
  std::vector<std::string> errors(run.n);
  std::vector<std::thread> threads;
  for (int r = 0; r < run.n; ++r) {
    threads.emplace_back([&, r] {
      LoopbackTransport tp(hub, r);
      Scratch scratch;
      Topology topo = twoHosts(run.n, r);
      CollCtx c{tp, r, run.n, collectiveTagBase(OpCode::Allreduce, 7), Clock::now() + run.timeout, scratch,
                run.chunkBytes};
      if (run.hosts) {
        c.topo = &topo;
        c.crossHost = run.n > 1;
      }
      try {
        body(c);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        tp.close("rank failed", true);
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// Every case names itself through where(): what ran, for the report at the end
// (tests/cpp/test_algorithms.py checks that each algorithm ran at every rank count and on both transports).
std::map<std::string, std::set<std::string>> ran;

std::string where(const char* algo, const Run& run, const std::string& detail = "") {
  ran[algo].insert(std::to_string(run.n) + "/" + modeName(run.mode));
  return std::string(algo) + " n=" + std::to_string(run.n) + " " + modeName(run.mode) + (detail.empty() ? "" : " " + detail);
}

bool noErrors(const std::vector<std::string>& errors, const std::string& what) {
  bool ok = true;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) {
      fail(what + ": rank " + std::to_string(r) + " raised: " + errors[r]);
      ok = false;
    }
  }
  ++checks;
  return ok;
}

// Inputs whose float sums round differently in different orders.
float fval(int rank, size_t i) {
  return static_cast<float>(rank + 1) * 0.1f + static_cast<float>(i % 113) * 1.0e-3f + (rank % 2 ? 1.0e4f : 0.0f);
}
int64_t ival(int rank, size_t i) {
  return static_cast<int64_t>(rank + 1) * 1000003 + static_cast<int64_t>(i % 997) - 500;
}

// The rank-order fold, as the reduction kernels define it: ((x0 op x1) op x2) ..., then / divisor.
template <class T>
std::vector<T> expected(int n, size_t count, RedOp op, int64_t divisor, T (*val)(int, size_t)) {
  std::vector<T> out(count);
  for (size_t i = 0; i < count; ++i) {
    T acc = val(0, i);
    for (int q = 1; q < n; ++q) {
      const T x = val(q, i);
      switch (op) {
        case RedOp::Sum: acc = acc + x; break;
        case RedOp::Max: acc = std::max(acc, x); break;
        case RedOp::Min: acc = std::min(acc, x); break;
        default: break;
      }
    }
    if (divisor) acc = acc / static_cast<T>(divisor);
    out[i] = acc;
  }
  return out;
}

template <class T>
bool sameBits(const std::vector<T>& got, const std::vector<T>& want, size_t* at) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      *at = i;
      return false;
    }
  }
  return true;
}

// ---- all_reduce ----

using AllreduceFn = std::function<void(CollCtx&, void*, size_t, const ReduceSpec&)>;

template <class T>
void allreduceCase(const char* name, const AllreduceFn& fn, const Run& run, size_t count, DType dt, RedOp op,
                   bool avg, T (*val)(int, size_t)) {
  ReduceSpec spec;
  spec.dtype = dt;
  spec.op = op;
  spec.divisor = avg ? run.n : 0;
  std::vector<std::vector<T>> bufs(run.n, std::vector<T>(count));
  for (int r = 0; r < run.n; ++r)
    for (size_t i = 0; i < count; ++i) bufs[r][i] = val(r, i);
  const auto errors = runRanks(run, [&](CollCtx& c) { fn(c, bufs[c.rank].data(), count, spec); });
  const std::string what = where(name, run, "count=" + std::to_string(count) + (avg ? " AVG" : "") +
                                                " op=" + std::to_string(static_cast<int>(op)));
  if (!noErrors(errors, what)) return;
  const auto want = expected<T>(run.n, count, op, spec.divisor, val);
  for (int r = 0; r < run.n; ++r) {
    size_t at = 0;
    check(sameBits(bufs[r], want, &at), what + ": rank " + std::to_string(r) + " differs at element " + std::to_string(at));
  }
}

void testAllreduce() {
  const size_t counts[] = {0, 1, 5, 37, 1000};
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      Run run{n, mode};
      for (size_t count : counts) {
        // Rank-order float sums: these must match the one-pass fold bit for bit.
        allreduceCase<float>("oneRoundAllreduce", flat::oneRoundAllreduce, run, count, DType::F32, RedOp::Sum, false, fval);
        allreduceCase<float>("bruckAllreduce", flat::bruckAllreduce, run, count, DType::F32, RedOp::Sum, false, fval);
        allreduceCase<float>("directAllreduce", [](CollCtx& c, void* b, size_t k, const ReduceSpec& s) {
          flat::directAllreduce(c, b, k, s, false);
        }, run, count, DType::F32, RedOp::Sum, true, fval);
        allreduceCase<float>("directAllreduce+ring", [](CollCtx& c, void* b, size_t k, const ReduceSpec& s) {
          flat::directAllreduce(c, b, k, s, true);
        }, run, count, DType::F32, RedOp::Sum, false, fval);
        // Order-free on integers.
        allreduceCase<int64_t>("ringAllreduce", flat::ringAllreduce, run, count, DType::I64, RedOp::Sum, false, ival);
        allreduceCase<int64_t>("ringAllreduce", flat::ringAllreduce, run, count, DType::I64, RedOp::Max, false, ival);
        allreduceCase<int64_t>("ringAllreduce", flat::ringAllreduce, run, count, DType::I64, RedOp::Sum, true, ival);
        allreduceCase<int64_t>("rhdAllreduce", flat::rhdAllreduce, run, count, DType::I64, RedOp::Sum, false, ival);
        allreduceCase<int64_t>("rhdAllreduce", flat::rhdAllreduce, run, count, DType::I64, RedOp::Min, false, ival);
        allreduceCase<int64_t>("rhdAllreduce", flat::rhdAllreduce, run, count, DType::I64, RedOp::Sum, true, ival);
      }
    }
  }
}

// ---- broadcast ----

using BroadcastFn = std::function<void(CollCtx&, void*, size_t, int)>;

void broadcastCase(const char* name, const BroadcastFn& fn, const Run& run, size_t nbytes) {
  for (int root = 0; root < run.n; ++root) {
    std::vector<std::vector<uint8_t>> bufs(run.n, std::vector<uint8_t>(nbytes, 0xee));
    for (size_t i = 0; i < nbytes; ++i) bufs[root][i] = static_cast<uint8_t>(i * 7 + root);
    const auto errors = runRanks(run, [&](CollCtx& c) { fn(c, bufs[c.rank].data(), nbytes, root); });
    const std::string what = where(name, run, "nbytes=" + std::to_string(nbytes) + " root=" + std::to_string(root));
    if (!noErrors(errors, what)) continue;
    for (int r = 0; r < run.n; ++r) check(bufs[r] == bufs[root], what + ": rank " + std::to_string(r) + " got other bytes");
  }
}

void testBroadcast() {
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      for (size_t nbytes : {size_t{0}, size_t{3}, size_t{1000}}) {
        Run run{n, mode};
        broadcastCase("directBroadcast", flat::directBroadcast, run, nbytes);
        broadcastCase("scatterAllgatherBroadcast", flat::scatterAllgatherBroadcast, run, nbytes);
        broadcastCase("treeBroadcast", flat::treeBroadcast, run, nbytes);
        broadcastCase("chainBroadcast", flat::chainBroadcast, run, nbytes);
        Run hosts = run;
        hosts.hosts = true;
        broadcastCase("chainBroadcast(2 hosts)", flat::chainBroadcast, hosts, nbytes);
      }
    }
  }
}

// ---- reduce ----

using ReduceFn = std::function<void(CollCtx&, const void*, void*, size_t, const ReduceSpec&, int)>;

template <class T>
void reduceCase(const char* name, const ReduceFn& fn, const Run& run, size_t count, DType dt, bool inPlace,
                T (*val)(int, size_t)) {
  ReduceSpec spec;
  spec.dtype = dt;
  const auto want = expected<T>(run.n, count, RedOp::Sum, 0, val);
  for (int root = 0; root < run.n; ++root) {
    std::vector<std::vector<T>> ins(run.n, std::vector<T>(count)), outs(run.n, std::vector<T>(count, T(-1)));
    for (int r = 0; r < run.n; ++r)
      for (size_t i = 0; i < count; ++i) ins[r][i] = val(r, i);
    const auto before = ins;
    const auto errors = runRanks(run, [&](CollCtx& c) {
      T* out = inPlace ? ins[c.rank].data() : outs[c.rank].data();
      fn(c, ins[c.rank].data(), out, count, spec, root);
    });
    const std::string what = where(name, run, "count=" + std::to_string(count) + " root=" + std::to_string(root) +
                                                  (inPlace ? " in place" : ""));
    if (!noErrors(errors, what)) continue;
    size_t at = 0;
    check(sameBits(inPlace ? ins[root] : outs[root], want, &at), what + ": root differs at " + std::to_string(at));
    for (int r = 0; r < run.n; ++r)
      if (r != root || !inPlace) check(ins[r] == before[r], what + ": rank " + std::to_string(r) + "'s input changed");
  }
}

void testReduce() {
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      Run run{n, mode};
      Run hosts = run;
      hosts.hosts = true;
      for (size_t count : {size_t{0}, size_t{1}, size_t{37}, size_t{1000}}) {
        for (bool inPlace : {false, true}) {
          reduceCase<float>("gatherReduce", flat::gatherReduce, run, count, DType::F32, inPlace, fval);
          reduceCase<float>("directReduce", flat::directReduce, run, count, DType::F32, inPlace, fval);
          reduceCase<int64_t>("chainReduce", flat::chainReduce, run, count, DType::I64, inPlace, ival);
          reduceCase<int64_t>("chainReduce(2 hosts)", flat::chainReduce, hosts, count, DType::I64, inPlace, ival);
        }
      }
    }
  }
}

// ---- all-gather, gather, scatter ----

// Uneven blocks: rank r contributes (r * 13 + base) % 29 bytes (some empty).
std::vector<size_t> unevenBytes(int n, size_t base) {
  std::vector<size_t> v(n);
  for (int r = 0; r < n; ++r) v[r] = (static_cast<size_t>(r) * 13 + base) % 29 + (base > 100 ? base : 0);
  return v;
}

uint8_t byteOf(int rank, size_t i) {
  return static_cast<uint8_t>(rank * 31 + i * 5 + 1);
}

using AllgatherFn = std::function<void(CollCtx&, const void*, void* const*, const size_t*)>;

void allgatherCase(const char* name, const AllgatherFn& fn, const Run& run, size_t base) {
  const auto sizes = unevenBytes(run.n, base);
  std::vector<std::vector<uint8_t>> ins(run.n);
  for (int r = 0; r < run.n; ++r)
    for (size_t i = 0; i < sizes[r]; ++i) ins[r].push_back(byteOf(r, i));
  // outs[r][q]: rank r's copy of rank q's block
  std::vector<std::vector<std::vector<uint8_t>>> outs(run.n);
  for (int r = 0; r < run.n; ++r)
    for (int q = 0; q < run.n; ++q) outs[r].emplace_back(sizes[q], 0xee);
  const auto errors = runRanks(run, [&](CollCtx& c) {
    std::vector<void*> p;
    for (auto& o : outs[c.rank]) p.push_back(o.data());
    fn(c, ins[c.rank].data(), p.data(), sizes.data());
  });
  const std::string what = where(name, run, "base=" + std::to_string(base));
  if (!noErrors(errors, what)) return;
  for (int r = 0; r < run.n; ++r)
    for (int q = 0; q < run.n; ++q)
      check(outs[r][q] == ins[q], what + ": rank " + std::to_string(r) + " has a wrong block of rank " + std::to_string(q));
}

void testAllgatherGatherScatter() {
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      Run run{n, mode};
      for (size_t base : {size_t{0}, size_t{5}, size_t{300}}) {
        allgatherCase("directAllgatherv", flat::directAllgatherv, run, base);
        allgatherCase("bruckAllgatherv", flat::bruckAllgatherv, run, base);
        allgatherCase("ringAllgatherv", flat::ringAllgatherv, run, base);
        const auto sizes = unevenBytes(n, base);
        for (int root = 0; root < n; ++root) {
          // gather
          std::vector<std::vector<uint8_t>> ins(n);
          for (int r = 0; r < n; ++r)
            for (size_t i = 0; i < sizes[r]; ++i) ins[r].push_back(byteOf(r, i));
          std::vector<std::vector<uint8_t>> got;
          for (int q = 0; q < n; ++q) got.emplace_back(sizes[q], 0xee);
          auto errors = runRanks(run, [&](CollCtx& c) {
            std::vector<void*> p(n, nullptr);
            if (c.rank == root)
              for (int q = 0; q < n; ++q) p[q] = got[q].data();
            flat::directGatherv(c, ins[c.rank].data(), p.data(), sizes.data(), root);
          });
          std::string what = where("directGatherv", run, "root=" + std::to_string(root));
          if (noErrors(errors, what))
            for (int q = 0; q < n; ++q) check(got[q] == ins[q], what + ": wrong block of rank " + std::to_string(q));
          // scatter
          std::vector<std::vector<uint8_t>> mine;
          for (int r = 0; r < n; ++r) mine.emplace_back(sizes[r], 0xee);
          errors = runRanks(run, [&](CollCtx& c) {
            std::vector<const void*> p(n, nullptr);
            if (c.rank == root)
              for (int q = 0; q < n; ++q) p[q] = ins[q].data();
            flat::directScatterv(c, p.data(), mine[c.rank].data(), sizes.data(), root);
          });
          what = where("directScatterv", run, "root=" + std::to_string(root));
          if (noErrors(errors, what))
            for (int r = 0; r < n; ++r) check(mine[r] == ins[r], what + ": rank " + std::to_string(r) + " got a wrong block");
        }
      }
    }
  }
}

// ---- reduce_scatter ----

using ReduceScatterFn = std::function<void(CollCtx&, const void* const*, void*, const size_t*, const ReduceSpec&)>;

template <class T>
void reduceScatterCase(const char* name, const ReduceScatterFn& fn, const Run& run, size_t base, DType dt, bool avg,
                       T (*val)(int, size_t)) {
  // counts[q]: elements of slice q (uneven, some empty); rank r's contribution to slice q starts
  // at element offs[q] of its input, val(r, offs[q] + i).
  std::vector<size_t> counts(run.n), offs(run.n);
  size_t total = 0;
  for (int q = 0; q < run.n; ++q) {
    counts[q] = (static_cast<size_t>(q) * 7 + base) % 11 + (base > 100 ? base : 0);
    offs[q] = total;
    total += counts[q];
  }
  std::vector<std::vector<T>> ins(run.n, std::vector<T>(total)), outs(run.n);
  for (int r = 0; r < run.n; ++r) {
    for (size_t i = 0; i < total; ++i) ins[r][i] = val(r, i);
    outs[r].assign(counts[r], T(-1));
  }
  ReduceSpec spec;
  spec.dtype = dt;
  spec.divisor = avg ? run.n : 0;
  const auto errors = runRanks(run, [&](CollCtx& c) {
    std::vector<const void*> p;
    for (int q = 0; q < run.n; ++q) p.push_back(ins[c.rank].data() + offs[q]);
    fn(c, p.data(), outs[c.rank].data(), counts.data(), spec);
  });
  const std::string what = where(name, run, "base=" + std::to_string(base) + (avg ? " AVG" : ""));
  if (!noErrors(errors, what)) return;
  const auto all = expected<T>(run.n, total, RedOp::Sum, spec.divisor, val);
  for (int r = 0; r < run.n; ++r) {
    std::vector<T> want(all.begin() + offs[r], all.begin() + offs[r] + counts[r]);
    size_t at = 0;
    check(sameBits(outs[r], want, &at), what + ": rank " + std::to_string(r) + " differs at " + std::to_string(at));
  }
}

void testReduceScatter() {
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      Run run{n, mode};
      for (size_t base : {size_t{0}, size_t{3}, size_t{200}}) {
        reduceScatterCase<float>("directReduceScatterv", flat::directReduceScatterv, run, base, DType::F32, false, fval);
        reduceScatterCase<float>("directReduceScatterv", flat::directReduceScatterv, run, base, DType::F32, true, fval);
        reduceScatterCase<int64_t>("ringReduceScatter", flat::ringReduceScatter, run, base, DType::I64, false, ival);
        reduceScatterCase<int64_t>("ringReduceScatter", flat::ringReduceScatter, run, base, DType::I64, true, ival);
      }
    }
  }
}

// ---- all_to_all, barrier ----

void testAlltoallBarrier() {
  for (auto mode : kModes) {
    for (int n : kRankCounts) {
      Run run{n, mode};
      // bytes[r][q]: what r sends to q
      auto bytes = [](int r, int q) { return static_cast<size_t>((r * 5 + q * 3) % 9) * 17; };
      std::vector<std::vector<std::vector<uint8_t>>> sends(n), recvs(n);
      for (int r = 0; r < n; ++r) {
        for (int q = 0; q < n; ++q) {
          std::vector<uint8_t> b(bytes(r, q));
          for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(r * 16 + q + i);
          sends[r].push_back(b);
          recvs[r].emplace_back(bytes(q, r), 0xee);
        }
      }
      auto errors = runRanks(run, [&](CollCtx& c) {
        std::vector<const void*> sp;
        std::vector<void*> rp;
        std::vector<size_t> sb, rb;
        for (int q = 0; q < n; ++q) {
          sp.push_back(sends[c.rank][q].data());
          sb.push_back(sends[c.rank][q].size());
          rp.push_back(recvs[c.rank][q].data());
          rb.push_back(recvs[c.rank][q].size());
        }
        flat::pairwiseAlltoallv(c, sp.data(), sb.data(), rp.data(), rb.data());
      });
      const std::string what = where("pairwiseAlltoallv", run);
      if (noErrors(errors, what))
        for (int r = 0; r < n; ++r)
          for (int q = 0; q < n; ++q)
            check(recvs[r][q] == sends[q][r], what + ": rank " + std::to_string(r) + " got a wrong block from " + std::to_string(q));
      // The barrier: no rank leaves before every rank arrived.
      std::atomic<int> arrived{0};
      std::vector<int> seen(n, -1);
      errors = runRanks(run, [&](CollCtx& c) {
        std::this_thread::sleep_for(std::chrono::milliseconds(c.rank == n - 1 ? 20 : 0));
        arrived.fetch_add(1);
        flat::disseminationBarrier(c);
        seen[c.rank] = arrived.load();
      });
      const std::string bw = where("disseminationBarrier", run);
      if (noErrors(errors, bw))
        for (int r = 0; r < n; ++r) check(seen[r] == n, bw + ": rank " + std::to_string(r) + " left early");
    }
  }
}

// ---- failures: a disagreement or a missing rank fails every rank, within the deadline ----

void testFailures() {
  for (auto mode : kModes) {
    for (int n : {2, 3, 4}) {
      Run run{n, mode};
      run.timeout = std::chrono::milliseconds(1000);
      // Rank 0 gathers 8 bytes per rank, the others 16: receives fail on the size, never overflow.
      std::vector<std::vector<uint8_t>> bufs(n, std::vector<uint8_t>(16 * n + 64, 0));
      auto errors = runRanks(run, [&](CollCtx& c) {
        std::vector<size_t> sizes(n, c.rank == 0 ? 8 : 16);
        std::vector<void*> outs;
        for (int q = 0; q < n; ++q) outs.push_back(bufs[c.rank].data() + 16 * q);
        flat::directAllgatherv(c, bufs[c.rank].data() + 16 * n, outs.data(), sizes.data());
      });
      for (int r = 0; r < n; ++r)
        check(!errors[r].empty(), where("mismatched sizes", run) + ": rank " + std::to_string(r) + " did not fail");
      for (int r = 0; r < n; ++r)
        for (size_t i = 16 * n; i < bufs[r].size(); ++i)
          if (bufs[r][i] != 0) {
            fail(where("mismatched sizes", run) + ": rank " + std::to_string(r) + " wrote past its blocks");
            break;
          }
      // The last rank never comes: the others raise a timeout naming a peer.
      errors = runRanks(run, [&](CollCtx& c) {
        if (c.rank == n - 1) return;
        flat::disseminationBarrier(c);
      });
      for (int r = 0; r < n - 1; ++r)
        check(errors[r].find("Timed out") != std::string::npos,
              where("missing rank", run) + ": rank " + std::to_string(r) + " said '" + errors[r] + "'");
    }
  }
}

}  // namespace

int main() {
  testAllreduce();
  testBroadcast();
  testReduce();
  testAllgatherGatherScatter();
  testReduceScatter();
  testAlltoallBarrier();
  testFailures();
  std::printf("ranks");
  for (int n : kRankCounts) std::printf(" %d", n);
  std::printf("\nmodes");
  for (auto m : kModes) std::printf(" %s", modeName(m).c_str());
  std::printf("\n");
  for (const auto& [algo, cases] : ran) {
    std::printf("ran %s:", algo.c_str());
    for (const auto& c : cases) std::printf(" %s", c.c_str());
    std::printf("\n");
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
