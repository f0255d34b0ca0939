// Unit tests of the strict CUDA/NCCL double (src/cuda/double): ranks are threads of this
// process, each with its own simulated machine, meeting in one HashStore. Clean scenarios must
// give the expected values and no violation; misuse must give the exact violation.
#include "cuda_double_harness.hpp"

namespace {

// ---- tests ------------------------------------------------------------------------------

void allReduceEveryTypeAndOp() {
  Cluster cl(3, "allreduce");
  const NcclType types[] = {NcclType::Int8,    NcclType::Uint8,   NcclType::Int32,    NcclType::Uint32,
                            NcclType::Int64,   NcclType::Uint64,  NcclType::Float16,  NcclType::Float32,
                            NcclType::Float64, NcclType::BFloat16, NcclType::Float8e4m3, NcclType::Float8e5m2};
  const NcclRedOp ops[] = {kNcclSum, kNcclProd, kNcclMax, kNcclMin, kNcclAvg};
  const int64_t n = 37;
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 3, r.rank);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    int k = 0;
    for (auto t : types) {
      std::vector<at::Tensor> all;
      for (int q = 0; q < 3; ++q) all.push_back(input(q, t, n));
      for (auto op : ops) {
        at::Tensor send = all[static_cast<size_t>(r.rank)].clone();
        const bool inPlace = (k++ % 2) == 1;
        at::Tensor recv = inPlace ? send : at::zeros({n}, send.options());
        OK(r.nccl().allReduce(send.data_ptr(), recv.data_ptr(), n, t, op, c, s));
        drain(r.dev(), s);
        const auto want = expected(all, t, op);
        EXPECT(at::equal(recv.to(at::kDouble), want), "type " << static_cast<int>(t) << " op " << op << ": got "
                                                              << recv.to(at::kDouble) << " want " << want);
      }
    }
    // One big one, for sizes beyond a few elements.
    at::Tensor big = at::full({300000}, 1.0f + r.rank);
    OK(r.nccl().allReduce(big.data_ptr(), big.data_ptr(), big.numel(), NcclType::Float32, kNcclSum, c, s));
    drain(r.dev(), s);
    EXPECT(at::equal(big, at::full({300000}, 6.0f)), "big allreduce");
    closeComm(r.nccl(), c);
    auto cnt = td::counters(*r.m);
    EXPECT(cnt["comms_created"] == 1 && cnt["comms_blocking"] == 1 && cnt["comm_nranks_3"] == 1, "counters");
    EXPECT(cnt["group_launches"] == 61, "group_launches " << cnt["group_launches"]);
  });
  cl.expectClean();
}

void premulHostAndDevice() {
  Cluster cl(3, "premul");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 3, r.rank);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    const int64_t n = 10;
    auto x = [](int q) { return at::arange(10, at::kFloat) + q; };
    // Host: the factor is copied at creation; changing it afterwards changes nothing.
    float f = 1.0f + r.rank;
    NcclRedOp host = 0;
    OK(r.nccl().redOpCreatePreMulSum(&host, &f, NcclType::Float32, ScalarResidence::HostImmediate, c));
    f = 1000.0f;
    at::Tensor a = x(r.rank);
    OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), n, NcclType::Float32, host, c, s));
    drain(r.dev(), s);
    EXPECT(at::allclose(a, x(0) * 1 + x(1) * 2 + x(2) * 3), "host premul: " << a);
    // Device: read when the op runs, so a value written after the enqueue counts.
    at::Tensor factor = r.dev().empty({1}, at::kFloat, s);
    factor.fill_(100.0f);
    NcclRedOp onDevice = 0;
    OK(r.nccl().redOpCreatePreMulSum(&onDevice, factor.data_ptr(), NcclType::Float32, ScalarResidence::Device, c));
    Gate g;
    g.hold(r.dev(), s);
    at::Tensor b = x(r.rank);
    OK(r.nccl().allReduce(b.data_ptr(), b.data_ptr(), n, NcclType::Float32, onDevice, c, s));
    factor.fill_(2.0f + r.rank);
    g.open();
    drain(r.dev(), s);
    EXPECT(at::allclose(b, x(0) * 2 + x(1) * 3 + x(2) * 4), "device premul: " << b);
    OK(r.nccl().redOpDestroy(host, c));
    OK(r.nccl().redOpDestroy(onDevice, c));
    EXPECT(r.nccl().redOpDestroy(99, c) == R::InvalidArgument, "destroying no operator");
    EXPECT(td::violations(*r.m).size() == 1 && contains(td::violations(*r.m), "is no PreMulSum operator"),
          joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    closeComm(r.nccl(), c);
    auto cnt = td::counters(*r.m);
    EXPECT(cnt["premul_host"] == 1 && cnt["premul_device"] == 1, "premul counters");
  });
  cl.expectClean();
}

void rootedAndGatherScatter() {
  Cluster cl(3, "colls");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 3, r.rank);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    const int64_t n = 6;
    auto x = [&](int q) { return at::arange(n, at::kInt) * 10 + q; };
    for (int inPlace = 0; inPlace < 2; ++inPlace) {
      // broadcast from 1
      at::Tensor bs = x(r.rank), br = inPlace ? bs : at::zeros({n}, at::kInt);
      OK(r.nccl().broadcast(bs.data_ptr(), br.data_ptr(), n, NcclType::Int32, 1, c, s));
      // reduce (max) to 2: only the root's output is written
      at::Tensor rs = x(r.rank), rr = inPlace ? rs : at::full({n}, -1, at::kInt);
      const at::Tensor rrBefore = rr.clone();
      OK(r.nccl().reduce(rs.data_ptr(), rr.data_ptr(), n, NcclType::Int32, kNcclMax, 2, c, s));
      // allGather: rank q's block at q*n; in place, the send buffer is this rank's block
      at::Tensor gr = at::zeros({3 * n}, at::kInt);
      at::Tensor gs = inPlace ? gr.narrow(0, r.rank * n, n) : x(r.rank);
      if (inPlace) gs.copy_(x(r.rank));
      OK(r.nccl().allGather(gs.data_ptr(), gr.data_ptr(), n, NcclType::Int32, c, s));
      // reduceScatter (sum): rank q gets block q of the sum
      at::Tensor ss = at::cat(std::vector<at::Tensor>{x(r.rank), x(r.rank) + 100, x(r.rank) + 200});
      at::Tensor sr = inPlace ? ss.narrow(0, r.rank * n, n) : at::zeros({n}, at::kInt);
      OK(r.nccl().reduceScatter(ss.data_ptr(), sr.data_ptr(), n, NcclType::Int32, kNcclSum, c, s));
      drain(r.dev(), s);
      EXPECT(at::equal(br, x(1)), "broadcast: " << br);
      EXPECT(at::equal(rr, r.rank == 2 ? x(2) : rrBefore), "reduce: " << rr);
      EXPECT(at::equal(gr, at::cat(std::vector<at::Tensor>{x(0), x(1), x(2)})), "allGather: " << gr);
      EXPECT(at::equal(sr, x(0) + x(1) + x(2) + 300 * r.rank), "reduceScatter: " << sr);
    }
    closeComm(r.nccl(), c);
  });
  cl.expectClean();
}

void sendRecvInAndOutOfGroups() {
  Cluster cl(3, "p2p");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 3, r.rank);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    const int right = (r.rank + 1) % 3, left = (r.rank + 2) % 3;
    for (int64_t n : {int64_t{16}, int64_t{100000}}) {  // eager, then rendezvous (400 KB)
      // In a group, one stream: sends are posted before receives wait.
      at::Tensor out = at::full({n}, static_cast<float>(r.rank)), in = at::zeros({n});
      OK(r.nccl().groupStart());
      OK(r.nccl().send(out.data_ptr(), n, NcclType::Float32, right, c, s));
      OK(r.nccl().recv(in.data_ptr(), n, NcclType::Float32, left, c, s));
      OK(r.nccl().groupEnd());
      drain(r.dev(), s);
      EXPECT(at::equal(in, at::full({n}, static_cast<float>(left))), "group ring n=" << n);
    }
    // Outside groups: small sends complete without the receive (eager).
    at::Tensor out = at::full({16}, 1.0f + r.rank), in = at::zeros({16});
    OK(r.nccl().send(out.data_ptr(), 16, NcclType::Float32, right, c, s));
    OK(r.nccl().recv(in.data_ptr(), 16, NcclType::Float32, left, c, s));
    drain(r.dev(), s);
    EXPECT(at::equal(in, at::full({16}, 1.0f + left)), "eager ring");
    // A large one between two ranks outside groups (rendezvous, no cycle).
    at::Tensor big = at::full({100000}, 7.0f), got = at::zeros({100000});
    if (r.rank == 0) OK(r.nccl().send(big.data_ptr(), big.numel(), NcclType::Float32, 1, c, s));
    if (r.rank == 1) OK(r.nccl().recv(got.data_ptr(), got.numel(), NcclType::Float32, 0, c, s));
    drain(r.dev(), s);
    if (r.rank == 1) EXPECT(at::equal(got, big), "large pair");
    // To oneself, inside a group.
    at::Tensor self = at::zeros({16});
    OK(r.nccl().groupStart());
    OK(r.nccl().send(out.data_ptr(), 16, NcclType::Float32, r.rank, c, s));
    OK(r.nccl().recv(self.data_ptr(), 16, NcclType::Float32, r.rank, c, s));
    OK(r.nccl().groupEnd());
    drain(r.dev(), s);
    EXPECT(at::equal(self, out), "self in group");
    closeComm(r.nccl(), c);
  });
  cl.expectClean();
}

// An unbatched ring of rendezvous sends: with one stream per rank each send waits for a receive
// queued behind the peer's own send, as on NCCL; a stream per peer (and a communicator per
// pair, as NCCL serializes one communicator's launches) completes.
void unbatchedRing() {
  for (int variant = 0; variant < 3; ++variant) {
    Cluster cl(3, "ring" + std::to_string(variant), quick(300));
    const int64_t n = 100000;
    cl.run([&](Rank& r) {
      auto world = makeComm(r, *cl.store, "id", 3, r.rank);
      const int right = (r.rank + 1) % 3, left = (r.rank + 2) % 3;
      // Pair communicators by split: pair k holds ranks k and k+1.
      NcclCommHandle pair[3] = {nullptr, nullptr, nullptr};
      for (int k = 0; k < 3; ++k) {
        const bool in = r.rank == k || r.rank == (k + 1) % 3;
        OK(r.nccl().commSplit(world, in ? 0 : -1, r.rank, &pair[k], NcclCommConfig{}));
      }
      NcclCommHandle toRight = variant == 2 ? world : pair[r.rank];
      NcclCommHandle fromLeft = variant == 2 ? world : pair[left];
      const int rightPeer = variant == 2 ? right : (r.rank < right ? 1 : 0);
      const int leftPeer = variant == 2 ? left : (left < r.rank ? 0 : 1);
      const Stream s1 = r.dev().newStream(r.dev().current(), false);
      const Stream s2 = variant == 0 ? s1 : r.dev().newStream(r.dev().current(), false);
      at::Tensor out = at::full({n}, static_cast<float>(r.rank)), in = at::zeros({n});
      OK(r.nccl().send(out.data_ptr(), n, NcclType::Float32, rightPeer, toRight, s1));
      OK(r.nccl().recv(in.data_ptr(), n, NcclType::Float32, leftPeer, fromLeft, s2));
      if (variant == 1) {
        drain(r.dev(), s1);
        drain(r.dev(), s2);
        EXPECT(at::equal(in, at::full({n}, static_cast<float>(left))), "ring with a stream per peer");
      } else {
        EXPECT(awaitViolation(*r.m, "send #0 to rank"), "no hang reported:" << joined(td::violations(*r.m)));
        EXPECT(contains(td::violations(*r.m), "hang: "), "hang text");
        for (auto h : {world, pair[r.rank], pair[left]}) OK(r.nccl().commAbort(h));
        td::synchronize(*r.m);  // the aborted items let the streams drain
        EXPECT(!contains(td::violations(*r.m), "synchronize"), joined(td::violations(*r.m)));
        td::clearViolations(*r.m);
        return;
      }
      for (int k = 0; k < 3; ++k) {
        if (pair[k]) closeComm(r.nccl(), pair[k]);
      }
      closeComm(r.nccl(), world);
    });
    cl.expectClean();
  }
}

void groupMisuse() {
  Cluster cl(1, "group");
  cl.run([&](Rank& r) {
    EXPECT(r.nccl().groupEnd() == R::InvalidUsage, "groupEnd without start");
    EXPECT(contains(td::violations(*r.m), "ncclGroupEnd without ncclGroupStart"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    // Nested groups launch at the outermost end; ops on two streams of one comm are one launch.
    auto c = makeComm(r, *cl.store, "id", 1, 0);
    const Stream s1 = r.dev().newStream(0, false), s2 = r.dev().newStream(0, true);
    at::Tensor a = at::ones({4}), b = at::ones({4}) * 2;
    const auto before = td::counters(*r.m)["group_launches"];
    OK(r.nccl().groupStart());
    OK(r.nccl().groupStart());
    OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s1));
    OK(r.nccl().groupEnd());
    OK(r.nccl().allReduce(b.data_ptr(), b.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s2));
    EXPECT(td::counters(*r.m)["group_launches"] == before, "launched before the outermost groupEnd");
    OK(r.nccl().groupEnd());
    drain(r.dev(), s1);
    drain(r.dev(), s2);
    EXPECT(td::counters(*r.m)["group_launches"] == before + 1, "one launch");
    // An invalid op fails its group.
    OK(r.nccl().groupStart());
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, 77, c, s1) == R::InvalidArgument, "op");
    EXPECT(r.nccl().groupEnd() == R::InvalidArgument, "group error");
    EXPECT(contains(td::violations(*r.m), "invalid reduction operator 77"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    // A stream of another device.
    const Stream other = r.dev().newStream(1, false);
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, c, other) ==
              R::UnhandledCudaError, "other device");
    EXPECT(contains(td::violations(*r.m), "a stream of another device"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    closeComm(r.nccl(), c);
  });
  cl.expectClean();
}

void twoThreadsOneComm() {
  Cluster cl(1, "threads");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 1, 0);
    const Stream s = r.dev().newStream(0, false);
    at::Tensor a = at::ones({4}), b = at::ones({4});
    OK(r.nccl().groupStart());
    OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s));
    std::thread other([&] {
      r.dev().set(0);
      (void)r.nccl().allReduce(b.data_ptr(), b.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s);
    });
    other.join();
    OK(r.nccl().groupEnd());
    drain(r.dev(), s);
    EXPECT(contains(td::violations(*r.m), "used from two threads at once"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    // After the group ended the comm is free again: another thread may use it.
    R laterResult = R::InternalError;
    std::thread later([&] {
      r.dev().set(0);
      laterResult = r.nccl().allReduce(b.data_ptr(), b.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s);
    });
    later.join();
    OK(laterResult);
    drain(r.dev(), s);
    EXPECT(td::violations(*r.m).empty(), joined(td::violations(*r.m)));
    closeComm(r.nccl(), c);
  });
  cl.expectClean();
}

void creationShortOfRanks() {
  Cluster cl(2, "short", quick(300));
  cl.run([&](Rank& r) {
    NcclUniqueId id{};
    if (r.rank == 0) {
      OK(r.nccl().getUniqueId(&id));
      cl.store->set("id", std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
    } else {
      cl.store->wait({"id"});
      auto v = cl.store->get("id");
      std::memcpy(id.internal, v.data(), sizeof id.internal);
    }
    NcclCommConfig cfg;
    cfg.blocking = false;
    cfg.name = "short";
    NcclCommHandle c = nullptr;
    EXPECT(r.nccl().commInitRank(&c, 3, id, r.rank, cfg) == R::InProgress, "nonblocking init");
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (!contains(td::violations(*r.m), "hang: communicator short creation joined by ranks {0, 1} of 3") &&
           Clock::now() < until) {
      NcclResult st = R::Success;
      OK(r.nccl().commGetAsyncError(c, &st));
      EXPECT(st == R::InProgress, "still joining");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT(contains(td::violations(*r.m), "joined by ranks {0, 1} of 3"), joined(td::violations(*r.m)));
    OK(r.nccl().commAbort(c));
    // Any call after abort touches freed memory on NCCL.
    EXPECT(r.nccl().commDestroy(c) == R::InvalidUsage, "destroy after abort");
    EXPECT(contains(td::violations(*r.m), "after ncclCommAbort, which frees it"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
  });
  cl.expectClean();
}

void callsWithoutDevice() {
  auto m = td::newMachine(quick());
  auto rt = td::runtime(m, c10::make_intrusive<c10d::PrefixStore>("nodev", sharedStore()));
  std::thread t([&] {
    (void)rt.device->currentStream(0);
    (void)rt.device->currentStream(0);  // reported once per thread and call
    (void)rt.nccl->groupStart();
    (void)rt.nccl->groupEnd();
    (void)rt.nccl->version();  // needs no device
  });
  t.join();
  auto v = td::violations(*m);
  EXPECT(v.size() == 3, joined(v));
  EXPECT(contains(v, "cuda call getCurrentCUDAStream on thread ") &&
            contains(v, "before any device was selected (cudaSetDevice)") && contains(v, "cuda call ncclGroupStart"),
        joined(v));
  EXPECT(rt.nccl->version() == td::kDoubleNcclVersion, "version");
}

// A staging buffer from stream A used by an op on stream B and dropped before B ran it.
void freedStagingBuffer() {
  for (int recorded = 0; recorded < 2; ++recorded) {
    Cluster cl(1, "staging" + std::to_string(recorded));
    cl.run([&](Rank& r) {
      auto c = makeComm(r, *cl.store, "id", 1, 0);
      const Stream a = r.dev().newStream(0, false), b = r.dev().newStream(0, false);
      Gate g;
      g.hold(r.dev(), b);
      at::Tensor staging = r.dev().empty({256}, at::kFloat, a);
      staging.fill_(3.0f);
      at::Tensor out = at::zeros({256});
      OK(r.nccl().allReduce(staging.data_ptr(), out.data_ptr(), 256, NcclType::Float32, kNcclSum, c, b));
      if (recorded) r.dev().recordStream(staging, b);
      staging.reset();
      drain(r.dev(), a);  // A's release runs
      g.open();
      drain(r.dev(), b);
      auto v = td::violations(*r.m);
      if (recorded) {
        EXPECT(v.empty(), joined(v));
        EXPECT(at::equal(out, at::full({256}, 3.0f)), "recorded staging: " << out);
      } else {
        EXPECT(v.size() == 1 && contains(v, "(1024 bytes, allocated on cuda:0 stream 1) was freed before "
                                            "cuda:0 stream 2 ran all_reduce #0"),
               joined(v));
        td::clearViolations(*r.m);
      }
      closeComm(r.nccl(), c);
    });
    cl.expectClean();
  }
}

void eventsOrderStreams() {
  auto m = td::newMachine(quick());
  auto dev = td::device(m);
  dev->set(0);
  const Stream a = dev->newStream(0, false), b = dev->newStream(0, false), other = dev->newStream(0, false);
  Gate g;
  std::atomic<int> x{0};
  auto fut = g.f;
  dev->enqueue(a, [fut, &x] {
    fut.wait_for(std::chrono::seconds(10));
    x = 1;
  });
  auto ev = dev->newEvent();
  EXPECT(ev->query(), "never recorded: passed");
  ev->record(a);
  EXPECT(!ev->query(), "gated: not passed");
  ev->block(b);
  ev->record(other);  // a re-record does not move the wait b already captured
  std::atomic<int> seen{-1};
  dev->enqueue(b, [&] { seen = x.load(); });
  drain(*dev, other);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT(seen == -1, "b ran before a's recorded point");
  g.open();
  drain(*dev, b);
  EXPECT(seen == 1, "b saw " << seen);
  // Timing events.
  auto t0 = dev->newEvent(true), t1 = dev->newEvent(true);
  t0->record(a);
  dev->enqueue(a, [] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); });
  t1->record(a);
  t1->synchronize();
  EXPECT(t0->query() && t1->query(), "passed");
  const float ms = t0->elapsedMs(*t1);
  EXPECT(ms >= 4.5f && ms < 1000.0f, "elapsed " << ms);
  EXPECT(td::violations(*m).empty(), joined(td::violations(*m)));
}

void delaysKeepStreamOrder() {
  td::Options o = quick();
  o.maxDelayUs = 200;
  o.seed = 0;
  auto m = td::newMachine(o);
  auto dev = td::device(m);
  dev->set(1);
  const Stream s1 = dev->newStream(1, false), s2 = dev->currentStream(1);
  std::vector<int> seen1, seen2;
  for (int i = 0; i < 300; ++i) {
    dev->enqueue(s1, [&seen1, i] { seen1.push_back(i); });
    dev->enqueue(s2, [&seen2, i] { seen2.push_back(i); });
  }
  td::synchronize(*m);
  EXPECT(seen1.size() == 300 && seen2.size() == 300, "all ran");
  for (int i = 0; i < 300; ++i) EXPECT(seen1[i] == i && seen2[i] == i, "order at " << i);
  EXPECT(s2.id() == 0 && s2.device_index() == 1, "default stream");
  // An item that throws is a violation; the stream goes on.
  dev->enqueue(s1, [] { throw std::runtime_error("boom"); });
  bool after = false;
  dev->enqueue(s1, [&] { after = true; });
  td::synchronize(*m);
  EXPECT(after && contains(td::violations(*m), "stream item threw: boom"), joined(td::violations(*m)));
}

void nonblockingInProgress() {
  Cluster cl(2, "nonblocking");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 2, r.rank, /*blocking=*/false);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    at::Tensor a = at::ones({8});
    // The first launch on a nonblocking comm is in progress until polled.
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 8, NcclType::Float32, kNcclSum, c, s) == R::InProgress, "");
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 8, NcclType::Float32, kNcclSum, c, s) == R::InvalidUsage, "");
    EXPECT(contains(td::violations(*r.m), "while it is still in progress (ncclInProgress)"),
           joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    EXPECT(poll(r.nccl(), c) == R::Success, "settles");
    settle(r.nccl(), c, r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 8, NcclType::Float32, kNcclSum, c, s));
    // Nor destroyed while in progress: here created, never polled.
    NcclUniqueId id{};
    if (r.rank == 0) {
      OK(r.nccl().getUniqueId(&id));
      cl.store->set("id2", std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
    } else {
      cl.store->wait({"id2"});
      auto v = cl.store->get("id2");
      std::memcpy(id.internal, v.data(), sizeof id.internal);
    }
    NcclCommConfig cfg;
    cfg.blocking = false;
    NcclCommHandle young = nullptr;
    EXPECT(r.nccl().commInitRank(&young, 2, id, r.rank, cfg) == R::InProgress, "");
    EXPECT(r.nccl().commDestroy(young) == R::InvalidUsage, "destroy while joining");
    EXPECT(contains(td::violations(*r.m), "ncclCommDestroy on communicator comm-"), joined(td::violations(*r.m)));
    td::clearViolations(*r.m);
    EXPECT(poll(r.nccl(), young) == R::Success, "young settles");
    OK(r.nccl().commDestroy(young));
    for (int i = 0; i < 4; ++i) {
      settle(r.nccl(), c, r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 8, NcclType::Float32, kNcclSum, c, s));
    }
    drain(r.dev(), s);
    EXPECT(at::equal(a, at::full({8}, 64.0f)), "six allreduces: " << a);
    closeComm(r.nccl(), c);
    EXPECT(td::counters(*r.m)["comms_nonblocking"] == 2, "counter");
  });
  cl.expectClean();
}

void splitComms() {
  for (int blocking = 0; blocking < 2; ++blocking) {
    Cluster cl(4, "split" + std::to_string(blocking));
    cl.run([&](Rank& r) {
      auto world = makeComm(r, *cl.store, "id", 4, r.rank);
      const int colors[] = {0, 1, 0, -1}, keys[] = {5, 0, 1, 0};
      NcclCommConfig cfg;
      cfg.blocking = blocking;
      NcclCommHandle sub = nullptr;
      const R res = r.nccl().commSplit(world, colors[r.rank], keys[r.rank], &sub, cfg);
      if (r.rank == 3) {
        OK(res);
        EXPECT(sub == nullptr, "no color: no comm");
      } else {
        settle(r.nccl(), sub, res);
        const Stream s = r.dev().newStream(r.dev().current(), false);
        // Ordered by key: rank 2 is rank 0 of {0, 2}. A broadcast from sub-rank 0 tells.
        at::Tensor t = at::full({3}, static_cast<float>(r.rank));
        settle(r.nccl(), sub, r.nccl().broadcast(t.data_ptr(), t.data_ptr(), 3, NcclType::Float32, 0, sub, s));
        drain(r.dev(), s);
        const float want = r.rank == 1 ? 1.0f : 2.0f;
        EXPECT(at::equal(t, at::full({3}, want)), "rank " << r.rank << " got " << t);
        closeComm(r.nccl(), sub);
      }
      closeComm(r.nccl(), world);
      EXPECT(td::counters(*r.m)["splits"] == 1, "splits");
    });
    cl.expectClean();
  }
}

void abortUnblocks() {
  Cluster cl(2, "abort");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 2, r.rank);
    if (r.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      OK(r.nccl().commAbort(c));
      return;
    }
    const Stream s = r.dev().newStream(r.dev().current(), false);
    at::Tensor a = at::full({8}, 5.0f);
    OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 8, NcclType::Float32, kNcclSum, c, s));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto e = r.dev().newEvent();
    e->record(s);
    EXPECT(!e->query(), "waits for the absent peer");
    const auto t0 = Clock::now();
    OK(r.nccl().commAbort(c));
    e->synchronize();
    EXPECT(Clock::now() - t0 < std::chrono::seconds(2), "abort stopped the wait");
    EXPECT(at::equal(a, at::full({8}, 5.0f)), "output untouched");
    EXPECT(r.nccl().commAbort(c) == R::InvalidUsage, "second abort");
    td::clearViolations(*r.m);
  });
  cl.expectClean();
}

void mismatches() {
  Cluster cl(2, "mismatch");
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 2, r.rank);
    const Stream s = r.dev().newStream(r.dev().current(), false);
    at::Tensor a = at::ones({100});
    if (r.rank == 0) OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 100, NcclType::Float32, kNcclSum, c, s));
    if (r.rank == 1) OK(r.nccl().broadcast(a.data_ptr(), a.data_ptr(), 100, NcclType::Float32, 0, c, s));
    drain(r.dev(), s);
    EXPECT(contains(td::violations(*r.m),
                    "#0: rank 0 all_reduce 100 x float32 sum, rank 1 broadcast 100 x float32 root 0"),
          joined(td::violations(*r.m)));
    NcclResult st = R::Success;
    OK(r.nccl().commGetAsyncError(c, &st));
    EXPECT(st == R::InvalidUsage, "async error " << static_cast<int>(st));
    EXPECT(std::string(r.nccl().lastError(c)).find("mismatched collectives") != std::string::npos, "lastError");
    OK(r.nccl().commAbort(c));
    // Sizes of a send and its receive must agree.
    auto p = makeComm(r, *cl.store, "id2", 2, r.rank);
    at::Tensor b = at::ones({12});
    if (r.rank == 0) OK(r.nccl().send(b.data_ptr(), 10, NcclType::Float32, 1, p, s));
    if (r.rank == 1) OK(r.nccl().recv(b.data_ptr(), 12, NcclType::Float32, 0, p, s));
    drain(r.dev(), s);
    if (r.rank == 1) {
      EXPECT(contains(td::violations(*r.m), "send/recv size mismatch on comm-"), joined(td::violations(*r.m)));
      EXPECT(contains(td::violations(*r.m), "rank 0 sends 40 bytes to rank 1 (send #0), rank 1 receives 48 bytes"), "");
    }
    OK(r.nccl().commAbort(p));
    td::clearViolations(*r.m);
  });
  cl.expectClean();
}

void lifecycleMisuse() {
  Cluster cl(1, "lifecycle", quick(2000));
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 1, 0);
    const Stream s = r.dev().newStream(0, false);
    at::Tensor a = at::ones({4});
    Gate g;
    g.hold(r.dev(), s);
    OK(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s));
    std::thread opener([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      g.open();
    });
    OK(r.nccl().commDestroy(c));  // queued work, no finalize: NCCL would block here
    opener.join();
    EXPECT(contains(td::violations(*r.m), "launched operations not finished and no ncclCommFinalize"),
          joined(td::violations(*r.m)));
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, c, s) == R::InvalidUsage, "");
    EXPECT(contains(td::violations(*r.m), "ncclAllReduce on communicator comm-"), "");
    EXPECT(contains(td::violations(*r.m), "after ncclCommDestroy, which frees it (use after free)"), "");
    // Finalize, then ops are misuse.
    auto d = makeComm(r, *cl.store, "id2", 1, 0);
    OK(r.nccl().commFinalize(d));
    EXPECT(r.nccl().allReduce(a.data_ptr(), a.data_ptr(), 4, NcclType::Float32, kNcclSum, d, s) == R::InvalidUsage, "");
    EXPECT(contains(td::violations(*r.m), "after ncclCommFinalize"), "");
    OK(r.nccl().commDestroy(d));
    td::clearViolations(*r.m);
  });
  cl.expectClean();
}

void selfSendOutsideGroupHangs() {
  Cluster cl(1, "self", quick(300));
  cl.run([&](Rank& r) {
    auto c = makeComm(r, *cl.store, "id", 1, 0);
    const Stream s = r.dev().newStream(0, false);
    at::Tensor a = at::ones({4}), b = at::zeros({4});
    OK(r.nccl().send(a.data_ptr(), 4, NcclType::Float32, 0, c, s));
    OK(r.nccl().recv(b.data_ptr(), 4, NcclType::Float32, 0, c, s));
    EXPECT(awaitViolation(*r.m, "send #0 to rank 0"), joined(td::violations(*r.m)));
    OK(r.nccl().commAbort(c));
    td::synchronize(*r.m);
    td::clearViolations(*r.m);
  });
  cl.expectClean();
}

// The last reference to a machine dropped by an item on its own stream: the machine goes away
// on its worker thread, which must neither join itself nor touch the machine afterwards.
void machineDroppedByItsOwnStream() {
  std::atomic<bool> ran{false};
  {
    auto m = td::newMachine(quick());
    auto dev = td::device(m);
    dev->set(0);
    const Stream s = dev->newStream(0, false);
    Gate g;
    g.hold(*dev, s);
    dev->enqueue(s, [dev, &ran] { ran = true; });
    m.reset();
    dev.reset();  // the queued item now holds the machine alone
    g.open();
  }
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (!ran && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT(ran, "the item ran");
}

void synchronizeReportsHang() {
  auto m = td::newMachine(quick(200));
  auto dev = td::device(m);
  dev->set(0);
  const Stream s = dev->newStream(0, false);
  Gate g;
  g.hold(*dev, s);
  td::synchronize(*m);  // returns after hangMs
  auto v = td::violations(*m);
  EXPECT(v.size() == 1 && contains(v, "hang: synchronize: cuda:0 stream 1 (1 items left) still busy after 200 ms"),
         joined(v));
  g.open();
  td::clearViolations(*m);
  td::synchronize(*m);
  EXPECT(td::violations(*m).empty(), joined(td::violations(*m)));
  // recordStream of memory the allocator never made: ignored, as CUDA's is.
  dev->recordStream(at::zeros({4}), s);
}

struct Test {
  const char* name;
  void (*fn)();
};

}  // namespace

int main(int argc, char** argv) {
  const Test tests[] = {
      {"delays_keep_stream_order", delaysKeepStreamOrder},
      {"events_order_streams", eventsOrderStreams},
      {"calls_without_device", callsWithoutDevice},
      {"machine_dropped_by_its_own_stream", machineDroppedByItsOwnStream},
      {"synchronize_reports_hang", synchronizeReportsHang},
      {"allreduce_every_type_and_op", allReduceEveryTypeAndOp},
      {"premul_host_and_device", premulHostAndDevice},
      {"rooted_and_gather_scatter", rootedAndGatherScatter},
      {"send_recv_in_and_out_of_groups", sendRecvInAndOutOfGroups},
      {"unbatched_ring", unbatchedRing},
      {"group_misuse", groupMisuse},
      {"two_threads_one_comm", twoThreadsOneComm},
      {"creation_short_of_ranks", creationShortOfRanks},
      {"freed_staging_buffer", freedStagingBuffer},
      {"nonblocking_in_progress", nonblockingInProgress},
      {"split_comms", splitComms},
      {"abort_unblocks", abortUnblocks},
      {"mismatches", mismatches},
      {"lifecycle_misuse", lifecycleMisuse},
      {"self_send_outside_group_hangs", selfSendOutsideGroupHangs},
  };
  std::thread(watchdog).detach();
  int failed = 0, ran = 0;
  for (const auto& t : tests) {
    if (argc > 1 && std::string(argv[1]) != t.name) continue;
    {
      std::lock_guard<std::mutex> lk(gWatchMu);
      gTest = t.name;
      gDeadline = Clock::now() + std::chrono::seconds(30);
    }
    const auto t0 = Clock::now();
    ++ran;
    try {
      t.fn();
      std::printf("ok   %-34s %6.0f ms\n", t.name,
                  std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: %s\n", t.name, e.what());
    }
    std::fflush(stdout);
  }
  std::printf("%d of %d tests failed\n", failed, ran);
  return failed == 0 && ran > 0 ? 0 : 1;
}
