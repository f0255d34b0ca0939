// Unit tests of receive matching (include/myccl/cpu/transport/Matcher.hpp), the code
// TcpTransport runs under its mutex, driven here without sockets, threads or torch.
// Build and run: g++ -std=c++20 -Iinclude tests/cpp/test_matching.cpp && ./a.out
// (tests/cpp/test_matching.py does that). Prints each failed check; exits 1 if any failed.
#include "myccl/cpu/transport/Matcher.hpp"

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

using namespace myccl::cpu;

namespace {

int failures = 0;
const char* current = "";

template <class A, class B>
void checkEq(const A& got, const B& want, const char* expr, int line) {
  if (got == want) return;
  std::ostringstream os;
  os << got;
  std::ostringstream ws;
  ws << want;
  std::printf("FAIL %s (line %d): %s\n  got:  %s\n  want: %s\n", current, line, expr, os.str().c_str(),
              ws.str().c_str());
  ++failures;
}
#define CHECK_EQ(got, want) checkEq((got), (want), #got, __LINE__)

struct Recv : Posting {
  std::string name;
};
struct Msg : Arrival {
  std::string name;
};
using M = Matcher<Recv, Msg>;
using RecvPtr = M::RecvPtr;
using MsgPtr = M::MsgPtr;

RecvPtr recv(const std::string& name, int peer, uint64_t tag) {
  auto r = std::make_shared<Recv>();
  r->name = name;
  r->peer = peer;
  r->tag = tag;
  return r;
}

RecvPtr recvAny(const std::string& name, std::vector<int> peers, uint64_t tag) {
  auto r = std::make_shared<Recv>();
  r->name = name;
  r->anyOf = std::move(peers);
  r->tag = tag;
  return r;
}

MsgPtr msg(const std::string& name, uint64_t tag, bool complete = true) {
  auto m = std::make_shared<Msg>();
  m->name = name;
  m->tag = tag;
  m->complete = complete;
  return m;
}
// A message whose payload is still arriving.
MsgPtr partial(const std::string& name, uint64_t tag) {
  return msg(name, tag, false);
}
// An announcement (RTS): to matching, a message none of whose bytes are here.
MsgPtr announced(const std::string& name, uint64_t tag) {
  return msg(name, tag, false);
}

// A receive is posted, as the transport does it: "<message>@<peer>" when it takes a waiting
// one, "queued" when it waits, "gone" when it can never match.
std::string post(M& m, RecvPtr r) {
  auto found = m.takeArrived(*r);
  if (found.msg) return found.msg->name + "@" + std::to_string(found.peer);
  return m.post(std::move(r)) ? "queued" : "gone";
}

// A message arrives from `peer`: the name of the receive it fills, or "waits".
std::string arrive(M& m, int peer, MsgPtr msg) {
  if (auto r = m.takePosted(peer, msg->tag)) return r->name;
  m.arrived(peer, std::move(msg));
  return "waits";
}

std::string listing(const M& m) {
  std::string s;
  for (auto [peer, tag] : m.unmatched()) s += (s.empty() ? "" : " ") + std::to_string(peer) + ":" + std::to_string(tag);
  return s;
}

std::string names(const std::vector<RecvPtr>& rs) {
  std::string s;
  for (const auto& r : rs) s += (s.empty() ? "" : " ") + r->name;
  return s;
}

auto is(const RecvPtr& want) {
  return [want](const Recv& r) { return &r == want.get(); };
}

void waitingMessagesMatchPerPeerPerTagInArrivalOrder() {
  M m(4);
  CHECK_EQ(arrive(m, 1, msg("a", 5)), "waits");
  CHECK_EQ(arrive(m, 1, msg("b", 7)), "waits");
  CHECK_EQ(arrive(m, 1, msg("c", 5)), "waits");
  CHECK_EQ(arrive(m, 2, msg("d", 5)), "waits");
  CHECK_EQ(post(m, recv("r1", 1, 5)), "a@1");
  CHECK_EQ(post(m, recv("r2", 1, 5)), "c@1");
  CHECK_EQ(post(m, recv("r3", 1, 7)), "b@1");
  CHECK_EQ(post(m, recv("r4", 1, 5)), "queued");
  CHECK_EQ(arrive(m, 1, msg("e", 5)), "r4");
  CHECK_EQ(post(m, recv("r5", 2, 5)), "d@2");
}

void postedReceivesFillInPostOrder() {
  M m(4);
  CHECK_EQ(post(m, recv("r1", 1, 5)), "queued");
  CHECK_EQ(post(m, recv("r2", 1, 5)), "queued");
  CHECK_EQ(post(m, recv("r3", 1, 6)), "queued");
  CHECK_EQ(arrive(m, 1, msg("a", 6)), "r3");
  CHECK_EQ(arrive(m, 1, msg("b", 5)), "r1");
  CHECK_EQ(arrive(m, 1, msg("c", 5)), "r2");
  CHECK_EQ(arrive(m, 1, msg("d", 5)), "waits");
}

void otherTagsAndOtherPeersDoNotMatch() {
  M m(4);
  CHECK_EQ(post(m, recv("r", 1, 5)), "queued");
  CHECK_EQ(arrive(m, 1, msg("a", 6)), "waits");
  CHECK_EQ(arrive(m, 2, msg("b", 5)), "waits");
  CHECK_EQ(post(m, recv("s", 3, 5)), "queued");
  CHECK_EQ(post(m, recv("t", 2, 6)), "queued");
  CHECK_EQ(listing(m), "1:6 2:5");
  CHECK_EQ(arrive(m, 1, msg("c", 5)), "r");
}

void postedReceiveTakesAnEarlierMessageInAnyState() {
  M m(4);
  CHECK_EQ(arrive(m, 1, msg("whole", 5)), "waits");
  CHECK_EQ(arrive(m, 1, partial("partial", 8)), "waits");
  CHECK_EQ(arrive(m, 1, announced("rts", 9)), "waits");
  CHECK_EQ(post(m, recv("r1", 1, 9)), "rts@1");
  CHECK_EQ(post(m, recv("r2", 1, 8)), "partial@1");
  CHECK_EQ(post(m, recv("r3", 1, 5)), "whole@1");
  CHECK_EQ(listing(m), "");
  CHECK_EQ(post(m, recv("r4", 1, 5)), "queued");
}

void receiveFromAnyTakesTheOldestCandidateOfItsPeers() {
  M m(4);
  CHECK_EQ(arrive(m, 1, msg("a", 5)), "waits");
  CHECK_EQ(arrive(m, 3, msg("x", 5)), "waits");
  CHECK_EQ(arrive(m, 2, msg("y", 6)), "waits");
  CHECK_EQ(arrive(m, 2, msg("c", 5)), "waits");
  CHECK_EQ(arrive(m, 1, msg("b", 5)), "waits");
  CHECK_EQ(post(m, recvAny("any1", {1, 2}, 5)), "a@1");
  CHECK_EQ(post(m, recvAny("any2", {2, 1}, 5)), "c@2");
  CHECK_EQ(post(m, recvAny("any3", {1, 2}, 5)), "b@1");
  CHECK_EQ(post(m, recvAny("any4", {1, 2}, 5)), "queued");  // x came from 3, outside the set
  CHECK_EQ(listing(m), "2:6 3:5");
  CHECK_EQ(arrive(m, 3, msg("z", 5)), "waits");
  CHECK_EQ(arrive(m, 2, msg("w", 5)), "any4");
  CHECK_EQ(post(m, recvAny("any5", {0, 3}, 5)), "x@3");
}

void receiveFromAnyAndSpecificReceivesCompeteByPostOrder() {
  M m(4);
  CHECK_EQ(post(m, recv("r1", 1, 5)), "queued");
  CHECK_EQ(post(m, recvAny("any", {1, 2}, 5)), "queued");
  CHECK_EQ(post(m, recvAny("other-tag", {1, 2}, 6)), "queued");
  CHECK_EQ(post(m, recv("r2", 1, 5)), "queued");
  CHECK_EQ(arrive(m, 1, msg("a", 5)), "r1");
  CHECK_EQ(arrive(m, 1, msg("b", 5)), "any");
  CHECK_EQ(arrive(m, 1, msg("c", 5)), "r2");
  CHECK_EQ(arrive(m, 1, msg("d", 5)), "waits");

  M n(4);
  CHECK_EQ(post(n, recv("s1", 2, 5)), "queued");
  CHECK_EQ(post(n, recvAny("any", {1, 2}, 5)), "queued");
  CHECK_EQ(arrive(n, 1, msg("a", 5)), "any");  // a receive from 2 does not take 1's message
  CHECK_EQ(arrive(n, 2, msg("b", 5)), "s1");
  CHECK_EQ(arrive(n, 3, msg("c", 5)), "waits");
}

void cancelWithdrawsOnlyAWaitingReceive() {
  M m(4);
  auto r = recv("r", 1, 5);
  CHECK_EQ(post(m, r), "queued");
  CHECK_EQ(m.cancel(1, is(r)), true);
  CHECK_EQ(m.cancel(1, is(r)), false);
  CHECK_EQ(arrive(m, 1, msg("a", 5)), "waits");

  auto matched = recv("matched", 1, 6);
  CHECK_EQ(post(m, matched), "queued");
  CHECK_EQ(arrive(m, 1, msg("b", 6)), "matched");
  CHECK_EQ(m.cancel(1, is(matched)), false);

  auto took = recv("took", 1, 5);
  CHECK_EQ(post(m, took), "a@1");
  CHECK_EQ(m.cancel(1, is(took)), false);

  auto any = recvAny("any", {1, 2}, 7);
  CHECK_EQ(post(m, any), "queued");
  CHECK_EQ(m.cancel(-1, is(any)), true);
  CHECK_EQ(arrive(m, 2, msg("c", 7)), "waits");

  auto keep = recv("keep", 2, 8);
  auto mine = recv("mine", 1, 8);
  CHECK_EQ(post(m, keep), "queued");
  CHECK_EQ(post(m, mine), "queued");
  CHECK_EQ(m.cancel(-1, is(mine)), false);  // a specific receive is looked for at its peer only
  CHECK_EQ(m.cancel(2, is(mine)), false);
  CHECK_EQ(m.cancel(1, is(mine)), true);
  CHECK_EQ(arrive(m, 1, msg("d", 8)), "waits");
  CHECK_EQ(arrive(m, 2, msg("e", 8)), "keep");
}

void sizeAndAgreementWordMismatchesAreRefused() {
  CHECK_EQ(matchError(1, 64, 0, 64, 0), "");
  CHECK_EQ(matchError(1, 64, 7, 64, 7), "");
  CHECK_EQ(matchError(1, 64, 0, 64, 7), "");  // 0: the message carries no word
  CHECK_EQ(matchError(1, 64, 7, 64, 0), "");  // 0: the receive asks for none
  CHECK_EQ(matchError(3, 64, 0, 128, 0), "message from rank 3 has 64 bytes but the receive expects 128");
  CHECK_EQ(matchError(3, 128, 7, 64, 7), "message from rank 3 has 128 bytes but the receive expects 64");
  CHECK_EQ(matchError(2, 64, 0xa, 64, 0xb),
           "rank 2 sent data for a different variant of this op (agreement word 0000000a, this rank 0000000b): "
           "the ranks disagree about its dtype, reduce op or element count");
  // Size is reported first when both differ.
  CHECK_EQ(matchError(2, 8, 0xa, 16, 0xb), "message from rank 2 has 8 bytes but the receive expects 16");
}

void unmatchedListsWaitingMessagesByPeerThenArrival() {
  M m(4);
  CHECK_EQ(listing(m), "");
  CHECK_EQ(arrive(m, 2, msg("a", 9)), "waits");
  CHECK_EQ(arrive(m, 1, announced("b", 5)), "waits");
  CHECK_EQ(arrive(m, 1, partial("c", 6)), "waits");
  CHECK_EQ(arrive(m, 2, msg("d", 3)), "waits");
  CHECK_EQ(post(m, recv("r", 0, 9)), "queued");  // queued receives are not listed
  CHECK_EQ(listing(m), "1:5 1:6 2:9 2:3");
  CHECK_EQ(post(m, recv("s", 2, 9)), "a@2");
  CHECK_EQ(listing(m), "1:5 1:6 2:3");
}

void peerFailureKeepsWholeMessagesAndFailsWhatCanNoLongerMatch() {
  M m(4);
  CHECK_EQ(arrive(m, 1, msg("whole", 1)), "waits");
  CHECK_EQ(arrive(m, 1, announced("rts", 2)), "waits");
  CHECK_EQ(arrive(m, 1, partial("partial", 3)), "waits");
  auto done = partial("done", 4);  // its payload came in full before the peer failed
  CHECK_EQ(arrive(m, 1, done), "waits");
  done->complete = true;
  CHECK_EQ(arrive(m, 2, announced("rts2", 2)), "waits");
  CHECK_EQ(post(m, recv("r1", 1, 7)), "queued");
  CHECK_EQ(post(m, recv("r2", 1, 8)), "queued");
  CHECK_EQ(post(m, recv("r3", 2, 7)), "queued");
  CHECK_EQ(post(m, recvAny("any12", {1, 2}, 9)), "queued");
  CHECK_EQ(post(m, recvAny("any1", {1}, 9)), "queued");
  CHECK_EQ(post(m, recvAny("any13", {1, 3}, 9)), "queued");

  auto orphans = m.dropPeer(1);
  CHECK_EQ(names(orphans.posted), "r1 r2");
  CHECK_EQ(names(orphans.any), "any1");
  CHECK_EQ(listing(m), "1:1 1:4 2:2");
  CHECK_EQ(post(m, recv("w", 1, 1)), "whole@1");
  CHECK_EQ(post(m, recv("d", 1, 4)), "done@1");
  CHECK_EQ(post(m, recv("x", 1, 2)), "gone");
  CHECK_EQ(post(m, recv("y", 1, 3)), "gone");
  CHECK_EQ(post(m, recvAny("z", {1}, 9)), "gone");
  CHECK_EQ(post(m, recvAny("late", {1, 2}, 5)), "queued");
  CHECK_EQ(arrive(m, 2, msg("a", 9)), "any12");
  CHECK_EQ(arrive(m, 2, msg("b", 7)), "r3");
  CHECK_EQ(arrive(m, 3, msg("c", 9)), "any13");

  orphans = m.dropPeer(2);
  CHECK_EQ(names(orphans.posted), "");
  CHECK_EQ(names(orphans.any), "late");
  CHECK_EQ(listing(m), "");  // 2's announcement went with it
}

void closingTakesEveryReceiveFromAny() {
  M m(4);
  CHECK_EQ(post(m, recvAny("a", {1, 2}, 5)), "queued");
  CHECK_EQ(post(m, recv("r", 1, 5)), "queued");
  CHECK_EQ(post(m, recvAny("b", {3}, 6)), "queued");
  CHECK_EQ(names(m.takeAny()), "a b");
  CHECK_EQ(arrive(m, 2, msg("x", 5)), "waits");
  CHECK_EQ(arrive(m, 1, msg("y", 5)), "r");
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"waitingMessagesMatchPerPeerPerTagInArrivalOrder", waitingMessagesMatchPerPeerPerTagInArrivalOrder},
      {"postedReceivesFillInPostOrder", postedReceivesFillInPostOrder},
      {"otherTagsAndOtherPeersDoNotMatch", otherTagsAndOtherPeersDoNotMatch},
      {"postedReceiveTakesAnEarlierMessageInAnyState", postedReceiveTakesAnEarlierMessageInAnyState},
      {"receiveFromAnyTakesTheOldestCandidateOfItsPeers", receiveFromAnyTakesTheOldestCandidateOfItsPeers},
      {"receiveFromAnyAndSpecificReceivesCompeteByPostOrder", receiveFromAnyAndSpecificReceivesCompeteByPostOrder},
      {"cancelWithdrawsOnlyAWaitingReceive", cancelWithdrawsOnlyAWaitingReceive},
      {"sizeAndAgreementWordMismatchesAreRefused", sizeAndAgreementWordMismatchesAreRefused},
      {"unmatchedListsWaitingMessagesByPeerThenArrival", unmatchedListsWaitingMessagesByPeerThenArrival},
      {"peerFailureKeepsWholeMessagesAndFailsWhatCanNoLongerMatch",
       peerFailureKeepsWholeMessagesAndFailsWhatCanNoLongerMatch},
      {"closingTakesEveryReceiveFromAny", closingTakesEveryReceiveFromAny},
  };
  int failedTests = 0;
  for (const auto& [name, fn] : tests) {
    current = name;
    const int before = failures;
    fn();
    if (failures != before) ++failedTests;
  }
  std::printf("%zu tests, %d failed (%d checks)\n", tests.size(), failedTests, failures);
  return failures == 0 ? 0 : 1;
}
