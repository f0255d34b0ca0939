/* Counts heap allocations per thread, for benchmarks/cuda_host_cost.py: preloaded into a rank
 * (LD_PRELOAD), it wraps glibc's allocation entry points and keeps a per-thread count that
 * myccl_thread_allocations() returns. Frees are not counted; the memory is glibc's own.
 *
 * Tracing (myccl_trace_allocations(1) on one thread): each allocation on it also records
 * its call stack (24 frames), so that a benchmark can say which functions allocate per op;
 * myccl_trace_dump(path) appends the stacks to a file as lines of hex addresses and turns tracing
 * off. The addresses are resolved by the reader (dladdr through ctypes, or addr2line). */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <stddef.h>
#include <stdio.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

#define FRAMES 24
#define MAX_TRACES 65536

static __thread unsigned long long allocations;
static __thread int tracing;
static __thread int inside;  /* backtrace() may allocate: not traced */
/* One tracing thread at a time: its stacks go in one process-wide buffer. */
static int traced;
static void* traces[MAX_TRACES][FRAMES];
static int depths[MAX_TRACES];

unsigned long long myccl_thread_allocations(void) { return allocations; }

void myccl_trace_allocations(int on) {
  tracing = on;
  if (on) traced = 0;
}

int myccl_trace_dump(const char* path) {
  tracing = 0;
  FILE* f = fopen(path, "a");
  if (!f) return -1;
  for (int i = 0; i < traced; ++i) {
    for (int j = 0; j < depths[i]; ++j) fprintf(f, "%s%lx", j ? " " : "", (unsigned long)traces[i][j]);
    fputc('\n', f);
  }
  fclose(f);
  return traced;
}

static void count(void) {
  ++allocations;
  if (tracing && !inside && traced < MAX_TRACES) {
    inside = 1;
    depths[traced] = backtrace(traces[traced], FRAMES);
    ++traced;
    inside = 0;
  }
}

void* malloc(size_t n) {
  count();
  return __libc_malloc(n);
}

void* calloc(size_t k, size_t n) {
  count();
  return __libc_calloc(k, n);
}

void* realloc(void* p, size_t n) {
  count();
  return __libc_realloc(p, n);
}

void* memalign(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}

void* aligned_alloc(size_t a, size_t n) {
  count();
  return __libc_memalign(a, n);
}

int posix_memalign(void** out, size_t a, size_t n) {
  count();
  void* p = __libc_memalign(a, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
