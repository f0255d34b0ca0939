// The Reducer's two sources of streams and events (Streams.hpp): the CUDA engine's seam, and
// c10's device-generic guard interface for groups whose device backend is not myccl.
#include "Streams.hpp"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "myccl/Errors.hpp"

namespace myccl::reducer {

namespace {

class SeamStreams final : public DeviceStreams {
 public:
  SeamStreams(std::shared_ptr<cuda::Device> dev, int index) : dev_(std::move(dev)), index_(index) {}
  cuda::Stream current() override { return dev_->currentStream(index_); }
  std::unique_ptr<cuda::Event> newEvent() override { return dev_->newEvent(/*timing=*/false); }
  int index() const override { return index_; }

 private:
  std::shared_ptr<cuda::Device> dev_;
  const int index_;
};

// c10::Event behind the seam's Event interface, so the Reducer has one code path.
class C10Event final : public cuda::Event {
 public:
  explicit C10Event(c10::DeviceType type) : ev_(type) {}
  void record(const cuda::Stream& s) override { ev_.record(s); }
  bool query() override { return ev_.query(); }
  void block(const cuda::Stream& s) override { ev_.block(s); }
  void synchronize() override { ev_.synchronize(); }
  float elapsedMs(cuda::Event& later) override {
    auto* other = dynamic_cast<C10Event*>(&later);
    MYCCL_CHECK(other != nullptr, "ddp: elapsedMs between events of different kinds");
    return static_cast<float>(ev_.elapsedTime(other->ev_));
  }

 private:
  c10::Event ev_;
};

class C10Streams final : public DeviceStreams {
 public:
  explicit C10Streams(c10::Device device) : device_(device), impl_(device.type()) {}
  cuda::Stream current() override { return impl_.getStream(device_); }
  std::unique_ptr<cuda::Event> newEvent() override { return std::make_unique<C10Event>(device_.type()); }
  int index() const override { return device_.index(); }

 private:
  const c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
};

}  // namespace

std::unique_ptr<DeviceStreams> seamStreams(std::shared_ptr<cuda::Device> device, const at::Tensor& sample) {
  const int index = device->deviceOf(sample).index();
  return std::make_unique<SeamStreams>(std::move(device), index);
}

std::unique_ptr<DeviceStreams> c10Streams(c10::Device device) {
  MYCCL_CHECK(device.has_index(), "ddp: parameters on ", device, " without a device index");
  return std::make_unique<C10Streams>(device);
}

}  // namespace myccl::reducer
