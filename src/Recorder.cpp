// Flight recorder ring, trace buffer, JSON dumps and the SIGUSR1 dumper thread.
#include <pthread.h>
#include "myccl/Recorder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

namespace myccl {

namespace {

std::atomic<bool> gTracing{false};

std::string jsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

const char* stateName(OpRecord::State s) {
  switch (s) {
    case OpRecord::State::Queued: return "queued";
    case OpRecord::State::Started: return "started";
    case OpRecord::State::Completed: return "completed";
    case OpRecord::State::Failed: return "failed";
  }
  return "?";
}

void mkdirs(const std::string& dir) {
  std::string cur;
  std::stringstream ss(dir);
  std::string part;
  if (!dir.empty() && dir[0] == '/') cur = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    mkdir(cur.c_str(), 0700);
  }
}

int gSignalPipe[2] = {-1, -1};

void onSigusr1(int) {
  const char c = 1;
  ssize_t r = ::write(gSignalPipe[1], &c, 1);  // async-signal-safe; the dumper thread does the rest
  (void)r;
}

}  // namespace

Recorder::Recorder(std::string group, int rank, int size, size_t capacity, std::string dumpDir)
    : group_(std::move(group)), rank_(rank), size_(size), dumpDir_(std::move(dumpDir)), capacity_(capacity) {
  ring_.resize(capacity_);
}

int64_t Recorder::nowUs() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

void Recorder::setTracing(bool on) {
  gTracing.store(on, std::memory_order_release);
}

bool Recorder::tracing() {
  return gTracing.load(std::memory_order_relaxed);
}

uint64_t Recorder::queued(const OpInfo& info, bool p2p) {
  if (capacity_ == 0 && !tracing()) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_++;
  // Written in place: the ring's slots keep their strings' buffers, so recording an op whose
  // texts fit them allocates nothing.
  OpRecord& r = capacity_ > 0 ? ring_[id % capacity_] : trace_.emplace_back();
  r.id = id;
  r.seq = info.seq;
  r.op = info.op;
  r.dtype = info.dtype;
  r.shape = info.shape;
  r.redop = info.redop;
  r.algo.clear();
  r.transport.clear();
  r.error.clear();
  r.bytes = info.bytes;
  r.root = info.root;
  r.p2p = p2p;
  r.state = OpRecord::State::Queued;
  r.queuedUs = nowUs();
  r.startedUs = r.endedUs = 0;
  return id;
}

OpRecord* Recorder::find(uint64_t id) {
  if (capacity_ > 0) {
    OpRecord& r = ring_[id % capacity_];
    return r.id == id ? &r : nullptr;
  }
  for (auto it = trace_.rbegin(); it != trace_.rend(); ++it)
    if (it->id == id) return &*it;
  return nullptr;
}

void Recorder::started(uint64_t id) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (OpRecord* r = find(id)) {
    r->state = OpRecord::State::Started;
    r->startedUs = nowUs();
  }
}

void Recorder::ended(uint64_t id, const char* algo, const char* transport, uint64_t bytes, const std::string& error) {
  if (id == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  OpRecord* r = find(id);
  if (!r) return;
  r->endedUs = nowUs();
  if (!r->startedUs) r->startedUs = r->queuedUs;
  r->state = error.empty() ? OpRecord::State::Completed : OpRecord::State::Failed;
  r->error = error;
  if (algo) r->algo = algo;
  if (transport) r->transport = transport;
  if (bytes) r->bytes = bytes;
  if (capacity_ > 0 && tracing()) trace_.push_back(*r);
}

std::vector<OpRecord> Recorder::flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<OpRecord> out;
  if (capacity_ == 0) return out;
  const uint64_t first = next_ > capacity_ ? next_ - capacity_ : 1;
  for (uint64_t id = first; id < next_; ++id) {
    const OpRecord& r = ring_[id % capacity_];
    if (r.id == id) out.push_back(r);
  }
  return out;
}

std::vector<OpRecord> Recorder::drainTrace() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<OpRecord> out;
  if (capacity_ == 0) {
    // Completed records leave; ops still running stay for the next drain.
    std::vector<OpRecord> keep;
    for (auto& r : trace_) (r.endedUs ? out : keep).push_back(r);
    trace_.swap(keep);
  } else {
    out.swap(trace_);
  }
  return out;
}

std::string Recorder::dumpJson(const std::string& reason) const {
  auto entries = flight();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::ostringstream os;
  os << "{\"version\": 1, \"group\": \"" << jsonEscape(group_) << "\", \"rank\": " << rank_
     << ", \"world_size\": " << size_ << ", \"host\": \"" << jsonEscape(host) << "\", \"pid\": " << getpid()
     << ", \"reason\": \"" << jsonEscape(reason) << "\", \"dumped_us\": " << nowUs() << ", \"entries\": [";
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& r = entries[i];
    os << (i ? ",\n  " : "\n  ") << "{\"seq\": " << r.seq << ", \"op\": \"" << jsonEscape(r.op) << "\", \"p2p\": "
       << (r.p2p ? "true" : "false") << ", \"dtype\": \"" << jsonEscape(r.dtype) << "\", \"shape\": \""
       << jsonEscape(r.shape) << "\", \"bytes\": " << r.bytes << ", \"root\": " << r.root << ", \"redop\": \""
       << jsonEscape(r.redop) << "\", \"algorithm\": \"" << jsonEscape(r.algo) << "\", \"transport\": \""
       << jsonEscape(r.transport) << "\", \"state\": \"" << stateName(r.state) << "\", \"queued_us\": " << r.queuedUs
       << ", \"started_us\": " << r.startedUs << ", \"ended_us\": " << r.endedUs << ", \"error\": \""
       << jsonEscape(r.error) << "\"}";
  }
  os << "\n]}\n";
  return os.str();
}

std::string Recorder::dumpTo(const std::string& dir, const std::string& reason) const {
  if (capacity_ == 0) return "";
  mkdirs(dir);
  std::string safe = group_;
  for (auto& c : safe)
    if (c == '/' || c == ' ') c = '_';
  const std::string path = dir + "/" + safe + "_rank" + std::to_string(rank_) + "_pid" + std::to_string(getpid()) + ".json";
  // Two dumps of one group can race (the failed op and the peer-failure hook): each writes its
  // own temporary file, and the rename makes the last complete one the dump.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = path + ".tmp" + std::to_string(counter.fetch_add(1));
  {
    std::ofstream f(tmp);
    if (!f) return "";
    f << dumpJson(reason);
    if (!f) return "";
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0 ? path : "";
}

// ---- registry --------------------------------------------------------------------------------

RecorderRegistry& RecorderRegistry::get() {
  static RecorderRegistry* r = new RecorderRegistry();  // never destroyed: used from exit paths
  return *r;
}

void RecorderRegistry::add(const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> lk(mu_);
  live_.push_back(r);
}

void RecorderRegistry::retire(const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = live_.begin(); it != live_.end(); ++it) {
    if (*it == r) {
      live_.erase(it);
      break;
    }
  }
  if (Recorder::tracing()) retired_.push_back(r);  // its trace events are still wanted
}

std::vector<std::shared_ptr<Recorder>> RecorderRegistry::all() const {
  std::lock_guard<std::mutex> lk(mu_);
  auto out = live_;
  out.insert(out.end(), retired_.begin(), retired_.end());
  return out;
}

std::vector<std::string> RecorderRegistry::dumpAll(const std::string& dir, const std::string& reason) const {
  std::vector<std::shared_ptr<Recorder>> rs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    rs = live_;
  }
  std::vector<std::string> paths;
  for (auto& r : rs) {
    auto p = r->dumpTo(dir.empty() ? r->dumpDir() : dir, reason);
    if (!p.empty()) paths.push_back(p);
  }
  return paths;
}

void RecorderRegistry::installSignalHandler() {
  static std::once_flag once;
  std::call_once(once, [this] {
    if (pipe2(gSignalPipe, O_CLOEXEC) != 0) return;
    struct sigaction old {};
    sigaction(SIGUSR1, nullptr, &old);
    if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) return;  // somebody else owns SIGUSR1
    std::thread([this] {
      pthread_setname_np(pthread_self(), "myccl-sigusr1");
      char c;
      while (::read(gSignalPipe[0], &c, 1) == 1 || errno == EINTR) dumpAll("", "SIGUSR1");
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = onSigusr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
  });
}

}  // namespace myccl
