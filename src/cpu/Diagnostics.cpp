// What the CPU engine says when an op fails or the ranks disagree: the failure text (timeouts
// name the rank waited for and the messages nobody took; a dead peer names the others gone too),
// stray messages of earlier ops, and MYCCL_DEBUG=DETAIL's fingerprint check before each op.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <string_view>
#include <thread>

#include "myccl/cpu/Engine.hpp"
#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/transport/Transport.hpp"

namespace myccl::cpu {

std::string CpuEngine::describeFailure(const Op& op, const std::exception& e, bool& timeout) const {
  const auto& info = op.work->info();
  std::ostringstream os;
  os << info.describe() << " failed: ";
  auto* ce = dynamic_cast<const CommError*>(&e);
  if (ce && ce->kind() == CommErrorKind::Timeout) {
    timeout = true;
    os << "Timed out after " << info.timeout.count() << " ms";
    if (ce->peer() >= 0) {
      // Within a host collectives wait on shared memory; the TCP link is only the lifeline.
      const bool viaShm = shm_ && topo_.sameHost(rank_, ce->peer()) && op.code != OpCode::Fingerprint;
      os << " waiting for rank " << ce->peer() << " ("
         << (viaShm ? std::string("shared memory") : transport_->describePeer(ce->peer())) << ")";
    }
    os << "; that rank has not reached this op (it may be stuck, dead, or calling something else)";
    auto stray = unmatched();
    if (!stray.empty()) {
      os << ". Unmatched messages:";
      size_t shown = 0;
      for (auto& [peer, tag] : stray) {
        if (shown++ == 4) {
          os << " ...";
          break;
        }
        os << " rank " << peer << " sent " << describeTag(tag) << ";";
      }
    }
  } else {
    os << e.what();
    if (ce && ce->kind() == CommErrorKind::Protocol && !cfg_.debug) {
      os << " (ranks disagree about this op's sizes or order; set MYCCL_DEBUG=DETAIL to check every op)";
    }
    if (ce && ce->kind() == CommErrorKind::PeerGone) {
      // One death makes its neighbours close their links too: the rank that closed on us may
      // only be the messenger. Give the other links a moment to report, then name them all.
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      std::string others;
      for (int q = 0; q < size_; ++q) {
        if (q == rank_ || q == ce->peer()) continue;
        std::string why = transport_->peerGone(q);
        if (!why.empty()) others += " rank " + std::to_string(q) + ": " + why + ";";
      }
      if (!others.empty()) os << ". Also gone:" << others;
    }
  }
  return os.str();
}

// This group's messages that no receive has taken. Links lent to split groups also hold theirs,
// on other channels (a group on a channel sees only its own, as channel 0).
std::vector<std::pair<int, uint64_t>> CpuEngine::unmatched() const {
  auto out = transport_->unmatched();
  std::erase_if(out, [](const auto& m) { return tagChannel(m.second) != 0; });
  return out;
}

// A collective message of an earlier op that nobody received means the ranks disagreed about
// that op (e.g. different roots: both "roots" sent, nobody listened). Fail now instead of
// letting later ops run on a desynchronised group.
void CpuEngine::checkStrays(uint64_t seq) {
  for (auto& [peer, tag] : unmatched()) {
    if (!isCollectiveTag(tag)) continue;  // point-to-point messages may legitimately wait
    if (tagOpCode(tag) == OpCode::MonitoredBarrier) continue;  // numbered apart from the ops
    if (!seqBefore(tagSeq(tag), seq & kSeqMask)) continue;  // a peer simply ahead of us
    throw CommError(CommErrorKind::Protocol,
                    "rank " + std::to_string(peer) + " sent data for " + describeTag(tag) +
                        " that this rank never received: the ranks disagreed about that op (its root, or whether "
                        "it was theirs to send)",
                    peer);
  }
}

// MYCCL_DEBUG=DETAIL: every rank publishes what it is about to run; any difference fails the
// op on every rank with a message listing what each rank called, before any data moves.
void CpuEngine::checkFingerprint(CollCtx& ctx, const Op& op) {
  const auto& i = op.work->info();
  // Shapes must agree only where torch's semantics require it (uneven all_gather lists,
  // all_to_all splits and gather/scatter lists legitimately differ per rank). By name, not
  // OpType: older torch releases give several of these ops one OpType (COALESCED).
  static const std::string_view shaped[] = {"all_reduce", "all_reduce_coalesced", "broadcast", "reduce",
                                            "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
                                            "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"};
  bool withShape = false;
  for (auto name : shaped) withShape |= (name == i.name);
  std::string fp = i.op + " #" + std::to_string(i.seq) + " " + i.dtype;
  if (withShape) fp += " " + i.shape;
  if (i.root >= 0) fp += " root " + std::to_string(i.root);
  if (!i.redop.empty()) fp += " " + i.redop;
  constexpr size_t kLen = 200;
  fp.resize(kLen, '\0');
  CollCtx fctx = ctx;
  fctx.tagBase = collectiveTagBase(OpCode::Fingerprint, i.seq);
  std::vector<char> all(kLen * size_);
  std::vector<void*> outs(size_);
  std::vector<size_t> sizes(size_, kLen);
  for (int r = 0; r < size_; ++r) outs[r] = all.data() + r * kLen;
  cpu::allgatherv(fctx, fp.data(), outs.data(), sizes.data());
  std::vector<std::pair<std::string, std::vector<int>>> distinct;
  for (int r = 0; r < size_; ++r) {
    std::string s(all.data() + r * kLen, strnlen(all.data() + r * kLen, kLen));
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](auto& d) { return d.first == s; });
    if (it == distinct.end()) {
      distinct.push_back({s, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (distinct.size() == 1) return;
  std::ostringstream os;
  os << "MYCCL_DEBUG=DETAIL: ranks called different collectives:";
  for (auto& [s, ranks] : distinct) {
    os << " ranks [";
    for (size_t k = 0; k < ranks.size(); ++k) os << (k ? "," : "") << ranks[k];
    os << "] called " << s << ";";
  }
  throw CommError(CommErrorKind::Protocol, os.str());
}

}  // namespace myccl::cpu
