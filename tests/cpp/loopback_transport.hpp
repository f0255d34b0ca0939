// An in-process Transport for the algorithm unit tests: the ranks of a group are threads of one
// process, and a message is a memcpy from the sender's buffer into the receiver's. It keeps the
// contract algorithms rely on (Transport.hpp): per pair and tag, messages match receives in the
// order they were sent; a size or check word that differs fails the receive; a request completes
// once. `Mode::Rendezvous` completes a send only when its receive takes the bytes, so an algorithm
// that reuses a buffer before its send completed, or that needs a send to finish before the peer
// has posted the receive, fails here instead of passing on a buffering transport.
#pragma once

#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu::testing {

class LoopbackHub {
 public:
  enum class Mode { Eager, Rendezvous };
  LoopbackHub(int size, Mode mode) : mode_(mode), boxes_(size) {}
  int size() const { return static_cast<int>(boxes_.size()); }
  Mode mode() const { return mode_; }

  struct Arrival {
    int src;
    uint64_t tag;
    uint32_t check;
    const void* data;             // the sender's buffer (rendezvous)
    std::vector<char> copy;       // or a copy of it (eager)
    size_t nbytes;
    RequestPtr send;              // completed when taken (rendezvous)
  };
  struct Posting {
    int src;  // -1: any of `any`
    std::vector<int> any;
    uint64_t tag;
    uint32_t check;
    void* data;
    size_t nbytes;
    RequestPtr recv;
  };
  struct Box {
    std::deque<Arrival> arrivals;
    std::deque<Posting> postings;
  };

  std::mutex mu;
  Mode mode_;
  std::vector<Box> boxes_;
  size_t messages = 0;  // sends made, for tests that count an algorithm's messages
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  const char* name() const override { return "loopback"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check) override {
    auto req = std::make_shared<Request>(peer, tag, nbytes);
    if (peer < 0 || peer >= hub_->size() || peer == rank_) {
      req->fail(CommErrorKind::Local, "loopback: send to bad peer " + std::to_string(peer), peer);
      return req;
    }
    std::vector<std::function<void()>> done;
    {
      std::lock_guard<std::mutex> lk(hub_->mu);
      ++hub_->messages;
      auto& box = hub_->boxes_[peer];
      for (auto it = box.postings.begin(); it != box.postings.end(); ++it) {
        if (!matches(*it, rank_, tag)) continue;
        LoopbackHub::Posting p = std::move(*it);
        box.postings.erase(it);
        deliver(p, rank_, check, data, nbytes, done);
        done.push_back([req, peer] { req->complete(peer); });
        break;
      }
      if (done.empty()) {
        LoopbackHub::Arrival a{rank_, tag, check, data, {}, nbytes, nullptr};
        if (hub_->mode() == LoopbackHub::Mode::Eager) {
          a.copy.assign(static_cast<const char*>(data), static_cast<const char*>(data) + nbytes);
          a.data = nullptr;
          done.push_back([req, peer] { req->complete(peer); });
        } else {
          a.send = req;
        }
        box.arrivals.push_back(std::move(a));
      }
    }
    for (auto& f : done) f();
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check) override {
    return post(LoopbackHub::Posting{peer, {}, tag, check, data, nbytes, std::make_shared<Request>(peer, tag, nbytes)});
  }

  RequestPtr irecvAny(const std::vector<int>& peers, uint64_t tag, void* data, size_t nbytes) override {
    return post(LoopbackHub::Posting{-1, peers, tag, 0, data, nbytes, std::make_shared<Request>(-1, tag, nbytes)});
  }

  void close(const std::string& reason, bool /*failure*/) override {
    std::vector<RequestPtr> pending;
    {
      std::lock_guard<std::mutex> lk(hub_->mu);
      auto& box = hub_->boxes_[rank_];
      for (auto& p : box.postings) pending.push_back(p.recv);
      box.postings.clear();
    }
    for (auto& r : pending) r->fail(CommErrorKind::Local, "loopback closed: " + reason, -1);
  }

  std::string describePeer(int peer) const override { return "loopback rank " + std::to_string(peer); }

  std::vector<std::pair<int, uint64_t>> unmatched() const override {
    std::lock_guard<std::mutex> lk(hub_->mu);
    std::vector<std::pair<int, uint64_t>> out;
    for (auto& a : hub_->boxes_[rank_].arrivals) out.emplace_back(a.src, a.tag);
    return out;
  }

 private:
  static bool matches(const LoopbackHub::Posting& p, int src, uint64_t tag) {
    if (p.tag != tag) return false;
    if (p.src >= 0) return p.src == src;
    for (int q : p.any)
      if (q == src) return true;
    return false;
  }

  // Under the hub's lock: copies the bytes and queues the receive's completion (or failure).
  static void deliver(const LoopbackHub::Posting& p, int src, uint32_t check, const void* data, size_t nbytes,
                      std::vector<std::function<void()>>& done) {
    auto recv = p.recv;
    if (nbytes != p.nbytes) {
      const std::string why = "loopback: rank " + std::to_string(src) + " sent " + std::to_string(nbytes) +
                              " bytes, the receive expects " + std::to_string(p.nbytes);
      done.push_back([recv, why, src] { recv->fail(CommErrorKind::Protocol, why, src); });
      return;
    }
    if (check != 0 && p.check != 0 && check != p.check) {
      done.push_back([recv, src] { recv->fail(CommErrorKind::Protocol, "loopback: check words differ", src); });
      return;
    }
    if (nbytes) std::memcpy(p.data, data, nbytes);
    done.push_back([recv, src] { recv->complete(src); });
  }

  RequestPtr post(LoopbackHub::Posting p) {
    auto req = p.recv;
    std::vector<std::function<void()>> done;
    {
      std::lock_guard<std::mutex> lk(hub_->mu);
      auto& box = hub_->boxes_[rank_];
      for (auto it = box.arrivals.begin(); it != box.arrivals.end(); ++it) {
        if (!matches(p, it->src, it->tag)) continue;
        LoopbackHub::Arrival a = std::move(*it);
        box.arrivals.erase(it);
        deliver(p, a.src, a.check, a.data ? a.data : a.copy.data(), a.nbytes, done);
        if (a.send) done.push_back([s = a.send, r = rank_] { s->complete(r); });
        break;
      }
      if (done.empty()) box.postings.push_back(std::move(p));
    }
    for (auto& f : done) f();
    return req;
  }

  std::shared_ptr<LoopbackHub> hub_;
  const int rank_;
};

}  // namespace myccl::cpu::testing
