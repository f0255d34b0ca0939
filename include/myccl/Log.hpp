// Logging from C++ without touching Python on the hot path: messages go to a queue that one
// thread hands to Python's logging ("c10d_ext" logger) or, before Python registered a sink,
// to stderr. Never called with a transport or engine lock held; logOnce() for warnings that
// would otherwise repeat per op.
#pragma once

#include <functional>
#include <string>

namespace myccl {

enum class LogLevel : int { Debug = 10, Info = 20, Warning = 30, Error = 40 };

void log(LogLevel level, const std::string& msg);
// Logs only the first message for each key (per process).
void logOnce(const std::string& key, LogLevel level, const std::string& msg);
void setLogLevel(LogLevel level);
bool logEnabled(LogLevel level);
// The sink runs on the logger thread. An empty function removes it (and waits until the
// logger thread is no longer inside it).
void setLogSink(std::function<void(int level, const std::string& msg)> sink);

}  // namespace myccl
