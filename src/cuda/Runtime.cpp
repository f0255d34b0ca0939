// Names and sizes of NCCL's vocabulary as Runtime.hpp numbers it (for messages and the double).
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda {

size_t ncclTypeSize(NcclType t) {
  switch (t) {
    case NcclType::Int8:
    case NcclType::Uint8:
    case NcclType::Float8e4m3:
    case NcclType::Float8e5m2: return 1;
    case NcclType::Float16:
    case NcclType::BFloat16: return 2;
    case NcclType::Int32:
    case NcclType::Uint32:
    case NcclType::Float32: return 4;
    case NcclType::Int64:
    case NcclType::Uint64:
    case NcclType::Float64: return 8;
  }
  return 1;
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
