// The real Memory (cuda/Memory.hpp): CUDA's virtual memory management from the driver, loaded
// with dlopen (torch links the runtime, not the driver API, and its own driver wrapper differs
// between torch releases), and host registration from the runtime. One call for one call.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "myccl/cuda/RealRuntime.hpp"

namespace myccl::cuda {

namespace {

#define MYCCL_STR2(x) #x
#define MYCCL_STR(x) MYCCL_STR2(x)  // the name after cuda.h's macros (some calls are _v2)

// The driver calls used, as (member, name): the struct's members and their loading come from it.
#define MYCCL_DRIVER_CALLS(X)                                   \
  X(getErrorString, cuGetErrorString)                           \
  X(deviceGet, cuDeviceGet)                                     \
  X(deviceGetAttribute, cuDeviceGetAttribute)                   \
  X(granularity, cuMemGetAllocationGranularity)                 \
  X(create, cuMemCreate)                                        \
  X(exportHandle, cuMemExportToShareableHandle)                 \
  X(importHandle, cuMemImportFromShareableHandle)               \
  X(release, cuMemRelease)                                      \
  X(reserve, cuMemAddressReserve)                               \
  X(unreserve, cuMemAddressFree)                                \
  X(map, cuMemMap)                                              \
  X(unmap, cuMemUnmap)                                          \
  X(setAccess, cuMemSetAccess)

struct Driver {
#define MYCCL_DECLARE(member, fn) decltype(&::fn) member = nullptr;
  MYCCL_DRIVER_CALLS(MYCCL_DECLARE)
#undef MYCCL_DECLARE
  std::string missing;  // why the driver could not be used, "" when it can
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d.missing = std::string("the CUDA driver (libcuda.so.1) could not be loaded: ") + dlerror();
      return d;
    }
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && d.missing.empty()) d.missing = std::string("the CUDA driver has no ") + name;
    };
#define MYCCL_LOAD(member, fn) load(d.member, MYCCL_STR(fn));
    MYCCL_DRIVER_CALLS(MYCCL_LOAD)
#undef MYCCL_LOAD
    return d;
  }();
  return d;
}

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().getErrorString) driver().getErrorString(r, &text);
  TORCH_CHECK(false, "myccl: ", call, " failed: ", text ? text : "unknown error", " (CUresult ", static_cast<int>(r), ")");
}

const Driver& ready() {
  const Driver& d = driver();
  TORCH_CHECK(d.missing.empty(), "myccl: shared device memory: ", d.missing);
  return d;
}

// The driver calls need a current context: the current device's primary one, as torch makes it
// (the caller made the right device current: Memory::useDevice).
void needContext() {
  C10_CUDA_CHECK(cudaFree(nullptr));
}

CUmemAllocationProp props(int device) {
  CUmemAllocationProp p = {};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

class RealMemory final : public Memory {
 public:
  std::string kind() override { return "cuda"; }
  int currentDevice() override { return c10::cuda::current_device(); }

  std::function<void()> useDevice(int device) override {
    const auto previous = c10::cuda::current_device();
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
    needContext();
    return [previous, device] {
      // as torch's device guards put a device back: no context made where there was none
      if (previous != device) C10_CUDA_CHECK_WARN(c10::cuda::MaybeSetDevice(previous));
    };
  }

  bool shareable(int device, std::string* why) override {
    const Driver& d = driver();
    if (!d.missing.empty()) {
      *why = d.missing;
      return false;
    }
    needContext();
    CUdevice dev = 0;
    check(d.deviceGet(&dev, device), "cuDeviceGet");
    int vmm = 0, fd = 0;
    check(d.deviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
          "cuDeviceGetAttribute");
    check(d.deviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev),
          "cuDeviceGetAttribute");
    if (!vmm) *why = "the device does not support virtual memory management";
    else if (!fd) *why = "the device cannot export memory as a POSIX file descriptor";
    return vmm && fd;
  }

  size_t granularity(int device) override {
    const Driver& d = ready();
    needContext();
    CUmemAllocationProp p = props(device);
    size_t g = 0;
    check(d.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity");
    return g;
  }

  MemHandle create(int device, size_t bytes) override {
    const Driver& d = ready();
    needContext();
    CUmemAllocationProp p = props(device);
    CUmemGenericAllocationHandle h = 0;
    check(d.create(&h, bytes, &p, 0), "cuMemCreate");
    return static_cast<MemHandle>(h);
  }

  int exportFd(MemHandle h) override {
    int fd = -1;
    check(ready().exportHandle(&fd, static_cast<CUmemGenericAllocationHandle>(h), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                               0),
          "cuMemExportToShareableHandle");
    return fd;
  }

  MemHandle importFd(int fd) override {
    CUmemGenericAllocationHandle h = 0;
    check(ready().importHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    return static_cast<MemHandle>(h);
  }

  void release(MemHandle h) override {
    check(ready().release(static_cast<CUmemGenericAllocationHandle>(h)), "cuMemRelease");
  }

  uintptr_t reserve(size_t bytes) override {
    CUdeviceptr va = 0;
    check(ready().reserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve");
    return static_cast<uintptr_t>(va);
  }

  void unreserve(uintptr_t va, size_t bytes) override {
    check(ready().unreserve(static_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree");
  }

  void map(uintptr_t va, size_t bytes, MemHandle h) override {
    check(ready().map(static_cast<CUdeviceptr>(va), bytes, 0, static_cast<CUmemGenericAllocationHandle>(h), 0),
          "cuMemMap");
  }

  void setAccess(uintptr_t va, size_t bytes, int device) override {
    CUmemAccessDesc a = {};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = device;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check(ready().setAccess(static_cast<CUdeviceptr>(va), bytes, &a, 1), "cuMemSetAccess");
  }

  void unmap(uintptr_t va, size_t bytes) override {
    check(ready().unmap(static_cast<CUdeviceptr>(va), bytes), "cuMemUnmap");
  }

  void zero(uintptr_t va, size_t bytes, int device) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<void*>(va), 0, bytes, stream.stream()));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream.stream()));
  }

  void synchronize(int device) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void* hostRegister(void* p, size_t bytes) override {
    C10_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    void* dp = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&dp, p, 0));
    return dp;
  }

  void hostUnregister(void* p) override { C10_CUDA_CHECK(cudaHostUnregister(p)); }

  at::Tensor tensorAt(void* p, at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype, int device,
                      std::function<void()> onFree) override {
    const c10::Device dev(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    return at::from_blob(
        p, sizes, strides, [onFree = std::move(onFree)](void*) mutable { onFree(); },
        at::TensorOptions().dtype(dtype).device(dev), dev);
  }
};

}  // namespace

std::shared_ptr<Memory> realMemory() {
  static const auto m = std::make_shared<RealMemory>();
  return m;
}

}  // namespace myccl::cuda
