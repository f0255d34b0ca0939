// What each group ran, for people debugging a slow or stuck job: the flight recorder (the last
// N ops of every group, always on, dumped as JSON on a timeout, a fatal error, SIGUSR1 or on
// request) and, while tracing is on, every op for the Chrome-trace timeline. Both engines
// record here; c10d_ext/trace.py reads, writes, merges and analyses.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "myccl/Work.hpp"

namespace myccl {

struct OpRecord {
  enum class State { Queued, Started, Completed, Failed };
  uint64_t id = 0;  // recorder-local, monotonic
  uint64_t seq = 0;
  std::string op, dtype, shape, redop, algo, transport, error;
  uint64_t bytes = 0;
  int64_t root = -1;
  bool p2p = false;
  State state = State::Queued;
  int64_t queuedUs = 0, startedUs = 0, endedUs = 0;  // wall clock (CLOCK_REALTIME), microseconds
};

class Recorder {
 public:
  // `dumpDir`: where automatic dumps (timeout, error, SIGUSR1) of this group go.
  Recorder(std::string group, int rank, int size, size_t capacity, std::string dumpDir);

  // Returns the record id (0 when nothing is recorded: flight recorder off and not tracing).
  uint64_t queued(const OpInfo& info, bool p2p);
  void started(uint64_t id);
  void ended(uint64_t id, const char* algo, const char* transport, uint64_t bytes, const std::string& error);

  std::vector<OpRecord> flight() const;       // oldest first
  std::vector<OpRecord> drainTrace();         // every op since the last drain, while tracing
  std::string dumpJson(const std::string& reason) const;
  // Writes the flight recorder to `dir`/<group>_rank<r>_pid<pid>.json; returns the path or "".
  std::string dumpTo(const std::string& dir, const std::string& reason) const;

  const std::string& group() const { return group_; }
  const std::string& dumpDir() const { return dumpDir_; }
  int rank() const { return rank_; }

  static int64_t nowUs();
  static void setTracing(bool on);
  static bool tracing();

 private:
  OpRecord* find(uint64_t id);
  void finishTrace(const OpRecord& r);

  const std::string group_;
  const int rank_, size_;
  const std::string dumpDir_;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::vector<OpRecord> ring_;
  uint64_t next_ = 1;
  std::vector<OpRecord> trace_;
};

// Every recorder of this process: SIGUSR1 and dump-on-request reach all groups; trace events of
// destroyed groups stay available until drained.
class RecorderRegistry {
 public:
  static RecorderRegistry& get();
  void add(const std::shared_ptr<Recorder>& r);
  void retire(const std::shared_ptr<Recorder>& r);  // the group is gone
  std::vector<std::shared_ptr<Recorder>> all() const;
  // Every live group to `dir` ("" : each to its own dump directory).
  std::vector<std::string> dumpAll(const std::string& dir, const std::string& reason) const;
  // Installs the SIGUSR1 handler (once): a helper thread dumps every group.
  void installSignalHandler();

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Recorder>> live_;
  std::vector<std::shared_ptr<Recorder>> retired_;
};

}  // namespace myccl
