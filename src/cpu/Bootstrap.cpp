// How a CPU group comes up: key space, topology, secret, shared memory, TCP mesh (see
// Bootstrap.hpp). Transport choices made here: loopback listeners for single-host groups,
// direct copies and mailbox slots between ranks of one host unless TCP is forced everywhere.
#include "myccl/cpu/Bootstrap.hpp"

#include <ATen/ops/from_blob.h>

#include <sys/mman.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <typeinfo>

#include "myccl/Errors.hpp"
#include "myccl/Log.hpp"
#include "myccl/StoreWait.hpp"
#include "myccl/cpu/algorithms/Tags.hpp"
#include "myccl/cpu/transport/Channel.hpp"
#include "myccl/cpu/transport/Net.hpp"
#include "myccl/cpu/transport/Shm.hpp"
#include "myccl/cpu/transport/Tcp.hpp"

namespace myccl::cpu {

namespace {

// Every rank commits up to ShmGroup::kMailboxSlots slots of this size per local peer.
constexpr int64_t kMaxMailboxSlotBytes = 4 << 20;

// The group's secret: every connection must present it before any data is accepted.
std::string groupSecret(c10d::Store& store, const std::string& prefix, int rank, std::chrono::milliseconds timeout,
                        const std::string& where) {
  if (rank == 0) {
    std::string token = randomHex(16);
    store.set(prefix + "secret", std::vector<uint8_t>(token.begin(), token.end()));
    return token;
  }
  waitForRanks(store, {prefix + "secret"}, {0}, timeout, "the group's secret", where);
  auto v = store.get(prefix + "secret");
  return std::string(v.begin(), v.end());
}

// The local ranks' trades of a new shared-memory group (ShmExchange) through the store.
ShmExchange storeExchange(c10d::Store& store, const std::string& prefix, const Topology& topo,
                          std::chrono::milliseconds timeout) {
  return [&store, prefix, topo, timeout](int step, const std::string& mine) {
    const std::string key = prefix + (step == 0 ? "shm/name/" : "shm/mapped/");
    store.set(key + std::to_string(topo.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> keys, out;
    for (int r : topo.localRanks) keys.push_back(key + std::to_string(r));
    waitForRanks(store, keys, topo.localRanks, timeout, "their shared-memory setup",
                 "init (rank " + std::to_string(topo.rank) + ")");
    for (auto& v : store.multiGet(keys)) out.emplace_back(v.begin(), v.end());
    return out;
  };
}

// The same over links the group already has (a split's, on its parent's connections): no store.
ShmExchange linkExchange(Transport& links, const Topology& topo, std::chrono::milliseconds timeout,
                         const std::string& where) {
  return [&links, topo, timeout, where](int step, const std::string& mine) {
    constexpr size_t kBytes = 512;  // a segment name, or why this rank has no shared memory
    const int n = topo.localSize;
    std::vector<std::array<char, kBytes>> got(n);
    std::array<char, kBytes> out{};
    std::memcpy(out.data(), mine.data(), std::min(mine.size(), kBytes - 1));
    const uint64_t tag = collectiveTagBase(OpCode::Setup, 0) | static_cast<uint64_t>(step);
    std::vector<RequestPtr> reqs;
    for (int i = 0; i < n; ++i) {
      if (i == topo.localRank) continue;
      reqs.push_back(links.irecv(topo.localRanks[i], tag, got[i].data(), kBytes));
      reqs.push_back(links.isend(topo.localRanks[i], tag, out.data(), kBytes));
    }
    try {
      waitAll(reqs, Clock::now() + timeout);
    } catch (const CommError& e) {
      for (auto& r : reqs) links.cancel(r);
      throwDistError("myccl: " + where + ": setting up shared memory with this host's ranks: " + e.what() +
                     (e.peer() >= 0 ? " (rank " + std::to_string(e.peer()) + ")" : std::string()));
    }
    std::vector<std::string> all(n);
    for (int i = 0; i < n; ++i)
      all[i] = i == topo.localRank ? mine : std::string(got[i].data(), strnlen(got[i].data(), kBytes));
    return all;
  };
}

// Shared memory among this host's ranks of the group (all of them, or one level of a
// hierarchical group that spans hosts); null when there is no other local rank, when TCP is
// forced, or (with a warning) when shared memory is unavailable and not required.
std::shared_ptr<ShmGroup> sharedMemory(const ShmExchange& exchange, const Topology& topo,
                                       std::chrono::milliseconds timeout, const Config& cfg) {
  if (topo.localSize <= 1 || cfg.transport == "tcp") return nullptr;
  ShmGroup::Options so;
  so.rank = topo.localRank;
  so.groupRanks = topo.localRanks;
  so.stagingBytes = static_cast<size_t>(cfg.shmBufferBytes);
  so.spinUs = cfg.spinUs;
  so.testRecheckDelayMs = cfg.testShmRecheckDelayMs;
  so.timeout = timeout;
  // Mailbox slots for local messages up to the eager limit.
  so.mailboxSlotBytes = static_cast<size_t>(std::clamp<int64_t>(cfg.localEagerBytes, 0, kMaxMailboxSlotBytes));
  try {
    return std::make_shared<ShmGroup>(exchange, so);
  } catch (const ShmUnavailable& e) {
    MYCCL_CHECK(cfg.transport != "shm", "init (rank ", topo.rank,
                "): MYCCL_TRANSPORT=shm but shared memory is unavailable: ", e.what());
    logOnce("shm-unavailable", LogLevel::Warning,
            std::string("shared memory unavailable (") + e.what() + "); using TCP between local ranks");
    return nullptr;
  }
}

// Who this store is, as far as a process can tell: the chain of prefixes down to the store that
// holds the keys, and that store's address when it has one. Two store objects over the same
// keys (a fresh PrefixStore for every init over one TCPStore) give the same answer.
std::string storeIdentity(c10d::Store& store) {
  struct Peek : c10d::PrefixStore {  // PrefixStore keeps its prefix protected
    static const std::string& prefixOf(c10d::PrefixStore& s) { return s.*(&Peek::prefix_); }
  };
  std::string id;
  c10d::Store* s = &store;
  while (auto* p = dynamic_cast<c10d::PrefixStore*>(s)) {
    id += Peek::prefixOf(*p) + "/";
    s = p->getUnderlyingStore().get();
  }
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s)) return id + "@tcp:" + tcp->getHost() + ":" + std::to_string(tcp->getPort());
  return id + "@" + typeid(*s).name();
}

}  // namespace

std::string incarnationPrefix(c10d::Store& store, const Config& cfg) {
  // Every rank of an incarnation must pick the same key space, and none that an earlier one used,
  // whatever that one left behind. A count kept in the store cannot do it: a rank that died after
  // counting (a torchrun attempt that failed while others were in init) moves it for one rank and
  // not the others. So count locally, per store, the groups this process made on it, which every
  // rank of a group does alike; and a torchrun attempt, whose fresh processes count from 0 again
  // on the store the agent kept, takes the attempt's own space.
  static std::mutex mu;
  static std::map<std::string, int64_t> made;
  int64_t n;
  {
    std::lock_guard<std::mutex> lk(mu);
    n = made[storeIdentity(store)]++;
  }
  return "myccl/a" + std::to_string(cfg.restartCount) + "/" + std::to_string(n) + "/";
}

GroupLinks bootstrapGroup(c10d::Store& store, int rank, int size, std::chrono::milliseconds timeout,
                          const std::string& group, const Config& cfg, const std::string& keyPrefix) {
  GroupLinks links;
  links.keyPrefix = keyPrefix.empty() ? incarnationPrefix(store, cfg) : keyPrefix;
  const std::string& prefix = links.keyPrefix;
  const std::string where = "init (rank " + std::to_string(rank) + ", group '" + group + "')";
  links.topo = Topology::exchange(store, prefix, rank, size, hostIdentity(cfg.hostId), timeout, where);
  const Topology& topo = links.topo;
  const std::string token = groupSecret(store, prefix, rank, timeout, where);

  TcpSetup setup;
  setup.rank = rank;
  setup.size = size;
  setup.timeout = timeout;
  setup.eagerBytes = cfg.tcpEagerBytes;
  setup.localEagerBytes = cfg.localEagerBytes;
  setup.copyThreads = cfg.copyThreads;
  setup.socketsPerPeer = cfg.socketsPerPeer;
  setup.connectDelay = std::chrono::milliseconds(cfg.testConnectDelayMs);
  // Ranks that all live on one host talk over loopback unless told otherwise; nothing else on
  // the network can even reach the listener then.
  setup.bindAddress = (topo.singleHost() && cfg.socketIfname.empty())
                          ? "127.0.0.1"
                          : chooseListenAddress(cfg.socketIfname, cfg.masterAddr);
  // Large messages between ranks of this host are copied straight from the sender's memory,
  // unless TCP was asked for everywhere.
  if (cfg.transport != "tcp") {
    setup.directPeers.resize(size);
    for (int r = 0; r < size; ++r) setup.directPeers[r] = r != rank && topo.sameHost(rank, r);
  }
  links.shm = sharedMemory(storeExchange(store, prefix, topo, timeout), topo, timeout, cfg);
  MYCCL_CHECK_ARG(cfg.transport != "shm" || topo.singleHost(), "init (rank ", rank,
                  "): MYCCL_TRANSPORT=shm but the group spans ", topo.crossSize, " hosts");
  // Made after shared memory, which it may use for local messages: its epoll thread starts
  // with the mailbox in place, so no announcement can arrive before there is one.
  if (links.shm && links.shm->mailboxSlotBytes() > 0) setup.mailbox = std::make_shared<ShmMailbox>(links.shm);
  links.transport = std::make_shared<TcpTransport>(store, prefix + "tcp/", setup, token);
  links.shared = std::make_shared<SharedLinks>(links.transport, group);
  if (logEnabled(LogLevel::Info)) {
    log(LogLevel::Info, "group '" + group + "' rank " + std::to_string(rank) + "/" + std::to_string(size) + ": " +
                            std::to_string(topo.crossSize) + " host(s), collectives over " +
                            (links.shm ? "shared memory" : "TCP") + ", TCP listener on " + setup.bindAddress);
  }
  return links;
}

GroupLinks splitGroupLinks(c10d::Store& store, const SplitSource& parent, const std::vector<int>& members, int rank,
                           std::chrono::milliseconds timeout, const std::string& group, const Config& cfg) {
  GroupLinks links;
  links.keyPrefix = incarnationPrefix(store, cfg);
  links.topo = parent.topo.subset(members, rank);
  // A transfer this group cannot withdraw when it fails is given this long before the shared
  // links close under it (ChannelTransport).
  const auto grace = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(2));
  links.transport = std::make_shared<ChannelTransport>(parent.links, members, rank, parent.channel, group, grace);
  // Its own segments (the step protocol's state is per group), traded over the links.
  const std::string where = "split (rank " + std::to_string(rank) + ", group '" + group + "')";
  links.shm = sharedMemory(linkExchange(*links.transport, links.topo, timeout, where), links.topo, timeout, cfg);
  return links;
}

at::Tensor sharedTensor(c10d::Store& store, const std::string& keyPrefix, const Topology& topo, uint64_t serial,
                        const std::vector<int64_t>& shape, at::ScalarType dtype, int owner,
                        std::chrono::milliseconds timeout, const std::string& where) {
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const size_t nbytes = std::max<size_t>(64, static_cast<size_t>(numel) * c10::elementSize(dtype));
  const std::string key = keyPrefix + "shared/" + std::to_string(serial) + "/host" + std::to_string(topo.crossRank);
  std::shared_ptr<ShmSegment> seg;
  if (topo.localRank == owner) {
    seg = ShmSegment::create(nbytes);
    store.set(key, std::vector<uint8_t>(seg->name().begin(), seg->name().end()));
  } else {
    waitForRanks(store, {key}, {topo.localRanks[owner]}, timeout, "the name of a shared tensor's segment", where);
    auto v = store.get(key);
    seg = ShmSegment::open(std::string(v.begin(), v.end()), nbytes);
  }
  // Every local rank has mapped it before any returns; then the owner removes the name (nothing
  // is left in /dev/shm, whoever exits first).
  store.set(key + "/mapped/" + std::to_string(topo.localRank), std::vector<uint8_t>{1});
  std::vector<std::string> mapped;
  for (int i = 0; i < topo.localSize; ++i) mapped.push_back(key + "/mapped/" + std::to_string(i));
  waitForRanks(store, mapped, topo.localRanks, timeout, "that they mapped a shared tensor", where);
  if (topo.localRank == owner) seg->unlink();
  return at::from_blob(seg->data(), shape, [seg](void*) {}, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

}  // namespace myccl::cpu
