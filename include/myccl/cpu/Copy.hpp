// Bulk copy with streaming (non-temporal) stores, for large writes into memory nobody reads
// again soon (the caller's output tensors at the end of a collective).
#pragma once

#include <cstddef>

namespace myccl::cpu {

// memcpy(dst, src, n) whose stores bypass the caches. Into cold memory it is faster than memcpy,
// which reads every destination line from memory before overwriting it (docs/PERFORMANCE.md,
// "Streaming stores"); the price is that `dst` is not in cache afterwards.
// Portable fallback: memcpy. Returns with the stores globally visible (sfence).
void streamCopy(void* dst, const void* src, size_t n);

// From what size a result is better written with streamCopy: the last-level cache's size (a
// result that large is out of cache by the time anyone reads it anyway), 32 MiB if unknown,
// within [4 MiB, 256 MiB].
size_t streamCopyMinBytes();

}  // namespace myccl::cpu
