// The TCP transport's fast paths between ranks of one host: a large message copied straight out
// of the sender's memory (process_vm_readv: one copy instead of two through the kernel's socket
// buffers; where the kernel refuses, the socket after all), and a mid-size one taken from the
// shared-memory slot its sender filled.
#include "myccl/cpu/transport/TcpState.hpp"
#include "myccl/cpu/transport/Shm.hpp"

#include <sys/uio.h>

#include "myccl/Log.hpp"

namespace myccl::cpu {

using namespace tcp;

// Direct copies from this size on are split across MYCCL_COPY_THREADS threads.
constexpr size_t kSplitCopyBytes = 1u << 20;

// Runs outside mu_ (on the thread that matched the receive).
void TcpTransport::directCopy(int peer, uint64_t recvId, std::shared_ptr<PostedRecv> pr, uint64_t sendId,
                              uint64_t addr, uint64_t pid) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || peers_[peer]->dead || !peers_[peer]->directRecvs.count(recvId)) return;
    ++copiesInFlight_;
  }
  // Copies [b, e); returns 0 or the errno that stopped it.
  auto readRange = [&](size_t b, size_t e) -> int {
    while (b < e) {
      iovec local{pr->data + b, e - b};
      iovec remote{reinterpret_cast<void*>(addr + b), e - b};
      ssize_t r = ::process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return r < 0 ? errno : EFAULT;
      b += static_cast<size_t>(r);
    }
    return 0;
  };
  int err = 0;
  // One thread copies well below memcpy's rate (process_vm_readv pins and maps the sender's
  // pages as it goes); two reach it (docs/PERFORMANCE.md has the figures). The sender is blocked until
  // the copy is done, so the second thread runs on the core it leaves idle.
  std::unique_lock<std::mutex> pool(copyPoolMu_, std::defer_lock);
  if (setup_.copyThreads > 1 && pr->nbytes >= kSplitCopyBytes && pool.try_lock() && !copyPool_) {
    try {
      copyPool_ = std::make_unique<Parallel>(setup_.copyThreads);
    } catch (const std::exception& e) {  // no threads to be had: copy alone, as with 1
      logOnce("tcp-copy-threads", LogLevel::Warning, std::string("copy helpers unavailable: ") + e.what());
      pool.unlock();
    }
  }
  if (pool.owns_lock() && copyPool_) {
    std::atomic<int> first{0};
    copyPool_->run(pr->nbytes, kSplitCopyBytes / 2, [&](size_t b, size_t e) {
      int z = 0, e2 = readRange(b, e);
      if (e2) first.compare_exchange_strong(z, e2);
    });
    err = first.load();
    pool.unlock();
    if (err == 0) pr->req->setVia("direct-parallel");
  } else {
    err = readRange(0, pr->nbytes);
  }
  std::vector<std::function<void()>> done;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (--copiesInFlight_ == 0) copiesIdle_.notify_all();
    auto& p = *peers_[peer];
    auto it = p.directRecvs.find(recvId);
    if (it != p.directRecvs.end() && !closed_ && !p.dead) {
      if (err == 0) {
        pushSend(peer, SendItem::control(kDirectDone, sendId, recvId), done);
      } else if (err == EPERM || err == EACCES || err == ENOSYS || err == ESRCH) {
        // Not allowed (Yama ptrace policy, seccomp) or not the process we think (another pid
        // namespace): use the socket for this peer from now on.
        p.direct = false;
        p.directRecvs.erase(it);
        std::string why = "direct copies between local ranks unavailable (" + errnoStr(err) +
                          "); large messages go through TCP";
        done.push_back([why] { logOnce("tcp-direct-off", LogLevel::Info, why); });
        grantLocked(peer, pr, sendId, Frame{}, done);  // clear-to-send over the socket
      } else {
        peerFailedLocked(peer,
                         "reading a message directly from rank " + std::to_string(peer) + " (pid " +
                             std::to_string(pid) + ") failed: " + errnoStr(err),
                         done);
      }
    }
  }
  for (auto& f : done) f();
}

// Called with mu_ held when a message waiting in `peer`'s mailbox slot meets its receive: the
// copy runs after the lock is released (on the thread that matched it), counted as a copy in
// flight so that close() does not return while it writes into the caller's buffer.
void TcpTransport::takeFromMailboxLocked(int peer, int slot, std::shared_ptr<PostedRecv> pr,
                                         std::vector<std::function<void()>>& done) {
  done.push_back([this, peer, slot, pr] {
    std::string aborted;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_) {
        aborted = closeReason_;
      } else {
        ++copiesInFlight_;
      }
    }
    if (!aborted.empty()) {
      pr->req->fail(CommErrorKind::Aborted, aborted, peer);
      return;
    }
    setup_.mailbox->take(peer, slot, pr->data, pr->nbytes);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--copiesInFlight_ == 0) copiesIdle_.notify_all();
    }
    // Completed after the count drops: a completion callback may close the transport.
    pr->req->setVia("mailbox");
    pr->req->complete(peer);
  });
}

}  // namespace myccl::cpu
