// EXPECT(cond, message << parts): the C++ unit tests' check, which throws with file, line, the
// condition and the message, so a test function fails by name in its binary's runner.
#pragma once

#include <sstream>
#include <stdexcept>

#define EXPECT(cond, ...)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::ostringstream os_;                                                              \
      os_ << __FILE__ << ":" << __LINE__ << ": EXPECT(" #cond ") failed: " << __VA_ARGS__; \
      throw std::runtime_error(os_.str());                                                 \
    }                                                                                      \
  } while (0)
