// torch's c10::cuda::CUDAEvent, included without the warning GCC 12+ raises inside it
// (std::hardware_destructive_interference_size in CUDAEventPool): our builds stay warning-free.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#include <c10/cuda/CUDAEvent.h>
#pragma GCC diagnostic pop
#else
#include <c10/cuda/CUDAEvent.h>
#endif
