// The CUDA pieces of torch that the engine and its Work share: c10::cuda::CUDAEvent, included
// without the warning GCC 12+ raises inside it (std::hardware_destructive_interference_size in
// CUDAEventPool), and the capture check every torch release from 2.11 on can build.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <c10/cuda/CUDAEvent.h>
#pragma GCC diagnostic pop
#else
#include <c10/cuda/CUDAEvent.h>
#endif

#include <c10/cuda/CUDAException.h>

namespace myccl::cuda {

// Is `stream` being captured into a CUDA graph? (torch's captureStatusMayInitCtx(stream) is 2.12+.)
inline bool isCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace myccl::cuda
