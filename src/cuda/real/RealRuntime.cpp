// The real Runtime: every call forwards to torch's c10::cuda (streams, guards, the caching
// allocator), the CUDA runtime (events, capture status) or NCCL, one call for one call, so that
// what the engine does under the test double is exactly what it does on a GPU. Compiled only
// with NCCL; the only file of the engine that includes CUDA or NCCL headers.
#include "myccl/cuda/RealRuntime.hpp"

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
// std::hardware_destructive_interference_size in torch's CUDAEventPool
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <c10/cuda/CUDAEvent.h>
#pragma GCC diagnostic pop
#else
#include <c10/cuda/CUDAEvent.h>
#endif

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

namespace myccl::cuda {

namespace {

c10::cuda::CUDAStream cudaStream(const Stream& s) {
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, s);
}

class RealEvent final : public Event {
 public:
  explicit RealEvent(bool timing) : ev_(timing ? cudaEventDefault : cudaEventDisableTiming) {}
  void record(const Stream& s) override { ev_.record(cudaStream(s)); }
  bool query() override { return ev_.query(); }
  void block(const Stream& s) override { ev_.block(cudaStream(s)); }
  void synchronize() override { ev_.synchronize(); }
  float elapsedMs(Event& later) override { return ev_.elapsed_time(static_cast<RealEvent&>(later).ev_); }

 private:
  c10::cuda::CUDAEvent ev_;
};

class RealDevice final : public Device {
 public:
  int count() override { return c10::cuda::device_count(); }
  int current() override { return c10::cuda::current_device(); }
  void set(int index) override { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }
  void restore(int index) override { C10_CUDA_CHECK(c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(index))); }
  Stream currentStream(int index) override {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(index)).unwrap();
  }
  void setCurrentStream(const Stream& s) override { c10::cuda::setCurrentCUDAStream(cudaStream(s)); }
  Stream newStream(int index, bool highPriority) override {
    return c10::cuda::getStreamFromPool(highPriority, static_cast<c10::DeviceIndex>(index)).unwrap();
  }
  bool isCapturing(const Stream& s) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(cudaStream(s).stream(), &status));
    return status != cudaStreamCaptureStatusNone;
  }
  void relaxCaptureMode() override {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  }
  std::unique_ptr<Event> newEvent(bool timing) override { return std::make_unique<RealEvent>(timing); }
  void enqueue(const Stream& s, std::function<void()> f) override {
    c10::cuda::CUDAStreamGuard guard(cudaStream(s));
    f();
  }
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Stream& s) override {
    c10::cuda::CUDAStreamGuard guard(cudaStream(s));
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(s.device()));
  }
  void recordStream(const at::Tensor& t, const Stream& s) override {
    if (!t.is_cuda()) return;
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), cudaStream(s));
  }
  c10::Device deviceOf(const at::Tensor& t) override { return t.device(); }
  bool streamOrdered() override { return true; }
  at::TensorOptions tensorOptions(int index) override {
    return at::TensorOptions().device(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)));
  }
  int computeCapability(int index) override {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index));
    return major * 10 + minor;
  }
};

// Runtime.hpp numbers everything as NCCL does; these only change the type.
ncclComm_t C(NcclCommHandle c) { return reinterpret_cast<ncclComm_t>(c); }
NcclResult R(ncclResult_t r) { return static_cast<NcclResult>(r); }
ncclDataType_t T(NcclType t) { return static_cast<ncclDataType_t>(t); }
ncclRedOp_t O(NcclRedOp o) { return static_cast<ncclRedOp_t>(o); }
cudaStream_t S(const Stream& s) { return cudaStream(s).stream(); }

static_assert(sizeof(NcclUniqueId) == sizeof(ncclUniqueId), "NcclUniqueId must be ncclUniqueId's size");
static_assert(static_cast<int>(ncclInProgress) == static_cast<int>(NcclResult::InProgress));
static_assert(static_cast<int>(ncclBfloat16) == static_cast<int>(NcclType::BFloat16));
static_assert(static_cast<int>(ncclAvg) == kNcclAvg);
static_assert(static_cast<int>(ncclScalarHostImmediate) == static_cast<int>(ScalarResidence::HostImmediate));

class RealNccl final : public Nccl {
 public:
  int version() override {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
  }
  NcclResult getUniqueId(NcclUniqueId* id) override { return R(ncclGetUniqueId(reinterpret_cast<ncclUniqueId*>(id))); }
  NcclResult commInitRank(NcclCommHandle* comm, int nranks, const NcclUniqueId& id, int rank,
                          const NcclCommConfig& config) override {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = config.blocking ? 1 : 0;
    c.commName = config.name;
    ncclUniqueId nid;
    std::memcpy(&nid, &id, sizeof nid);
    ncclComm_t out = nullptr;
    NcclResult r = R(ncclCommInitRankConfig(&out, nranks, nid, rank, &c));
    *comm = reinterpret_cast<NcclCommHandle>(out);
    return r;
  }
  NcclResult commSplit(NcclCommHandle comm, int color, int key, NcclCommHandle* newcomm,
                       const NcclCommConfig& config) override {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    c.blocking = config.blocking ? 1 : 0;
    c.commName = config.name;
    ncclComm_t out = nullptr;
    NcclResult r = R(ncclCommSplit(C(comm), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &out, &c));
    *newcomm = reinterpret_cast<NcclCommHandle>(out);
    return r;
  }
  NcclResult commGetAsyncError(NcclCommHandle comm, NcclResult* asyncError) override {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(C(comm), &st);
    *asyncError = R(st);
    return R(r);
  }
  NcclResult commCount(NcclCommHandle comm, int* count) override { return R(ncclCommCount(C(comm), count)); }
  NcclResult commFinalize(NcclCommHandle comm) override { return R(ncclCommFinalize(C(comm))); }
  NcclResult commDestroy(NcclCommHandle comm) override { return R(ncclCommDestroy(C(comm))); }
  NcclResult commAbort(NcclCommHandle comm) override { return R(ncclCommAbort(C(comm))); }
  const char* errorString(NcclResult r) override { return ncclGetErrorString(static_cast<ncclResult_t>(r)); }
  const char* lastError(NcclCommHandle comm) override { return ncclGetLastError(C(comm)); }
  NcclResult groupStart() override { return R(ncclGroupStart()); }
  NcclResult groupEnd() override { return R(ncclGroupEnd()); }
  NcclResult redOpCreatePreMulSum(NcclRedOp* op, void* scalar, NcclType type, ScalarResidence residence,
                                  NcclCommHandle comm) override {
    ncclRedOp_t out{};
    NcclResult r = R(ncclRedOpCreatePreMulSum(&out, scalar, T(type), static_cast<ncclScalarResidence_t>(residence),
                                              C(comm)));
    *op = static_cast<NcclRedOp>(out);
    return r;
  }
  NcclResult redOpDestroy(NcclRedOp op, NcclCommHandle comm) override { return R(ncclRedOpDestroy(O(op), C(comm))); }
  NcclResult allReduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op,
                       NcclCommHandle comm, const Stream& stream) override {
    return R(ncclAllReduce(sendbuff, recvbuff, count, T(type), O(op), C(comm), S(stream)));
  }
  NcclResult broadcast(const void* sendbuff, void* recvbuff, size_t count, NcclType type, int root,
                       NcclCommHandle comm, const Stream& stream) override {
    return R(ncclBroadcast(sendbuff, recvbuff, count, T(type), root, C(comm), S(stream)));
  }
  NcclResult reduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op, int root,
                    NcclCommHandle comm, const Stream& stream) override {
    return R(ncclReduce(sendbuff, recvbuff, count, T(type), O(op), root, C(comm), S(stream)));
  }
  NcclResult allGather(const void* sendbuff, void* recvbuff, size_t sendcount, NcclType type, NcclCommHandle comm,
                       const Stream& stream) override {
    return R(ncclAllGather(sendbuff, recvbuff, sendcount, T(type), C(comm), S(stream)));
  }
  NcclResult reduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, NcclType type, NcclRedOp op,
                           NcclCommHandle comm, const Stream& stream) override {
    return R(ncclReduceScatter(sendbuff, recvbuff, recvcount, T(type), O(op), C(comm), S(stream)));
  }
  NcclResult send(const void* sendbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                  const Stream& stream) override {
    return R(ncclSend(sendbuff, count, T(type), peer, C(comm), S(stream)));
  }
  NcclResult recv(void* recvbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                  const Stream& stream) override {
    return R(ncclRecv(recvbuff, count, T(type), peer, C(comm), S(stream)));
  }
};

}  // namespace

Runtime realRuntime() {
  static const Runtime rt{std::make_shared<RealDevice>(), std::make_shared<RealNccl>(), "cuda"};
  return rt;
}

}  // namespace myccl::cuda
