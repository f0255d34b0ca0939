// The double's machine: stream worker threads, per-thread CUDA state, the violation log and the
// counters, and the public test hooks (CudaDouble.hpp) that read them.
#include "Machine.hpp"

#include <cstdio>
#include <sstream>

#include "Allocator.hpp"

namespace myccl::cuda::testdouble {

std::string streamName(const Stream& s) {
  std::ostringstream os;
  os << "cuda:" << static_cast<int>(s.device_index()) << " stream " << s.id();
  return os.str();
}

uint64_t threadNumber() {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t n = next++;
  return n;
}

// ---- Worker -------------------------------------------------------------------------------

Worker::Worker(Machine& m, Stream s, uint64_t seed) : stream(s), m_(m), rng_(seed) {}

Worker::~Worker() {
  // Normally stopped by the machine; a worker dropped otherwise still must not leave a thread.
  stop();
}

uint64_t Worker::enqueue(std::function<void()> f) {
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    seq = ++held_;
    if (!stop_) {
      q_.push_back(std::move(f));
      if (!th_.joinable()) th_ = std::thread([self = shared_from_this()] { self->loop(); });
    }
  }
  cv_.notify_all();
  // A stopped worker drops f here, outside the lock: its captures may enqueue (a tensor's
  // deleter queues its release).
  return seq;
}

uint64_t Worker::passed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return passed_;
}

uint64_t Worker::held() const {
  std::lock_guard<std::mutex> lk(mu_);
  return held_;
}

bool Worker::waitPassed(uint64_t seq, const std::function<bool()>& cancelled, Clock::duration hang,
                        const std::function<void()>& onHang) {
  const auto start = Clock::now();
  bool reported = false;
  std::unique_lock<std::mutex> lk(mu_);
  while (passed_ < seq) {
    if (stop_) return false;
    lk.unlock();
    if (cancelled && cancelled()) return false;
    if (!reported && Clock::now() - start > hang) {
      reported = true;
      if (onHang) onHang();
    }
    lk.lock();
    if (passed_ >= seq) break;
    cv_.wait_for(lk, std::chrono::milliseconds(20));
  }
  return true;
}

void Worker::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (!th_.joinable()) return;
  if (th_.get_id() == std::this_thread::get_id()) {
    th_.detach();
  } else {
    th_.join();
  }
}

void Worker::loop() {
  {
    ThreadState& ts = m_.thread();
    ts.worker = true;
    ts.device = stream.device_index();
    ts.streams[ts.device] = stream.id();
  }
  const int maxDelay = std::max(0, m_.opts.maxDelayUs);
  for (;;) {
    std::function<void()> f;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
      if (stop_) return;
      f = std::move(q_.front());
      q_.pop_front();
    }
    if (maxDelay > 0) std::this_thread::sleep_for(std::chrono::microseconds(rng_() % (maxDelay + 1)));
    std::string threw;
    try {
      f();
    } catch (const c10::Error& e) {
      threw = e.what_without_backtrace();
    } catch (const std::exception& e) {
      threw = e.what();
    } catch (...) {
      threw = "a non-standard exception";
    }
    bool stopped = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++passed_;
      stopped = stop_;
    }
    cv_.notify_all();
    // Stopped: the machine may be gone already (the item dropped its last reference).
    if (!threw.empty() && !stopped) m_.violation("stream item threw: " + threw + " (on " + streamName(stream) + ")");
    // May drop the last reference to the machine, whose destructor then detaches this thread
    // (stop()); from here on only this worker's own members are touched.
    f = nullptr;
  }
}

// ---- Machine ------------------------------------------------------------------------------

namespace {
uint64_t nextSerial() {
  static std::atomic<uint64_t> n{1};
  return n++;
}
}  // namespace

Machine::Machine(const Options& o)
    : opts(o),
      serial(nextSerial()),
      rng_(o.seed != 0 ? o.seed : static_cast<uint64_t>(Clock::now().time_since_epoch().count())) {
  TORCH_CHECK(o.devices >= 1, "myccl: cuda double: Options.devices must be at least 1, got ", o.devices);
  streams_.resize(static_cast<size_t>(o.devices));
  nextStream_.assign(static_cast<size_t>(o.devices), 1);
  allocator_ = std::make_unique<Allocator>(*this);
  // The documented facts are present from the start, so a test can tell 0 from a typo.
  for (const char* name : {"comms_created", "comms_blocking", "comms_nonblocking", "group_launches", "premul_host",
                           "premul_device", "streams", "violations"}) {
    counters_[name] = 0;
  }
}

Machine::~Machine() {
  stopping = true;
  std::vector<std::shared_ptr<Worker>> ws;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& dev : streams_) {
      for (auto& kv : dev) ws.push_back(kv.second);
    }
  }
  for (auto& w : ws) w->stop();
  nccl_.reset();
  allocator_.reset();
}

void Machine::violation(const std::string& what) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    violations_.push_back(what);
    ++counters_["violations"];
  }
  std::fprintf(stderr, "[myccl cuda double] %s\n", what.c_str());
  std::fflush(stderr);
}

void Machine::count(const std::string& name, int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  counters_[name] += n;
}

std::vector<std::string> Machine::violationList() const {
  std::lock_guard<std::mutex> lk(mu_);
  return violations_;
}

void Machine::clearViolationList() {
  std::lock_guard<std::mutex> lk(mu_);
  violations_.clear();
}

std::map<std::string, int64_t> Machine::counterMap() const {
  std::lock_guard<std::mutex> lk(mu_);
  return counters_;
}

ThreadState& Machine::thread() {
  // Keyed by serial, not address: a later machine may reuse a dead one's address.
  thread_local std::map<uint64_t, ThreadState> states;
  return states[serial];
}

void Machine::requireDevice(const char* call) {
  ThreadState& ts = thread();
  if (ts.device >= 0 || ts.worker) return;
  if (!ts.reported.insert(call).second) return;
  std::ostringstream os;
  os << "cuda call " << call << " on thread " << threadNumber()
     << " before any device was selected (cudaSetDevice)";
  violation(os.str());
}

void Machine::checkIndex(int index, const char* call) const {
  TORCH_CHECK(index >= 0 && index < opts.devices, "myccl: cuda double: ", call, ": invalid device ordinal ", index,
              " (the double has ", opts.devices, " devices)");
}

std::shared_ptr<Worker> Machine::worker(const Stream& s) {
  if (s.device_type() != c10::kCUDA) return nullptr;
  const int d = s.device_index();
  if (d < 0 || d >= opts.devices) return nullptr;
  std::lock_guard<std::mutex> lk(mu_);
  auto& dev = streams_[static_cast<size_t>(d)];
  auto it = dev.find(s.id());
  if (it != dev.end()) return it->second;
  if (s.id() != 0 || stopping) return nullptr;
  // Default streams exist from the start; their workers are made on first use.
  auto w = std::make_shared<Worker>(*this, s, rng_());
  dev.emplace(0, w);
  return w;
}

std::shared_ptr<Worker> Machine::workerOf(const Stream& s, const char* call) {
  auto w = worker(s);
  if (w) return w;
  std::ostringstream os;
  os << call << " on thread " << threadNumber() << " got " << s << ", which is no stream of this machine";
  violation(os.str());
  TORCH_CHECK(false, "myccl: cuda double: ", os.str());
}

Stream Machine::newStream(int device) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t id = nextStream_[static_cast<size_t>(device)]++;
  Stream s(Stream::UNSAFE, c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)), id);
  streams_[static_cast<size_t>(device)].emplace(id, std::make_shared<Worker>(*this, s, rng_()));
  ++counters_["streams"];
  return s;
}

std::vector<std::shared_ptr<Worker>> Machine::workers() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<std::shared_ptr<Worker>> ws;
  for (const auto& dev : streams_) {
    for (const auto& kv : dev) ws.push_back(kv.second);
  }
  return ws;
}

uint64_t Machine::random(uint64_t bound) {
  std::lock_guard<std::mutex> lk(mu_);
  return bound == UINT64_MAX ? rng_() : rng_() % (bound + 1);
}

bool pollUntil(const std::function<bool()>& ready, const std::function<bool()>& cancelled, Clock::duration hang,
               const std::function<void()>& onHang, Clock::duration maxPause) {
  const auto start = Clock::now();
  bool reported = false;
  Clock::duration pause = std::chrono::microseconds(50);
  for (;;) {
    if (ready()) return true;
    if (cancelled && cancelled()) return false;
    if (!reported && Clock::now() - start > hang) {
      reported = true;
      if (onHang) onHang();
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<Clock::duration>(pause * 2, maxPause);
  }
}

// ---- device order ---------------------------------------------------------------------------

void Machine::setDeviceOrder(bool on) {
  std::lock_guard<std::mutex> lk(orderMu_);
  deviceOrder_ = on;
}

uint64_t Machine::takeDeviceTicket(int device) {
  std::lock_guard<std::mutex> lk(orderMu_);
  return deviceOrder_ ? ++ticketsTaken_[device] : 0;
}

void Machine::awaitDeviceTurn(int device, uint64_t ticket, const std::function<bool()>& cancelled,
                              const std::string& what) {
  const auto start = Clock::now();
  bool reported = false;
  std::unique_lock<std::mutex> lk(orderMu_);
  while (ticketsDone_[device] + 1 < ticket) {
    if ((cancelled && cancelled()) || stopping.load()) return;
    orderCv_.wait_for(lk, std::chrono::milliseconds(20));
    if (!reported && Clock::now() - start > hang()) {
      reported = true;
      lk.unlock();
      violation("device " + std::to_string(device) + ": a launch on communicator " + what +
                " waited past the hang time for the device's earlier launches (launches of communicators that "
                "share ranks were made in different orders on different ranks)");
      lk.lock();
    }
  }
}

void Machine::endDeviceTurn(int device, uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lk(orderMu_);
    ticketsDone_[device] = std::max(ticketsDone_[device], ticket);
  }
  orderCv_.notify_all();
}

// ---- public hooks -------------------------------------------------------------------------

std::shared_ptr<Machine> machine(const Options& opts) {
  static std::mutex mu;
  // Never destroyed: its stream threads may still run while the process exits.
  static auto* mine = new std::shared_ptr<Machine>();
  std::lock_guard<std::mutex> lk(mu);
  if (!*mine) *mine = std::make_shared<Machine>(opts);
  return *mine;
}

std::shared_ptr<Machine> newMachine(const Options& opts) { return std::make_shared<Machine>(opts); }

const Options& options(const Machine& m) { return m.opts; }

std::vector<std::string> violations(const Machine& m) { return m.violationList(); }
void clearViolations(Machine& m) { m.clearViolationList(); }
std::map<std::string, int64_t> counters(const Machine& m) { return m.counterMap(); }

void kernel(Machine& m, const Stream& s, void* p, size_t nbytes, const std::string& use, int delayMs,
            std::function<void()> body) {
  auto self = m.shared_from_this();
  m.workerOf(s, use.c_str())->enqueue([self, s, p, nbytes, use, delayMs, body = std::move(body)] {
    if (delayMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delayMs));
    if (p != nullptr) self->allocator().check(p, nbytes, use, s);
    body();
  });
}

void setDeviceOrder(Machine& m, bool on) { m.setDeviceOrder(on); }

void synchronize(Machine& m) {
  const auto deadline = Clock::now() + m.hang();
  auto pastDeadline = [&] { return Clock::now() > deadline || m.stopping.load(); };
  std::vector<std::pair<std::shared_ptr<Worker>, uint64_t>> targets;
  for (auto& w : m.workers()) targets.emplace_back(w, w->held());
  std::vector<std::string> busy;
  for (auto& [w, target] : targets) {
    if (!w->waitPassed(target, pastDeadline, m.hang() * 2, {})) {
      const uint64_t passed = std::min(target, w->passed());
      busy.push_back(streamName(w->stream) + " (" + std::to_string(target - passed) + " items left)");
    }
  }
  if (busy.empty()) return;
  std::string list;
  for (const auto& b : busy) list += (list.empty() ? "" : ", ") + b;
  m.violation("hang: synchronize: " + list + " still busy after " + std::to_string(m.opts.hangMs) + " ms");
}

std::vector<std::string> violations() { return violations(*machine()); }
void clearViolations() { clearViolations(*machine()); }
void synchronize() { synchronize(*machine()); }
std::map<std::string, int64_t> counters() { return counters(*machine()); }

}  // namespace myccl::cuda::testdouble
