// The double's Device and Event (Runtime.hpp): the current device and streams of each thread,
// stream items on worker threads, and events as markers in a stream's queue, with CUDA's rules
// for re-recording and waiting.
#include <c10/core/TensorOptions.h>

#include <sstream>

#include "Allocator.hpp"
#include "Machine.hpp"

namespace myccl::cuda::testdouble {

namespace {

// One recorded point: a marker item on a stream. An event's later records make new Marks, so a
// wait issued earlier keeps waiting on the record it captured (cudaStreamWaitEvent semantics).
struct Mark {
  std::shared_ptr<Worker> worker;
  uint64_t seq = 0;
  std::atomic<int64_t> ranAtNs{-1};  // steady_clock time when the marker ran
};

class DoubleEvent final : public Event {
 public:
  DoubleEvent(std::shared_ptr<Machine> m, bool timing) : m_(std::move(m)), timing_(timing) {}

  void record(const Stream& s) override {
    m_->requireDevice("cudaEventRecord");
    auto w = m_->workerOf(s, "cudaEventRecord");
    std::lock_guard<std::mutex> lk(mu_);
    if (device_ < 0) device_ = s.device_index();
    if (device_ != s.device_index()) {
      std::ostringstream os;
      os << "cudaEventRecord: an event of cuda:" << device_ << " recorded on " << streamName(s);
      m_->violation(os.str());
      TORCH_CHECK(false, "myccl: cuda double: ", os.str());
    }
    auto mark = std::make_shared<Mark>();
    mark->worker = w;
    mark->seq = w->enqueue([mark] { mark->ranAtNs = Clock::now().time_since_epoch().count(); });
    last_ = std::move(mark);
  }

  bool query() override {
    m_->requireDevice("cudaEventQuery");
    auto mark = current();
    return !mark || mark->worker->passed() >= mark->seq;
  }

  void block(const Stream& s) override {
    m_->requireDevice("cudaStreamWaitEvent");
    auto target = m_->workerOf(s, "cudaStreamWaitEvent");
    auto mark = current();
    if (!mark) return;
    Machine* m = m_.get();
    // A wait behind a hung op is that op's hang, already reported: no report of its own.
    target->enqueue([mark, m] {
      (void)mark->worker->waitPassed(mark->seq, [m] { return m->stopping.load(); }, std::chrono::hours(24), {});
    });
  }

  void synchronize() override {
    m_->requireDevice("cudaEventSynchronize");
    auto mark = current();
    if (!mark) return;
    Machine* m = m_.get();
    (void)mark->worker->waitPassed(
        mark->seq, [m] { return m->stopping.load(); }, m->hang(), [&] {
          std::ostringstream os;
          os << "hang: cudaEventSynchronize on thread " << threadNumber() << " waits for "
             << streamName(mark->worker->stream) << " for more than " << m->opts.hangMs << " ms";
          m->violation(os.str());
        });
  }

  float elapsedMs(Event& later) override {
    m_->requireDevice("cudaEventElapsedTime");
    auto* other = dynamic_cast<DoubleEvent*>(&later);
    TORCH_CHECK(other != nullptr, "myccl: cuda double: elapsedMs: the later event is not the double's");
    TORCH_CHECK(timing_ && other->timing_,
                "myccl: cuda double: elapsedMs: both events must be made with timing=true (cudaEventElapsedTime: "
                "invalid resource handle)");
    auto a = current(), b = other->current();
    TORCH_CHECK(a && b, "myccl: cuda double: elapsedMs: both events must have been recorded");
    const int64_t ta = a->ranAtNs.load(), tb = b->ranAtNs.load();
    TORCH_CHECK(ta >= 0 && tb >= 0,
                "myccl: cuda double: elapsedMs: an event has not been passed yet (cudaEventElapsedTime: not ready)");
    return static_cast<float>(static_cast<double>(tb - ta) / 1e6);
  }

 private:
  std::shared_ptr<Mark> current() {
    std::lock_guard<std::mutex> lk(mu_);
    return last_;
  }

  std::shared_ptr<Machine> m_;
  const bool timing_;
  std::mutex mu_;
  int device_ = -1;  // fixed by the first record, as torch's CUDAEvent does
  std::shared_ptr<Mark> last_;
};

class DoubleDevice final : public Device {
 public:
  explicit DoubleDevice(std::shared_ptr<Machine> m) : m_(std::move(m)) {}

  int count() override { return m_->opts.devices; }

  int current() override {
    const int d = m_->thread().device;
    return d < 0 ? 0 : d;
  }

  void set(int index) override {
    m_->checkIndex(index, "cudaSetDevice");
    m_->thread().device = index;
  }

  // The double makes no contexts: going back to a device is selecting it.
  void restore(int index) override { set(index); }

  Stream currentStream(int index) override {
    m_->requireDevice("getCurrentCUDAStream");
    m_->checkIndex(index, "getCurrentCUDAStream");
    auto& streams = m_->thread().streams;
    auto it = streams.find(index);
    return Stream(Stream::UNSAFE, cudaDevice(index), it == streams.end() ? 0 : it->second);
  }

  void setCurrentStream(const Stream& s) override {
    m_->requireDevice("setCurrentCUDAStream");
    (void)m_->workerOf(s, "setCurrentCUDAStream");
    m_->thread().streams[s.device_index()] = s.id();
  }

  Stream newStream(int index, bool highPriority) override {
    m_->requireDevice("getStreamFromPool");
    m_->checkIndex(index, "getStreamFromPool");
    if (highPriority) m_->count("streams_high_priority");
    return m_->newStream(index);
  }

  bool isCapturing(const Stream& s) override {
    m_->requireDevice("cudaStreamIsCapturing");
    (void)m_->workerOf(s, "cudaStreamIsCapturing");
    return false;  // the double captures no graphs
  }

  void relaxCaptureMode() override {
    m_->requireDevice("cudaThreadExchangeStreamCaptureMode");
    m_->thread().relaxed = true;
    m_->count("relaxed_capture_mode");
  }

  std::unique_ptr<Event> newEvent(bool timing) override {
    m_->requireDevice("cudaEventCreate");
    m_->count("events");
    return std::make_unique<DoubleEvent>(m_, timing);
  }

  void enqueue(const Stream& s, std::function<void()> f) override {
    m_->requireDevice("enqueue (kernel launch)");
    m_->workerOf(s, "enqueue (kernel launch)")->enqueue(std::move(f));
  }

  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Stream& s) override {
    m_->requireDevice("cudaMalloc (caching allocator)");
    (void)m_->workerOf(s, "cudaMalloc (caching allocator)");
    return m_->allocator().empty(sizes, dtype, s);
  }

  void recordStream(const at::Tensor& t, const Stream& s) override {
    m_->requireDevice("recordStream");
    (void)m_->workerOf(s, "recordStream");
    m_->count("record_stream_calls");  // every call (record_streams: those on the double's own blocks)
    m_->allocator().recordStream(t, s);
  }

  c10::Device deviceOf(const at::Tensor& t) override {
    m_->requireDevice("deviceOf");
    if (t.defined() && t.device().is_cuda()) return t.device();
    return cudaDevice(current());
  }

  bool streamOrdered() override { return false; }

  at::TensorOptions tensorOptions(int index) override {
    m_->checkIndex(index, "tensorOptions");
    return at::TensorOptions(at::kCPU);
  }

  int computeCapability(int index) override {
    m_->checkIndex(index, "computeCapability");
    m_->count("capability_queries");
    return m_->opts.computeCapability;
  }

 private:
  static c10::Device cudaDevice(int index) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)); }

  std::shared_ptr<Machine> m_;
};

}  // namespace

std::shared_ptr<Device> device(const std::shared_ptr<Machine>& m) {
  TORCH_CHECK(m != nullptr, "myccl: cuda double: device() needs a machine");
  return std::make_shared<DoubleDevice>(m);
}

}  // namespace myccl::cuda::testdouble
