// TCP transport: one socket per peer pair, a single epoll thread that moves bytes, eager
// sends for small messages and a ready-to-send / clear-to-send handshake for large ones, so
// unexpected large messages never pile up in memory and never block other tags. Large messages
// to peers on other hosts are spread over extra data sockets ("lanes"), each with its own
// thread, so several cores drive the kernel's TCP work for one message.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <deque>
#include <map>
#include <thread>
#include <unordered_map>

#include "myccl/Config.hpp"
#include "myccl/cpu/Parallel.hpp"
#include "myccl/cpu/transport/Matcher.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

class ShmMailbox;
namespace tcp {
struct Frame;
}

struct TcpSetup {
  int rank = 0;
  int size = 1;
  std::string bindAddress;      // IP the listener binds to; peers connect to it
  std::vector<std::string> peerAddresses;  // filled during setup (for messages)
  int64_t eagerBytes = 64 * 1024;
  int64_t localEagerBytes = 1024 * 1024;  // the eager limit for directPeers (mailbox or socket)
  int copyThreads = 2;                   // threads per large direct copy
  // Sockets a large message to a peer on another host is spread over (1: the one socket). From
  // 2, every such peer gets that many data sockets besides the control socket, one thread per
  // lane; every rank must use the same value.
  int socketsPerPeer = 2;
  std::chrono::milliseconds timeout{30000};  // for connecting the mesh
  std::chrono::milliseconds connectDelay{0};  // testing only
  // Peers on this host (empty: none): their large messages are copied straight out of the
  // sender's memory (process_vm_readv, one copy) after the usual handshake; the socket only
  // carries the announcement and the acknowledgements.
  std::vector<char> directPeers;
  // Shared-memory slots to this host's peers (null: none). Messages to them of kMailboxMinBytes
  // up to the eager limit travel through a free slot; the socket carries only the announcement.
  std::shared_ptr<ShmMailbox> mailbox;
};

class TcpTransport final : public Transport {
 public:
  // Collective over the group: listens, publishes its address and a secret-checked hello
  // through the store, connects to every peer. `token` is the group's shared secret.
  TcpTransport(c10d::Store& store, const std::string& keyPrefix, TcpSetup setup,
               const std::string& token);
  ~TcpTransport() override;

  const char* name() const override { return "tcp"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) override {
    return send(peer, tag, data, nbytes, check, false);
  }
  RequestPtr isendPosted(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) override {
    return send(peer, tag, data, nbytes, check, true);
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check = 0) override;
  RequestPtr irecvAny(const std::vector<int>& peers, uint64_t tag, void* data,
                      size_t nbytes) override;
  void close(const std::string& reason, bool failure = false) override;
  std::string describePeer(int peer) const override;
  bool cancel(const RequestPtr& req) override;
  std::string peerGone(int peer) const override;
  std::vector<std::pair<int, uint64_t>> unmatched() const override;
  std::vector<int> vanishedPeers() const override;

  int rejectedConnections() const override { return rejected_.load(); }

 private:
  using Frame = tcp::Frame;
  struct SendItem;
  struct PostedRecv;
  struct Unexpected;
  struct Peer;
  struct Stripes;
  struct Part;
  struct Lane;

  // isend and isendPosted (`posted`: the receive is known to be posted; see Transport), Tcp.cpp.
  RequestPtr send(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check, bool posted);
  // Setup (TcpMesh.cpp).
  void connectMesh(c10d::Store& store, const std::string& keyPrefix, const std::string& token);
  // Posting a receive, and a receive meeting its message whichever came first (Tcp.cpp).
  RequestPtr postRecv(const std::shared_ptr<PostedRecv>& pr);
  void matchPostedLocked(const std::shared_ptr<PostedRecv>& pr, std::vector<std::function<void()>>& done);
  bool meetLocked(int peer, const std::shared_ptr<PostedRecv>& pr, const Frame& f,
                  std::vector<std::function<void()>>& done);
  void grantLocked(int peer, const std::shared_ptr<PostedRecv>& pr, uint64_t sendId, const Frame& rts,
                   std::vector<std::function<void()>>& done);
  // The epoll thread: frames in and out on the control sockets (TcpLoop.cpp).
  void ioLoop();
  void handleReadable(int peer, std::vector<std::function<void()>>& done);
  void handleWritable(int peer, std::vector<std::function<void()>>& done);
  void onHeader(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onMessage(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onClearToSend(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onDirectDone(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onDirectAck(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onData(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void onGoodbye(int peer, const Frame& f, std::vector<std::function<void()>>& done);
  void finishRead(int peer, std::vector<std::function<void()>>& done);
  void pushSend(int peer, std::unique_ptr<SendItem> item, std::vector<std::function<void()>>& done);
  void flushLocked(int peer, std::vector<std::function<void()>>& done);
  void updateInterestLocked(int peer);
  void wake();
  // A peer that is gone (TcpShutdown.cpp, with close()).
  void peerFailedLocked(int peer, const std::string& why, std::vector<std::function<void()>>& done);
  void markVanishedLocked(int peer);
  // Same-host fast paths (TcpSameHost.cpp).
  void directCopy(int peer, uint64_t recvId, std::shared_ptr<PostedRecv> pr, uint64_t sendId, uint64_t addr,
                  uint64_t pid);
  void takeFromMailboxLocked(int peer, int slot, std::shared_ptr<PostedRecv> pr,
                             std::vector<std::function<void()>>& done);
  // Lanes: extra data sockets to peers on other hosts, none when socketsPerPeer < 2 (TcpLanes.cpp).
  bool hasLanes(int peer) const;
  bool striped(int peer, size_t nbytes) const;
  void laneLoop(Lane& lane);
  void takeIntake(Lane& lane);
  void laneFlush(Lane& lane, int peer, std::vector<std::function<void()>>& done, std::string& broken);
  void laneRead(Lane& lane, int peer, std::vector<std::function<void()>>& done, std::string& broken);
  void laneBroken(int peer, const std::string& why);
  std::shared_ptr<Stripes> newStripes(const RequestPtr& req, char* data, size_t nbytes);
  void wakeLane(Lane& lane);
  void stripeSendLocked(int peer, uint64_t recvId, const RequestPtr& req, const char* data, size_t nbytes);
  void stripeRecvLocked(int peer, uint64_t recvId, const std::shared_ptr<PostedRecv>& pr);
  void dropLanesLocked(int peer, const std::string& why, bool keepIncoming, std::vector<std::function<void()>>& done);

  TcpSetup setup_;
  std::vector<std::unique_ptr<Peer>> peers_;
  int laneCount_ = 0;  // data lanes per peer on another host (0: none)
  std::vector<std::unique_ptr<Lane>> lanes_;
  // Guards every peer's send and receive state and match_; taken before a lane's mu, never
  // after it (see Lane).
  mutable std::mutex mu_;
  Matcher<PostedRecv, Unexpected> match_;  // receives and messages not yet matched (under mu_)
  uint64_t nextId_ = 1;  // ids of announced sends and of granted receives
  int epfd_ = -1;
  int wakeFd_ = -1;
  std::thread io_;
  std::atomic<bool> stopping_{false};
  bool closed_ = false;
  std::string closeReason_;
  std::atomic<int> rejected_{0};
  // Direct copies running outside mu_; close() waits for them before it returns (callers free
  // buffers after close).
  int copiesInFlight_ = 0;
  // Helpers for large direct copies, made at the first one; one copy uses them at a time.
  std::mutex copyPoolMu_;
  std::unique_ptr<Parallel> copyPool_;
  std::condition_variable copiesIdle_;
  uint64_t pidNs_ = 0;  // our pid namespace: a pid in an announcement means something only within one
};

}  // namespace myccl::cpu
