// Running a launch on its stream: the double's data movement. Each op reads its send buffer and
// writes its receive buffer when the item runs (so stream-ordering bugs show), ranks meet in the
// store under keys numbered like NCCL's implicit matching (collectives in launch order, p2p per
// peer pair in launch order), and every wait can be aborted and reports a hang.
#include <cstring>
#include <sstream>

#include "Allocator.hpp"
#include "Nccl.hpp"

namespace myccl::cuda::testdouble {

namespace {

// A group whose ops use several streams: NCCL runs it on the first and makes the others wait
// for it, so the group stays one launch.
struct Join {
  std::mutex mu;
  std::condition_variable cv;
  size_t arrived = 0;
  bool done = false;
};

std::string rankSet(const std::vector<int>& ranks) {
  std::string s = "{";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "}";
}

std::vector<uint8_t> asBytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// Runs one launch's ops: post everything (sends, receive buffers, contributions), then progress
// whichever op can, so that a group's sends and receives never wait on each other.
class Runner {
 public:
  Runner(Machine& m, Launch& l) : m_(m), l_(l), c_(*l.comm), store_(*c_.store) {}

  void run() {
    {
      std::lock_guard<std::mutex> lk(c_.mu);
      nranks_ = c_.nranks;
      rank_ = c_.rank;
    }
    for (auto& op : l_.ops) checkBuffers(op);
    tasks_.reserve(l_.ops.size());
    for (auto& op : l_.ops) tasks_.push_back(Task{&op, keyOf(op), whatOf(op)});
    size_t left = 0;
    for (auto& t : tasks_) {
      t.done = post(t);
      if (!t.done) ++left;
    }
    auto last = Clock::now();
    Clock::duration pause = std::chrono::microseconds(20);
    while (left > 0) {
      if (c_.stopped() || failed()) {
        m_.count("ops_abandoned", static_cast<int64_t>(left));
        return;  // outputs stay untouched
      }
      bool moved = false;
      for (auto& t : tasks_) {
        if (!t.done && progress(t)) {
          t.done = true;
          moved = true;
          --left;
        }
      }
      if (left == 0) break;
      if (moved) {
        last = Clock::now();
        pause = std::chrono::microseconds(20);
        continue;
      }
      if (Clock::now() - last > m_.hang()) reportHangs();
      std::this_thread::sleep_for(pause);
      pause = std::min<Clock::duration>(pause * 2, std::chrono::milliseconds(5));
    }
  }

 private:
  struct Task {
    Op* op;
    std::string base;  // the op's keys in the store
    std::string what;  // "all_reduce #3", "send #0 to rank 2"
    bool done = false;
    bool hangReported = false;
  };

  bool collective(const Op& op) const { return op.kind != OpKind::Send && op.kind != OpKind::Recv; }
  size_t bytes(const Op& op) const { return op.count * typeBytes(op.type); }

  std::string keyOf(const Op& op) const {
    const std::string seq = std::to_string(op.seq);
    if (collective(op)) return c_.key + "/c" + seq;
    const int src = op.kind == OpKind::Send ? rank_ : op.peer;
    const int dst = op.kind == OpKind::Send ? op.peer : rank_;
    return c_.key + "/p" + std::to_string(src) + "." + std::to_string(dst) + "/" + seq;
  }

  std::string whatOf(const Op& op) const {
    std::string s = std::string(kindName(op.kind)) + " #" + std::to_string(op.seq);
    if (op.kind == OpKind::Send) s += " to rank " + std::to_string(op.peer);
    if (op.kind == OpKind::Recv) s += " from rank " + std::to_string(op.peer);
    return s;
  }

  bool failed() {
    std::lock_guard<std::mutex> lk(c_.mu);
    return c_.error != NcclResult::Success;
  }

  void checkBuffers(const Op& op) {
    auto& a = m_.allocator();
    const std::string use = whatOf(op) + " (" + describe(op) + ") on " + c_.name;
    const size_t b = bytes(op), n = static_cast<size_t>(nranks_);
    const bool root = op.peer == rank_;
    switch (op.kind) {
      case OpKind::AllReduce: a.check(op.send, b, use, l_.stream); a.check(op.recv, b, use, l_.stream); break;
      case OpKind::Broadcast:
        if (root) a.check(op.send, b, use, l_.stream);
        a.check(op.recv, b, use, l_.stream);
        break;
      case OpKind::Reduce:
        a.check(op.send, b, use, l_.stream);
        if (root) a.check(op.recv, b, use, l_.stream);
        break;
      case OpKind::AllGather: a.check(op.send, b, use, l_.stream); a.check(op.recv, b * n, use, l_.stream); break;
      case OpKind::ReduceScatter: a.check(op.send, b * n, use, l_.stream); a.check(op.recv, b, use, l_.stream); break;
      case OpKind::Send: a.check(op.send, b, use, l_.stream); break;
      case OpKind::Recv: a.check(op.recv, b, use, l_.stream); break;
    }
    if (op.premul && op.premul->residence == ScalarResidence::Device) {
      a.check(op.premul->ptr, typeBytes(op.type), use + " (its premul factor)", l_.stream);
    }
  }

  // ---- posting ----

  // True when the op is complete already.
  bool post(Task& t) {
    const Op& op = *t.op;
    if (op.kind == OpKind::Send) {
      m_.count("sends");
      // Up to eagerBytes a send completes into the peer's buffers; beyond, it waits for the
      // receive (rendezvous). A send to oneself always waits: it completes only in a group that
      // also holds the receive.
      if (op.peer != rank_ && static_cast<int64_t>(bytes(op)) <= m_.opts.eagerBytes) {
        publishSend(t);
        return true;
      }
      return false;
    }
    if (op.kind == OpKind::Recv) {
      m_.count("recvs");
      store_.set(t.base + "/r", asBytes(std::to_string(bytes(op))));
      return false;
    }
    m_.count("collectives");
    const std::string desc = describe(op) + "\n";
    const size_t b = bytes(op);
    size_t payload = 0;
    switch (op.kind) {
      case OpKind::AllReduce:
      case OpKind::Reduce:
      case OpKind::AllGather: payload = b; break;
      case OpKind::ReduceScatter: payload = b * static_cast<size_t>(nranks_); break;
      case OpKind::Broadcast: payload = op.peer == rank_ ? b : 0; break;
      default: break;
    }
    std::vector<uint8_t> v(desc.size() + payload);
    std::memcpy(v.data(), desc.data(), desc.size());
    if (payload != 0) std::memcpy(v.data() + desc.size(), op.send, payload);
    if (op.premul) applyPremul(v.data() + desc.size(), payload / typeBytes(op.type), *op.premul);
    store_.set(t.base + "/" + std::to_string(rank_), v);
    return false;
  }

  void publishSend(const Task& t) {
    const Op& op = *t.op;
    const uint64_t b = bytes(op);
    std::vector<uint8_t> v(sizeof b + b);
    std::memcpy(v.data(), &b, sizeof b);
    if (b != 0) std::memcpy(v.data() + sizeof b, op.send, b);
    store_.set(t.base + "/d", v);
  }

  void sizeMismatch(const Op& op, uint64_t sent, uint64_t received) {
    const int src = op.kind == OpKind::Send ? rank_ : op.peer;
    const int dst = op.kind == OpKind::Send ? op.peer : rank_;
    std::ostringstream os;
    os << "send/recv size mismatch on " << c_.name << ": rank " << src << " sends " << sent << " bytes to rank " << dst
       << " (send #" << op.seq << "), rank " << dst << " receives " << received << " bytes";
    m_.violation(os.str());
    c_.fail(NcclResult::InvalidUsage, os.str());
  }

  // ---- progress ----

  bool progress(Task& t) {
    const Op& op = *t.op;
    if (op.kind == OpKind::Send) {
      if (!store_.check({t.base + "/r"})) return false;
      const auto v = store_.get(t.base + "/r");
      const uint64_t theirs = std::stoull(std::string(v.begin(), v.end()));
      if (theirs != bytes(op)) sizeMismatch(op, bytes(op), theirs);
      publishSend(t);  // even on a mismatch: the receiver then sees it too, instead of hanging
      return true;
    }
    if (op.kind == OpKind::Recv) {
      if (!store_.check({t.base + "/d"})) return false;
      const auto v = store_.get(t.base + "/d");
      uint64_t theirs = 0;
      if (v.size() >= sizeof theirs) std::memcpy(&theirs, v.data(), sizeof theirs);
      if (theirs != bytes(op) || v.size() != sizeof theirs + theirs) {
        sizeMismatch(op, theirs, bytes(op));
      } else if (theirs != 0) {
        std::memcpy(op.recv, v.data() + sizeof theirs, theirs);
      }
      store_.deleteKey(t.base + "/d");
      store_.deleteKey(t.base + "/r");
      return true;
    }
    std::vector<std::string> keys;
    for (int r = 0; r < nranks_; ++r) keys.push_back(t.base + "/" + std::to_string(r));
    if (!store_.check(keys)) return false;
    std::vector<std::vector<uint8_t>> vals;
    std::vector<std::string> descs;
    std::vector<const unsigned char*> payloads;
    std::vector<size_t> sizes;
    for (const auto& k : keys) vals.push_back(store_.get(k));
    for (const auto& v : vals) {
      size_t nl = 0;
      while (nl < v.size() && v[nl] != '\n') ++nl;
      descs.emplace_back(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(nl));
      payloads.push_back(v.data() + std::min(nl + 1, v.size()));
      sizes.push_back(v.size() - std::min(nl + 1, v.size()));
    }
    bool same = true;
    for (const auto& d : descs) same = same && d == descs[0];
    if (same) {
      deliver(op, payloads, sizes);
    } else {
      std::ostringstream os;
      os << "mismatched collectives on " << c_.name << " #" << op.seq << ":";
      for (int r = 0; r < nranks_; ++r) os << (r ? ", " : " ") << "rank " << r << " " << descs[static_cast<size_t>(r)];
      m_.violation(os.str());
      c_.fail(NcclResult::InvalidUsage, os.str());
    }
    // The last rank to read the contributions removes them.
    if (store_.add(t.base + "/n", 1) == nranks_) {
      for (const auto& k : keys) store_.deleteKey(k);
      store_.deleteKey(t.base + "/n");
    }
    return true;
  }

  // Writes the op's output from every rank's contribution (descriptors already agree).
  void deliver(const Op& op, const std::vector<const unsigned char*>& parts, const std::vector<size_t>& sizes) {
    const size_t b = bytes(op), n = static_cast<size_t>(nranks_);
    auto expect = [&](size_t r, size_t size) {
      TORCH_CHECK(sizes[r] == size, "myccl: cuda double: ", c_.name, " ", kindName(op.kind), " #", op.seq, ": rank ",
                  r, " contributed ", sizes[r], " bytes, expected ", size);
    };
    const NcclRedOp red = op.premul ? kNcclSum : op.op;
    switch (op.kind) {
      case OpKind::AllReduce:
      case OpKind::Reduce:
        if (op.kind == OpKind::Reduce && op.peer != rank_) return;
        for (size_t r = 0; r < n; ++r) expect(r, b);
        reduceParts(parts, op.count, op.type, red, op.recv);
        return;
      case OpKind::ReduceScatter: {
        std::vector<const unsigned char*> mine;
        for (size_t r = 0; r < n; ++r) {
          expect(r, b * n);
          mine.push_back(parts[r] + static_cast<size_t>(rank_) * b);
        }
        reduceParts(mine, op.count, op.type, red, op.recv);
        return;
      }
      case OpKind::AllGather:
        for (size_t r = 0; r < n; ++r) expect(r, b);
        // memmove: in place, this rank's block is its own send buffer.
        for (size_t r = 0; r < n; ++r) std::memmove(static_cast<unsigned char*>(op.recv) + r * b, parts[r], b);
        return;
      case OpKind::Broadcast: {
        const auto root = static_cast<size_t>(op.peer);
        expect(root, b);
        std::memmove(op.recv, parts[root], b);
        return;
      }
      default: return;
    }
  }

  void reportHangs() {
    for (auto& t : tasks_) {
      if (t.done || t.hangReported) continue;
      t.hangReported = true;
      std::vector<int> waiting;
      if (collective(*t.op)) {
        for (int r = 0; r < nranks_; ++r) {
          if (!store_.check({t.base + "/" + std::to_string(r)})) waiting.push_back(r);
        }
      } else {
        waiting.push_back(t.op->peer);
      }
      std::ostringstream os;
      os << "hang: " << c_.name << " " << t.what << " (" << describe(*t.op) << ") rank " << rank_
         << " waits for ranks " << rankSet(waiting) << " for more than " << m_.opts.hangMs << " ms";
      m_.violation(os.str());
      m_.count("hangs");
    }
  }

  Machine& m_;
  Launch& l_;
  Comm& c_;
  c10d::Store& store_;
  int nranks_ = 0;
  int rank_ = 0;
  std::vector<Task> tasks_;
};

void runLaunch(Machine& m, Launch& l) {
  Comm& c = *l.comm;
  bool skip = false;
  const int dev = l.stream.device_index();
  if (l.ticket) m.awaitDeviceTurn(dev, l.ticket, [&c] { return c.stopped(); }, c.name);
  {
    // A communicator's launches run in launch order even on different streams: NCCL
    // serializes a communicator's kernels.
    std::unique_lock<std::mutex> lk(c.mu);
    while (c.orderDone < l.order && !c.stopped()) c.cv.wait_for(lk, std::chrono::milliseconds(20));
    ++c.active;
    skip = c.stopped() || c.error != NcclResult::Success;
  }
  if (!skip) {
    try {
      Runner(m, l).run();
    } catch (const c10::DistError& e) {
      // The store is NCCL's network here: its failure is a peer's or the network's.
      c.fail(NcclResult::RemoteError, std::string("the store failed: ") + e.what_without_backtrace());
    } catch (const c10::Error& e) {
      c.fail(NcclResult::InternalError, std::string("the launch failed: ") + e.what_without_backtrace());
    } catch (const std::exception& e) {
      c.fail(NcclResult::InternalError, std::string("the launch failed: ") + e.what());
    }
  } else {
    m.count("launches_skipped");
  }
  {
    std::lock_guard<std::mutex> lk(c.mu);
    --c.active;
    c.orderDone = std::max(c.orderDone, l.order + 1);
    ++c.finished;
  }
  c.cv.notify_all();
  if (l.ticket) m.endDeviceTurn(dev, l.ticket);
}

}  // namespace

void enqueueLaunch(Machine& m, const std::shared_ptr<Launch>& launch) {
  Machine* mp = &m;
  launch->ticket = m.takeDeviceTicket(launch->stream.device_index());
  std::shared_ptr<Join> join;
  if (!launch->joined.empty()) join = std::make_shared<Join>();
  for (const auto& s : launch->joined) {
    auto w = m.worker(s);
    if (!w) continue;
    w->enqueue([join, comm = launch->comm] {
      std::unique_lock<std::mutex> lk(join->mu);
      ++join->arrived;
      join->cv.notify_all();
      while (!join->done && !comm->stopped()) join->cv.wait_for(lk, std::chrono::milliseconds(20));
    });
  }
  m.worker(launch->stream)->enqueue([mp, launch, join] {
    if (join) {
      std::unique_lock<std::mutex> lk(join->mu);
      while (join->arrived < launch->joined.size() && !launch->comm->stopped()) {
        join->cv.wait_for(lk, std::chrono::milliseconds(20));
      }
    }
    runLaunch(*mp, *launch);
    if (join) {
      std::lock_guard<std::mutex> lk(join->mu);
      join->done = true;
      join->cv.notify_all();
    }
  });
}

}  // namespace myccl::cuda::testdouble
