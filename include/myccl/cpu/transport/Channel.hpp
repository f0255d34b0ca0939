// Links shared by a group and the groups split from it (torch's split_group): one TCP mesh, each
// group on its own channel of the message tag (Tags.hpp), so a split costs no listener, no
// connection and no secret. A group on a channel sees its own ranks and tags only; when it closes
// (it failed, or it was destroyed) it withdraws what it has posted and tells its peers, and the
// other groups' traffic goes on.
#pragma once

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

// The links a group made, with the count of groups that use them.
class SharedLinks {
 public:
  SharedLinks(std::shared_ptr<Transport> base, const std::string& owner);
  Transport& base() const { return *base_; }
  // "group '<name>'", for messages.
  const std::string& owner() const { return owner_; }
  // One more group on these links; every user releases once.
  void hold();
  // An orderly close by one group: the links themselves close with the last one.
  void release(const std::string& reason);
  // The channel of the next split, the same on every rank (a split is collective over the group
  // that owns the links); -1 once all are taken.
  int nextChannel();

 private:
  std::shared_ptr<Transport> base_;
  const std::string owner_;
  std::mutex mu_;
  int users_ = 1;
  int channels_ = 0;
};

class ChannelTransport final : public Transport {
 public:
  // `members`: the new group's ranks in the links' numbering, in the new group's order; `rank`:
  // this rank's index among them. Closing withdraws what has not started moving and waits up to
  // `grace` for the transfers already under way; past that it closes the shared links, the only way
  // to stop them touching this group's buffers.
  ChannelTransport(std::shared_ptr<SharedLinks> links, std::vector<int> members, int rank, int channel,
                   std::string group, std::chrono::milliseconds grace);
  ~ChannelTransport() override;

  const char* name() const override;
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) override;
  RequestPtr isendPosted(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check = 0) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t nbytes, uint32_t check = 0) override;
  RequestPtr irecvAny(const std::vector<int>& peers, uint64_t tag, void* data, size_t nbytes) override;
  void close(const std::string& reason, bool failure = false) override;
  std::string describePeer(int peer) const override;
  std::string peerGone(int peer) const override;
  bool cancel(const RequestPtr& req) override;
  std::vector<std::pair<int, uint64_t>> unmatched() const override;
  std::vector<int> vanishedPeers() const override;

  struct State;  // shared with the callbacks of the requests posted on the links

 private:
  RequestPtr send(int peer, uint64_t tag, const void* data, size_t nbytes, uint32_t check, bool posted);
  std::shared_ptr<State> st_;
};

}  // namespace myccl::cpu
