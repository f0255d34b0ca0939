// Shared-memory segments: created mode 0600 under names that carry the creator's pid and pid
// namespace, mapped, unlinked once every peer mapped them; and the sweep that removes what
// crashed processes of this namespace left in /dev/shm.
#include "myccl/cpu/transport/Shm.hpp"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "myccl/Log.hpp"
#include "myccl/cpu/transport/Net.hpp"

namespace myccl::cpu {

namespace {

// This process's pid namespace, in hex ("0" where it cannot be told): a pid in a segment's name
// means something only within it (containers may share /dev/shm and not their pids).
const std::string& pidNamespaceTag() {
  static const std::string tag = [] {
    struct stat st {};
    if (::stat("/proc/self/ns/pid", &st) != 0) return std::string("0");
    char buf[32];
    snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(st.st_ino));
    return std::string(buf);
  }();
  return tag;
}

// Whether `pid` is a process that still runs: not one that is gone, nor a zombie (dead, its exit
// status not yet collected by its parent).
bool processExists(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return true;  // cannot tell: keep its names
  char buf[512];
  const size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char* close = strrchr(buf, ')');  // "pid (comm) S ...": comm may hold spaces and ')'
  return !(close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X'));
}

}  // namespace

void ShmSegment::sweepStale() {
  // Names are "myccl-<pid>-<pid namespace>-<random>". A process killed while its name was still
  // in /dev/shm (during a group's setup, or with registered memory no peer has mapped yet) leaves
  // it behind, holding memory until reboot: remove those of processes of our pid namespace that
  // no longer exist. Live ones, other namespaces' and unreadable names are left alone.
  const std::string& ns = pidNamespaceTag();
  if (ns == "0") return;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind("myccl-", 0) != 0) continue;
    const size_t a = n.find('-', 6), b = a == std::string::npos ? a : n.find('-', a + 1);
    if (b == std::string::npos || n.compare(a + 1, b - a - 1, ns) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(n.c_str() + 6, &end, 10);
    if (end != n.c_str() + a || pid <= 0) continue;
    if (!processExists(static_cast<pid_t>(pid))) shm_unlink(("/" + n).c_str());
  }
  closedir(d);
}

std::unique_ptr<ShmSegment> ShmSegment::create(size_t size, size_t commitBytes) {
  commitBytes = std::min(commitBytes, size);
  for (int attempt = 0; attempt < 8; ++attempt) {
    // The creator's pid (in its namespace) tells a leaked segment's owner (sweepStale); the random
    // part makes it unguessable.
    std::string name = "/myccl-" + std::to_string(getpid()) + "-" + pidNamespaceTag() + "-" + randomHex(12);
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    MYCCL_CHECK(fd >= 0, "shared memory: shm_open(", name, ") failed: ", strerror(errno),
                " (set MYCCL_TRANSPORT=tcp to run without shared memory)");
    fchmod(fd, 0600);  // exactly owner-only, whatever the umask
    int err = 0;
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) err = errno;
    // Real pages now: a full /dev/shm must fail here, not as SIGBUS on first touch.
    if (!err && commitBytes > 0) err = posix_fallocate(fd, 0, static_cast<off_t>(commitBytes));
    void* base = err ? MAP_FAILED : mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!err && base == MAP_FAILED) err = errno;
    if (err || commitBytes == size) ::close(fd), fd = -1;
    if (err) {
      shm_unlink(name.c_str());
      MYCCL_CHECK(false, "shared memory: cannot allocate ", commitBytes, " bytes in /dev/shm: ", strerror(err),
                  " (free space in /dev/shm, lower MYCCL_SHM_BUFFER_BYTES, or set MYCCL_TRANSPORT=tcp)");
    }
    return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, size, true, fd));
  }
  MYCCL_CHECK(false, "shared memory: could not find a free segment name");
}

std::unique_ptr<ShmSegment> ShmSegment::open(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  MYCCL_CHECK(fd >= 0, "shared memory: cannot open a peer's segment ", name, ": ", strerror(errno));
  struct stat st {};
  fstat(fd, &st);
  if (static_cast<size_t>(st.st_size) < size) {
    ::close(fd);
    MYCCL_CHECK(false, "shared memory: peer segment ", name, " has ", st.st_size, " bytes, expected ", size);
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  MYCCL_CHECK(base != MAP_FAILED, "shared memory: mmap of ", name, " failed: ", strerror(err));
  return std::unique_ptr<ShmSegment>(new ShmSegment(name, base, size, false));
}

bool ShmSegment::commit(size_t offset, size_t len) {
  if (fd_ < 0) return true;  // created fully committed
  const int err = posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(len));
  errno = err;
  return err == 0;
}

ShmSegment::~ShmSegment() {
  if (fd_ >= 0) ::close(fd_);
  if (owner_) unlink();
  if (base_) munmap(base_, size_);
}

void ShmSegment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

}  // namespace myccl::cpu
