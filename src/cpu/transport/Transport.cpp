// Request completion and waiting, shared by every transport.
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

void Request::wait(Deadline deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_until(lk, deadline, [&] { return done_; })) {
    throw CommError(CommErrorKind::Timeout, "Timed out", peer_);
  }
  if (failed_) throw CommError(kind_, error_, errorPeer_);
}

bool Request::done() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

int Request::source() const {
  std::lock_guard<std::mutex> lk(mu_);
  return source_;
}

template <class Record>
bool Request::finish(Record&& record) {
  std::function<void()> cb;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_) return false;
    done_ = true;
    record();
    cb = std::move(callback_);
  }
  cv_.notify_all();
  if (cb) cb();
  return true;
}

bool Request::complete(int source) {
  return finish([&] { source_ = source; });
}

bool Request::fail(CommErrorKind kind, const std::string& msg, int peer) {
  return finish([&] {
    failed_ = true;
    kind_ = kind;
    error_ = msg;
    errorPeer_ = peer;
  });
}

void Request::onDone(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done_) {
      callback_ = std::move(fn);
      return;
    }
  }
  fn();
}

void Request::rethrow() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_) throw CommError(kind_, error_, errorPeer_);
}

void Transport::addPeerFailedCallback(std::function<void(int peer, const std::string& why)> cb) {
  std::lock_guard<std::mutex> lk(peerFailedMu_);
  peerFailed_.push_back(std::move(cb));
}

void Transport::notifyPeerFailed(int peer, const std::string& why) {
  std::vector<std::function<void(int, const std::string&)>> cbs;
  {
    std::lock_guard<std::mutex> lk(peerFailedMu_);
    cbs = peerFailed_;
  }
  for (auto& cb : cbs) cb(peer, why);
}

void waitAll(std::vector<RequestPtr>& reqs, Deadline deadline) {
  for (auto& r : reqs) r->wait(deadline);
}

}  // namespace myccl::cpu
