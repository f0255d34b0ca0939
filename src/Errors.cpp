// The errors Python sees as torch.distributed.DistBackendError (Errors.hpp).
#include "myccl/Errors.hpp"

namespace myccl {

std::exception_ptr makeDistError(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

void throwDistError(const std::string& msg) {
  C10_THROW_ERROR(DistBackendError, msg);
}

}  // namespace myccl
