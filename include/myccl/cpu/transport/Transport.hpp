// The interface every CPU transport implements: tagged, asynchronous byte messages between
// the ranks of one group. Algorithms (src/cpu/algorithms) are written against it and never
// see a socket or a shared-memory name; a transport never sees a dtype or a ReduceOp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "myccl/Errors.hpp"

namespace myccl::cpu {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// One posted send or receive. Completed by the transport's own progress thread.
class Request {
 public:
  Request(int peer, uint64_t tag, size_t nbytes) : peer_(peer), tag_(tag), nbytes_(nbytes) {}

  // Blocks until the request is done; throws CommError on failure or at the deadline.
  void wait(Deadline deadline);
  int source() const;  // the peer that matched (useful for receive-from-any)
  bool done() const;
  int peer() const { return peer_; }
  uint64_t tag() const { return tag_; }
  size_t nbytes() const { return nbytes_; }

  // Transport side. Returns false if the request was already finished.
  bool complete(int source);
  bool fail(CommErrorKind kind, const std::string& msg, int peer);
  // Runs `fn` once the request is done (immediately if it already is), outside any lock of
  // the transport. Used by p2p Work objects.
  void onDone(std::function<void()> fn);
  // Rethrows the failure, if any. Only meaningful once done.
  void rethrow() const;
  // How the bytes travelled when that differs from the transport's name (stats, traces);
  // set by the transport before it completes the request.
  void setVia(const char* via) { via_.store(via, std::memory_order_release); }
  const char* via() const { return via_.load(std::memory_order_acquire); }

 private:
  // Marks the request done, with `record` saying how (under mu_), then wakes waiters and runs the
  // callback. False, recording nothing, if it was done already.
  template <class Record>
  bool finish(Record&& record);

  const int peer_;
  const uint64_t tag_;
  const size_t nbytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  int source_ = -1;
  bool failed_ = false;
  CommErrorKind kind_ = CommErrorKind::Local;
  int errorPeer_ = -1;
  std::string error_;
  std::function<void()> callback_;
  std::atomic<const char*> via_{nullptr};
};

using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const char* name() const = 0;
  // The buffer must stay valid and unchanged until the request completes. `check` (0: none)
  // travels with the message; a receive posted with a different non-zero check fails instead
  // of accepting the bytes (ranks that disagree about an op's dtype or reduce op).
  virtual RequestPtr isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) = 0;
  // A send whose receive the peer has said is posted (by a message of the algorithm's own): the
  // bytes go at once, without the announcement a large message otherwise waits to have answered,
  // a round trip that queues behind whatever already fills a busy link. Were the receive not
  // posted after all, the message would wait for it like any other, held in memory.
  // Transports that announce nothing send as isend does.
  virtual RequestPtr isendPosted(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) {
    return isend(peer, tag, data, nbytes, check);
  }
  // Messages between a pair with one tag arrive in the order they were sent. A message whose
  // size differs from the posted receive fails that receive (never truncates or overflows).
  virtual RequestPtr irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check = 0) = 0;
  virtual RequestPtr irecvAny(const std::vector<int>& peers, uint64_t tag, void* data,
                              size_t nbytes) = 0;
  // Fails everything pending with `reason` and releases sockets, threads and memory. Peers are
  // told why; `failure` says whether this is an error (peers then dump diagnostics) or an
  // orderly shutdown.
  virtual void close(const std::string& reason, bool failure = false) = 0;
  // Called (once per peer, on a transport thread, outside its locks) when a peer fails: it
  // reported an error or vanished without an orderly goodbye. Every group on these links may
  // add one (a group and the groups split from it share them).
  void addPeerFailedCallback(std::function<void(int peer, const std::string& why)> cb);

 protected:
  void notifyPeerFailed(int peer, const std::string& why);

 private:
  std::mutex peerFailedMu_;
  std::vector<std::function<void(int, const std::string&)>> peerFailed_;

 public:
  // Human-readable description of the link to a peer, for error messages and `info`.
  virtual std::string describePeer(int peer) const = 0;
  // Why `peer` is known to be gone ("" while it is alive as far as this transport knows).
  virtual std::string peerGone(int peer) const { return ""; }
  // Withdraws a receive nobody has started to fill, or a send none of whose bytes has been taken;
  // false if data already flows. A withdrawn request never completes.
  virtual bool cancel(const RequestPtr& req) { return false; }
  // Messages that arrived but match no posted receive: (peer, tag). Explains hangs.
  virtual std::vector<std::pair<int, uint64_t>> unmatched() const { return {}; }
  // Connections refused during setup because they did not present the group's secret.
  virtual int rejectedConnections() const { return 0; }
  // Peers whose link ended without a goodbye while this transport was open: their process died
  // (not one that left orderly, said it failed, or was cut off by our own close()).
  virtual std::vector<int> vanishedPeers() const { return {}; }
};

// Waits for every request; the first failure is thrown at once. Requests still pending then
// may point into scratch or user memory: the engine closes the transport (which stops all
// I/O) before any such memory is released, so algorithms only use engine-owned scratch.
void waitAll(std::vector<RequestPtr>& reqs, Deadline deadline);

}  // namespace myccl::cpu
