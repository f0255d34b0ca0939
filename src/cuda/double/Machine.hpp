// The double's simulated machine (private to src/cuda/double): stream workers, per-thread CUDA
// state, the violation log and counters. The allocator (Allocator.hpp) and the communicators
// (Nccl.hpp) hang off it; everything a stream item touches outlives the item.
#pragma once

#include "myccl/cuda/double/CudaDouble.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace myccl::cuda::testdouble {

using Clock = std::chrono::steady_clock;

class Allocator;
struct NcclState;

// "cuda:0 stream 3", for messages.
std::string streamName(const Stream& s);
// A small number naming the calling thread in messages (std::thread::id prints as a huge one).
uint64_t threadNumber();

// One stream: a thread that runs the stream's items in FIFO order, each after a random delay,
// so that work which only happens to be ordered on a GPU visibly is not here.
class Worker : public std::enable_shared_from_this<Worker> {
 public:
  Worker(Machine& m, Stream s, uint64_t seed);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  const Stream stream;

  // Appends f and returns its position (1-based), for passed().
  uint64_t enqueue(std::function<void()> f);
  uint64_t passed() const;  // items run so far
  uint64_t held() const;    // items enqueued so far
  // Blocks until item `seq` has run (true) or cancelled() (false). If that takes longer than
  // `hang`, onHang() runs once and the wait goes on.
  bool waitPassed(uint64_t seq, const std::function<bool()>& cancelled, Clock::duration hang,
                  const std::function<void()>& onHang);
  // Ends the thread after its current item. Joins it, unless the caller is that thread (an item
  // dropping the last reference to the machine): then it detaches, and the loop leaves without
  // touching the machine again.
  void stop();

 private:
  void loop();

  Machine& m_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t held_ = 0;
  uint64_t passed_ = 0;
  bool stop_ = false;
  std::thread th_;
  std::mt19937_64 rng_;
};

// The calling thread's CUDA state on one machine (cudaSetDevice, current streams).
struct ThreadState {
  int device = -1;      // -1: never selected
  bool worker = false;  // one of the machine's stream threads
  bool relaxed = false; // relaxCaptureMode was called
  std::map<int, int64_t> streams;  // device -> current stream id (absent: 0, the default)
  std::set<std::string> reported;  // calls already reported as made without a device
};

class Machine : public std::enable_shared_from_this<Machine> {
 public:
  explicit Machine(const Options& o);
  ~Machine();
  Machine(const Machine&) = delete;
  Machine& operator=(const Machine&) = delete;

  const Options opts;
  const uint64_t serial;  // keys thread-local state: addresses of dead machines get reused
  std::atomic<bool> stopping{false};

  // ---- violations and counters ----
  void violation(const std::string& what);
  void count(const std::string& name, int64_t n = 1);
  std::vector<std::string> violationList() const;
  void clearViolationList();
  std::map<std::string, int64_t> counterMap() const;

  // ---- threads ----
  ThreadState& thread();
  // A CUDA call from a thread that selected no device: reported once per thread and call.
  void requireDevice(const char* call);
  // Throws (as CUDA's invalid-device error would) for an index that is no device.
  void checkIndex(int index, const char* call) const;

  // ---- streams ----
  // The worker of `s`, or null when `s` is no stream of this machine.
  std::shared_ptr<Worker> worker(const Stream& s);
  // The same, but an unknown stream is a violation and throws (CUDA: invalid resource handle).
  std::shared_ptr<Worker> workerOf(const Stream& s, const char* call);
  Stream newStream(int device);
  std::vector<std::shared_ptr<Worker>> workers() const;

  uint64_t random(uint64_t bound);  // uniform in [0, bound]
  Clock::duration hang() const { return std::chrono::milliseconds(opts.hangMs); }

  Allocator& allocator() { return *allocator_; }
  // The machine's shared device memory (Memory.cpp), made on first use and kept while used.
  std::shared_ptr<Memory> memory();
  // Communicator state, created by the first Nccl on this machine.
  std::shared_ptr<NcclState> nccl();

  // ---- device order (off unless a test turns it on) ----
  // On: each device runs one communicator launch at a time, in the order they were launched on
  // it across communicators and streams. NCCL allows a GPU to behave so (one kernel resident at a
  // time), which is why every rank must launch the ops of communicators that share ranks in the
  // same order: here a different order hangs, as it may on a GPU.
  void setDeviceOrder(bool on);
  // The launch's place on its device (0: device order is off).
  uint64_t takeDeviceTicket(int device);
  // Waits until every earlier ticket of `device` has run (or `cancelled`); past hang(), a violation.
  void awaitDeviceTurn(int device, uint64_t ticket, const std::function<bool()>& cancelled, const std::string& what);
  void endDeviceTurn(int device, uint64_t ticket);

 private:
  mutable std::mutex mu_;
  std::vector<std::string> violations_;
  std::map<std::string, int64_t> counters_;
  std::mt19937_64 rng_;
  // Per device: stream id -> worker. Id 0 is the default stream.
  std::vector<std::map<int64_t, std::shared_ptr<Worker>>> streams_;
  std::vector<int64_t> nextStream_;
  std::unique_ptr<Allocator> allocator_;
  std::shared_ptr<NcclState> nccl_;
  std::mutex memoryMu_;
  std::weak_ptr<Memory> memory_;
  std::mutex orderMu_;
  std::condition_variable orderCv_;
  bool deviceOrder_ = false;
  std::map<int, uint64_t> ticketsTaken_, ticketsDone_;  // per device
};

// Polls `ready` until true or `cancelled()`, sleeping a little longer each round (at most
// `maxPause`); past `hang` without success, onHang() runs once. Returns whether ready.
bool pollUntil(const std::function<bool()>& ready, const std::function<bool()>& cancelled, Clock::duration hang,
               const std::function<void()>& onHang,
               Clock::duration maxPause = std::chrono::milliseconds(20));

}  // namespace myccl::cuda::testdouble
