// Names and sizes of NCCL's vocabulary as Runtime.hpp numbers it (for messages and the double).
#include "myccl/cuda/Runtime.hpp"

#include <c10/core/ScalarType.h>

namespace myccl::cuda {

at::ScalarType scalarTypeOf(NcclType type) {
  switch (type) {
    case NcclType::Int8: return at::kChar;
    case NcclType::Uint8: return at::kByte;
    case NcclType::Int32: return at::kInt;
    case NcclType::Uint32: return at::kUInt32;
    case NcclType::Int64: return at::kLong;
    case NcclType::Uint64: return at::kUInt64;
    case NcclType::Float16: return at::kHalf;
    case NcclType::Float32: return at::kFloat;
    case NcclType::Float64: return at::kDouble;
    case NcclType::BFloat16: return at::kBFloat16;
    case NcclType::Float8e4m3: return at::kFloat8_e4m3fn;
    case NcclType::Float8e5m2: return at::kFloat8_e5m2;
  }
  return at::kByte;
}

size_t ncclTypeSize(NcclType t) {
  return c10::elementSize(scalarTypeOf(t));
}

const char* ncclTypeName(NcclType t) {
  switch (t) {
    case NcclType::Int8: return "int8";
    case NcclType::Uint8: return "uint8";
    case NcclType::Int32: return "int32";
    case NcclType::Uint32: return "uint32";
    case NcclType::Int64: return "int64";
    case NcclType::Uint64: return "uint64";
    case NcclType::Float16: return "float16";
    case NcclType::Float32: return "float32";
    case NcclType::Float64: return "float64";
    case NcclType::BFloat16: return "bfloat16";
    case NcclType::Float8e4m3: return "float8_e4m3";
    case NcclType::Float8e5m2: return "float8_e5m2";
  }
  return "?";
}

const char* ncclResultName(NcclResult r) {
  switch (r) {
    case NcclResult::Success: return "ncclSuccess";
    case NcclResult::UnhandledCudaError: return "ncclUnhandledCudaError";
    case NcclResult::SystemError: return "ncclSystemError";
    case NcclResult::InternalError: return "ncclInternalError";
    case NcclResult::InvalidArgument: return "ncclInvalidArgument";
    case NcclResult::InvalidUsage: return "ncclInvalidUsage";
    case NcclResult::RemoteError: return "ncclRemoteError";
    case NcclResult::InProgress: return "ncclInProgress";
  }
  return "ncclResult";
}

std::string ncclVersionString(int v) {
  if (v <= 0) return "unknown";
  // NCCL_VERSION_CODE is major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch before.
  int major, minor;
  if (v >= 10000) {
    major = v / 10000;
    minor = (v % 10000) / 100;
  } else {
    major = v / 1000;
    minor = (v % 1000) / 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(v % 100);
}

}  // namespace myccl::cuda
