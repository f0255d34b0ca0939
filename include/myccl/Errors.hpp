// How myccl reports failures. Bad arguments are raised at once on the calling thread
// (MYCCL_CHECK_ARG -> Python ValueError naming op, rank and value). Communication failures
// are CommError inside the engines and surface as torch.distributed.DistBackendError.
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

namespace myccl {

enum class CommErrorKind { Timeout, PeerGone, Protocol, Aborted, Local };

class CommError : public std::runtime_error {
 public:
  CommError(CommErrorKind kind, const std::string& msg, int peer = -1)
      : std::runtime_error(msg), kind_(kind), peer_(peer) {}
  CommErrorKind kind() const { return kind_; }
  int peer() const { return peer_; }

 private:
  CommErrorKind kind_;
  int peer_;
};

// Builds an exception_ptr that Python sees as torch.distributed.DistBackendError.
std::exception_ptr makeDistError(const std::string& msg);
[[noreturn]] void throwDistError(const std::string& msg);

}  // namespace myccl

// Argument errors: ValueError in Python. Message convention: "myccl: <op> (rank R): <what>".
#define MYCCL_CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, "myccl: ", __VA_ARGS__)
// Other local errors (unsupported combinations, state errors): RuntimeError in Python.
#define MYCCL_CHECK(cond, ...) TORCH_CHECK(cond, "myccl: ", __VA_ARGS__)
