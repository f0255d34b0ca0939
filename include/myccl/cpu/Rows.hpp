// Rows of a table held in parts (whole-memory tensors, c10d_ext.wholememory): part p holds rows
// [p * perPart, (p + 1) * perPart) at parts[p], one row every strideBytes, rowBytes of it data.
// gatherRows: out[i] = row idx[i]; scatterRows: row idx[i] = in[i], in index order, so the last
// of repeated indices wins. Both throw (std::out_of_range, naming the index) before touching
// memory when an index is outside [0, rows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace myccl::cpu {

struct RowParts {
  std::vector<char*> parts;
  int64_t perPart = 0;
  int64_t rows = 0;
  size_t rowBytes = 0;
  size_t strideBytes = 0;
};

template <typename Index>
void gatherRows(const RowParts& t, const Index* idx, size_t n, char* out);

template <typename Index>
void scatterRows(const RowParts& t, const Index* idx, size_t n, const char* in);

}  // namespace myccl::cpu
