// How myccl reports failures. Bad arguments are raised at once on the calling thread
// (MYCCL_CHECK_ARG -> Python ValueError naming op, rank and value). Communication failures
// are CommError inside the engines and surface as torch.distributed.DistBackendError.
#pragma once

#include <c10/util/Exception.h>

#include <concepts>
#include <ostream>
#include <stdexcept>
#include <string>

namespace myccl {

// "<op> (rank R)", the start of every argument error, kept as its parts and formatted only when
// an error is raised: checks on every op's path cost no string.
struct Where {
  const char* op;
  int rank;
  std::string str() const { return std::string(op) + " (rank " + std::to_string(rank) + ")"; }
};

// A text made only when needed (Where, Described in OpInfo.hpp) prints and joins with strings as
// the string it stands for.
template <class T>
concept LazyText = requires(const T& t) {
  { t.str() } -> std::same_as<std::string>;
};
template <LazyText T>
std::ostream& operator<<(std::ostream& os, const T& t) {
  return os << t.str();
}
template <LazyText T>
std::string operator+(const std::string& a, const T& t) {
  return a + t.str();
}
template <LazyText T>
std::string operator+(const T& t, const std::string& b) {
  return t.str() + b;
}
template <LazyText T>
std::string operator+(const T& t, const char* b) {
  return t.str() + b;
}

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
