// Row gather / scatter over a table held in parts (Rows.hpp): the direct loads and stores of
// the mapped whole-memory kinds, one memcpy per row.
#include "myccl/cpu/Rows.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

namespace myccl::cpu {

namespace {

template <typename Index>
void checkIndices(const RowParts& t, const Index* idx, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const int64_t r = static_cast<int64_t>(idx[i]);
    if (r < 0 || r >= t.rows) {
      throw std::out_of_range("index " + std::to_string(r) + " (position " + std::to_string(i) +
                              ") is out of range for a whole-memory tensor of " + std::to_string(t.rows) + " rows");
    }
  }
}

inline char* rowAt(const RowParts& t, int64_t r) {
  const int64_t p = t.perPart > 0 ? r / t.perPart : 0;
  return t.parts[p] + static_cast<size_t>(r - p * t.perPart) * t.strideBytes;
}

}  // namespace

template <typename Index>
void gatherRows(const RowParts& t, const Index* idx, size_t n, char* out) {
  checkIndices(t, idx, n);
  for (size_t i = 0; i < n; ++i) std::memcpy(out + i * t.rowBytes, rowAt(t, static_cast<int64_t>(idx[i])), t.rowBytes);
}

template <typename Index>
void scatterRows(const RowParts& t, const Index* idx, size_t n, const char* in) {
  checkIndices(t, idx, n);
  for (size_t i = 0; i < n; ++i) std::memcpy(rowAt(t, static_cast<int64_t>(idx[i])), in + i * t.rowBytes, t.rowBytes);
}

template void gatherRows<int32_t>(const RowParts&, const int32_t*, size_t, char*);
template void gatherRows<int64_t>(const RowParts&, const int64_t*, size_t, char*);
template void scatterRows<int32_t>(const RowParts&, const int32_t*, size_t, const char*);
template void scatterRows<int64_t>(const RowParts&, const int64_t*, size_t, const char*);

}  // namespace myccl::cpu
