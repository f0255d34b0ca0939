// The layout of a rank's shared-memory segment and the words the step protocol waits on:
// private to src/cpu/transport (Shm.cpp, ShmRegistry.cpp).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "myccl/cpu/transport/Shm.hpp"

namespace myccl::cpu {

inline constexpr uint32_t kCtrlMagic = 0x4d434353;  // "MCCS"
inline constexpr size_t kCtrlBytes = 4096;
inline constexpr int kSlots = 32;  // registered segments per rank

inline bool reached(uint32_t have, uint32_t want) {
  return static_cast<int32_t>(have - want) >= 0;
}

inline void futexWait(std::atomic<uint32_t>* addr, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{static_cast<time_t>(timeout.count() / 1000000000), static_cast<long>(timeout.count() % 1000000000)};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// The control block at the start of every rank's segment (then two staging buffers, then the
// mailbox's state words and slots).
struct alignas(64) ShmGroup::Ctrl {
  std::atomic<uint32_t> seq;      // last posted step; also the futex word
  std::atomic<uint32_t> waiters;  // processes sleeping on `seq`
  uint32_t magic;
  int32_t pid;
  uint64_t staging;      // geometry, checked by every peer that maps this segment
  uint64_t mailboxSlot;
  char pad0[32];
  StepDesc desc[4];        // desc[s % 4]: what this rank runs at step s (peers are <= 1 step apart)
  uint64_t scratch[2][4];  // per-step words peers read, by step parity
  // Registered memory: segments peers may map to read this rank's tensors in place.
  struct Slot {
    std::atomic<uint32_t> gen;       // changes whenever the slot is (re)used or freed
    std::atomic<uint32_t> live;
    uint64_t size;
    std::atomic<uint64_t> mappedBy;  // bit per local rank that mapped it; the last one unlinks
    char name[64];
  } slots[kSlots];
};


}  // namespace myccl::cpu
