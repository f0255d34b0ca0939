// The seam between the CUDA engine's logic and the machine: the CUDA device (streams, events,
// the current device, capture status, the allocator) and NCCL, behind two thin interfaces. The
// engine (src/cuda) includes no CUDA or NCCL header and compiles in every build; the real
// implementations (src/cuda/real, only with NCCL) forward each call to the CUDA runtime / torch /
// NCCL one to one, and tests swap in a strict host double (src/cuda/double) that runs the same
// logic without a GPU. Both interfaces keep NCCL's and CUDA's own semantics; where a comment
// says what a call must do, both implementations do exactly that.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace myccl::cuda {

// A CUDA stream: device + id (a c10::cuda::CUDAStream packed; the double numbers its own).
using Stream = c10::Stream;

// ---- device ------------------------------------------------------------------------------

class Event {
 public:
  virtual ~Event() = default;
  // Captures everything enqueued on `s` so far (cudaEventRecord).
  virtual void record(const Stream& s) = 0;
  // Whether the recorded point has been passed; true for an event never recorded
  // (cudaEventQuery). Throws c10::Error on a device error.
  virtual bool query() = 0;
  // Everything enqueued on `s` from now on runs after the recorded point (cudaStreamWaitEvent);
  // never blocks the host. A no-op for an event never recorded.
  virtual void block(const Stream& s) = 0;
  // Blocks the calling thread until the recorded point has been passed (cudaEventSynchronize).
  virtual void synchronize() = 0;
  // Milliseconds from this event to `later`, both recorded and passed, both made with
  // timing=true (cudaEventElapsedTime).
  virtual float elapsedMs(Event& later) = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual int count() = 0;
  // The calling thread's device (cudaGetDevice / cudaSetDevice). Every other call that touches
  // the device (streams, events, capture status, allocation) must come from a thread that has
  // selected one; a thread the engine creates selects it before its first such call.
  virtual int current() = 0;
  virtual void set(int index) = 0;
  // Back to the device a thread had before a scope that set another. Like torch's guards it
  // makes no context on a device that has none yet (CUDA: MaybeSetDevice; the double: set).
  virtual void restore(int index) = 0;

  // The calling thread's current stream on `index` (torch's getCurrentCUDAStream) and setting
  // it (setCurrentCUDAStream). A new stream comes from torch's pool.
  virtual Stream currentStream(int index) = 0;
  virtual void setCurrentStream(const Stream& s) = 0;
  virtual Stream newStream(int index, bool highPriority) = 0;

  // Is `s` being captured into a CUDA graph? While it is, nothing may query an event or block
  // the host on work captured into it.
  virtual bool isCapturing(const Stream& s) = 0;
  // The calling thread's capture mode becomes relaxed: its event queries do not invalidate a
  // global-mode capture that another thread runs (cudaThreadExchangeStreamCaptureMode).
  virtual void relaxCaptureMode() = 0;

  virtual std::unique_ptr<Event> newEvent(bool timing = false) = 0;

  // Runs `f`, whose tensor operations must land on `s` in order after everything enqueued on
  // `s` so far: for CUDA, `f` runs now with `s` as the current stream and only enqueues kernels;
  // the double runs it on the stream's worker. `f` must not block the host on the device.
  virtual void enqueue(const Stream& s, std::function<void()> f) = 0;
  // A tensor for staging on `s`: its memory may be reused once `s` has passed everything
  // enqueued on `s` before the tensor was dropped (the caching allocator's rule). Used on any
  // other stream, it must be recordStream'ed there.
  virtual at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype, const Stream& s) = 0;
  // The memory of `t` stays reserved until `s` has passed what is enqueued on it now
  // (CUDACachingAllocator::recordStream).
  virtual void recordStream(const at::Tensor& t, const Stream& s) = 0;

  // The device a tensor given to the engine lives on (a CUDA tensor's own; the double's tensors
  // are CPU tensors on the calling thread's current device).
  virtual c10::Device deviceOf(const at::Tensor& t) = 0;
  // CUDA: a Work's Future is CUDA-aware (completed once the op is enqueued; consumers are
  // stream-ordered after it) and a stream-ordered wait() is enough for the caller to see the
  // results. The double's callers read results on the host, so there the Future completes
  // when the op has finished and wait() blocks the host.
  virtual bool streamOrdered() = 0;
  // Options for a tensor the engine itself allocates on `index` (barrier token, premul factor).
  virtual at::TensorOptions tensorOptions(int index) = 0;
  // The device's compute capability as major * 10 + minor (90 for 9.0); makes no context.
  virtual int computeCapability(int index) = 0;
};

// ---- NCCL ----------------------------------------------------------------------------------

// NCCL's result codes, element types and reduction operators, with NCCL's own numbering.
enum class NcclResult : int {
  Success = 0,
  UnhandledCudaError = 1,
  SystemError = 2,
  InternalError = 3,
  InvalidArgument = 4,
  InvalidUsage = 5,
  RemoteError = 6,
  InProgress = 7,
};
enum class NcclType : int {
  Int8 = 0,
  Uint8 = 1,
  Int32 = 2,
  Uint32 = 3,
  Int64 = 4,
  Uint64 = 5,
  Float16 = 6,
  Float32 = 7,
  Float64 = 8,
  BFloat16 = 9,
  Float8e4m3 = 10,
  Float8e5m2 = 11,
};
// The torch dtype of an NCCL element type, and its size.
at::ScalarType scalarTypeOf(NcclType t);
size_t ncclTypeSize(NcclType t);
const char* ncclTypeName(NcclType t);
const char* ncclResultName(NcclResult r);
// "2.28.3" from NCCL's version code (major*10000 + minor*100 + patch since 2.9).
std::string ncclVersionString(int code);

// ncclRedOp_t: 0 sum, 1 prod, 2 max, 3 min, 4 avg; operators made by redOpCreatePreMulSum
// have other values.
using NcclRedOp = int;
constexpr NcclRedOp kNcclSum = 0, kNcclProd = 1, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4;

enum class ScalarResidence : int { Device = 0, HostImmediate = 1 };

struct NcclUniqueId {
  char internal[128];
};

struct NcclCommObject;                    // opaque
using NcclCommHandle = NcclCommObject*;   // ncclComm_t

struct NcclCommConfig {
  bool blocking = true;       // false: calls may return InProgress; poll commGetAsyncError
  const char* name = nullptr; // must outlive the communicator
};

// NCCL's API, one call for one call. Calls on one communicator must not overlap in time
// (NCCL communicators are not thread-safe); ncclGroupStart/End nest per thread; collectives and
// send/recv between groupStart and groupEnd are launched at the outermost groupEnd.
class Nccl {
 public:
  virtual ~Nccl() = default;

  virtual int version() = 0;  // ncclGetVersion
  virtual NcclResult getUniqueId(NcclUniqueId* id) = 0;
  // Collective over `nranks` processes that pass the same id; blocking: returns when all
  // have joined (nonblocking: returns InProgress, poll commGetAsyncError until Success).
  virtual NcclResult commInitRank(NcclCommHandle* comm, int nranks, const NcclUniqueId& id, int rank,
                                  const NcclCommConfig& config) = 0;
  // Collective over the parent's ranks (ncclCommSplit); color -1 (NCCL_SPLIT_NOCOLOR) leaves
  // *newcomm null.
  virtual NcclResult commSplit(NcclCommHandle comm, int color, int key, NcclCommHandle* newcomm,
                               const NcclCommConfig& config) = 0;
  // *asyncError: Success, InProgress (a nonblocking call still running) or the error.
  virtual NcclResult commGetAsyncError(NcclCommHandle comm, NcclResult* asyncError) = 0;
  // ncclCommCount: the ranks of a communicator that is ready (an error while it is not).
  virtual NcclResult commCount(NcclCommHandle comm, int* count) = 0;
  virtual NcclResult commFinalize(NcclCommHandle comm) = 0;
  virtual NcclResult commDestroy(NcclCommHandle comm) = 0;
  // May be called from another thread while a call on `comm` is stuck; stops its kernels.
  virtual NcclResult commAbort(NcclCommHandle comm) = 0;
  virtual const char* errorString(NcclResult r) = 0;
  virtual const char* lastError(NcclCommHandle comm) = 0;  // comm may be null

  virtual NcclResult groupStart() = 0;
  virtual NcclResult groupEnd() = 0;

  // `scalar` points to host memory read now (HostImmediate) or device memory read when the op
  // runs (Device), in type `type`.
  virtual NcclResult redOpCreatePreMulSum(NcclRedOp* op, void* scalar, NcclType type, ScalarResidence residence,
                                          NcclCommHandle comm) = 0;
  virtual NcclResult redOpDestroy(NcclRedOp op, NcclCommHandle comm) = 0;

  virtual NcclResult allReduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op,
                               NcclCommHandle comm, const Stream& stream) = 0;
  virtual NcclResult broadcast(const void* sendbuff, void* recvbuff, size_t count, NcclType type, int root,
                               NcclCommHandle comm, const Stream& stream) = 0;
  virtual NcclResult reduce(const void* sendbuff, void* recvbuff, size_t count, NcclType type, NcclRedOp op, int root,
                            NcclCommHandle comm, const Stream& stream) = 0;
  virtual NcclResult allGather(const void* sendbuff, void* recvbuff, size_t sendcount, NcclType type,
                               NcclCommHandle comm, const Stream& stream) = 0;
  virtual NcclResult reduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, NcclType type,
                                   NcclRedOp op, NcclCommHandle comm, const Stream& stream) = 0;
  virtual NcclResult send(const void* sendbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                          const Stream& stream) = 0;
  virtual NcclResult recv(void* recvbuff, size_t count, NcclType type, int peer, NcclCommHandle comm,
                          const Stream& stream) = 0;
};

// What one engine runs on.
struct Runtime {
  std::shared_ptr<Device> device;
  std::shared_ptr<Nccl> nccl;
  std::string kind;  // "cuda" or "double"
};

}  // namespace myccl::cuda
