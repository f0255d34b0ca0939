// An exception's text without c10's backtrace, for the CUDA engine's messages (private to src/cuda).
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace myccl::cuda {

inline std::string errorText(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

}  // namespace myccl::cuda
