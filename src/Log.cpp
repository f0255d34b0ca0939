// The log queue and its thread.
#include <pthread.h>
#include "myccl/Log.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

namespace myccl {

namespace {

struct Logger {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<int, std::string>> queue;
  std::function<void(int, const std::string&)> sink;
  bool inSink = false;
  std::condition_variable idle;
  bool started = false;
  std::set<std::string> once;
  std::atomic<int> level{static_cast<int>(LogLevel::Warning)};

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return !queue.empty() && sink; });
      auto item = std::move(queue.front());
      queue.pop_front();
      auto fn = sink;
      inSink = true;
      lk.unlock();
      try {
        fn(item.first, item.second);
      } catch (...) {
        // A broken sink must never take the process down.
      }
      lk.lock();
      inSink = false;
      idle.notify_all();
    }
  }
};

Logger& logger() {
  static Logger* l = new Logger();  // never destroyed: logging may happen during exit
  return *l;
}

}  // namespace

bool logEnabled(LogLevel level) {
  return static_cast<int>(level) >= logger().level.load(std::memory_order_relaxed);
}

void setLogLevel(LogLevel level) {
  logger().level.store(static_cast<int>(level));
}

void log(LogLevel level, const std::string& msg) {
  if (!logEnabled(level)) return;
  Logger& l = logger();
  std::lock_guard<std::mutex> lk(l.mu);
  if (!l.sink) {
    fprintf(stderr, "[myccl %s] %s\n", level >= LogLevel::Error ? "error" : level >= LogLevel::Warning ? "warning" : "info",
            msg.c_str());
    return;
  }
  l.queue.emplace_back(static_cast<int>(level), msg);
  l.cv.notify_one();
}

void logOnce(const std::string& key, LogLevel level, const std::string& msg) {
  {
    Logger& l = logger();
    std::lock_guard<std::mutex> lk(l.mu);
    if (!l.once.insert(key).second) return;
  }
  log(level, msg);
}

void setLogSink(std::function<void(int, const std::string&)> sink) {
  Logger& l = logger();
  std::function<void(int, const std::string&)> old;
  {
    std::unique_lock<std::mutex> lk(l.mu);
    if (!sink) l.idle.wait(lk, [&] { return !l.inSink; });
    old.swap(l.sink);
    l.sink = std::move(sink);
    if (l.sink && !l.started) {
      l.started = true;
      std::thread([&l] {
        pthread_setname_np(pthread_self(), "myccl-log");
        l.run();
      }).detach();
    }
    l.cv.notify_all();
  }
  // `old` is destroyed here, by the caller (which holds the GIL if it is a Python function).
}

}  // namespace myccl
