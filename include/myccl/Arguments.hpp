// The backend's vocabulary for its arguments: torch's names for dtypes and shapes (what users
// read in errors, traces and the flight recorder), translation of torch's dtypes and ReduceOps
// into the engines' Reduction, the checks several ops share, and each rank's block of a flat
// tensor. Every error names the op and the rank (`where`) and the offending value.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>
#include <string>
#include <vector>

#include "myccl/Errors.hpp"
#include "myccl/Reduction.hpp"
#include "myccl/Work.hpp"

namespace myccl {

// torch's Python name of a dtype ("float32", "uint16").
std::string scalarTypeName(at::ScalarType st);
// "[4, 1024]"; on every op (flight recorder), so without stream machinery.
std::string shapeOf(const at::Tensor& t);
// "float32[4, 1024] on cpu"
std::string describe(const at::Tensor& t);
// The element type the reduction kernels know, if any.
std::optional<DType> dtypeOf(at::ScalarType st);
const char* reduceOpName(c10d::ReduceOp::RedOpType op);

// What a ReduceOp means for this tensor's dtype in a group of `size` ranks; rejects
// combinations that have no meaning (AVG of bool, MIN of complex, bitwise on floats).
// `onDevice`: the op runs on the CUDA engine (MycclBackend::onDevice), which reduces more dtypes.
Reduction toReduction(const Where& where, const at::Tensor& t, const c10d::ReduceOp& rop, int size,
                      bool onDevice);

// What the flight recorder, traces and cross-rank checks say about an op.
void annotate(OpInfo& i, const at::Tensor& t, int64_t root, const char* redop);

void checkRoot(const Where& where, int64_t root, int size);
// `selfAllowed`: CUDA point-to-point, where a send to this rank itself is a device copy.
void checkPeer(const Where& where, int peer, int rank, int size, bool selfAllowed = false);
const at::Tensor& single(const Where& where, const std::vector<at::Tensor>& ts, const char* what = "tensor");
void checkWritable(const Where& where, const at::Tensor& t, const char* what);
void checkSameDtype(const Where& where, const at::Tensor& ref, const at::Tensor& t, const char* what);

// Rows [first, first + count) of `t`, as t.narrow(0, first, count) gives them.
at::Tensor rowSlice(const at::Tensor& t, int64_t first, int64_t count);
// Row-major blocks of `t` for each rank: block r holds elements [r*n, (r+1)*n).
std::vector<at::Tensor> blocks(const Where& where, const at::Tensor& t, int size, int64_t n, const char* what);
// A rooted op's list of one tensor per rank (gather's outputs: what = "output", scatter's inputs:
// "input"), which only the root passes, checked against this rank's own tensor `mine` (what the
// op calls `other`); `writable`: the list receives results. Returns it (empty off the root).
std::vector<at::Tensor> rootList(const Where& where, const std::vector<std::vector<at::Tensor>>& lists,
                                 const char* what, const char* other, const at::Tensor& mine, bool writable, int root,
                                 int rank, int size);

}  // namespace myccl
