// Profiler titles and torch's comm metadata for an op (Profiler.hpp).
#include "myccl/Profiler.hpp"

#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <mutex>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

namespace myccl {

// From the op's name rather than its OpType (older torch releases give several ops one OpType).
// Looked up per thread by the name literal's address, so that an op costs no lock and no
// allocation here; there are a few dozen call sites.
const char* profilingTitle(const char* name) {
  thread_local std::vector<std::pair<const char*, const char*>> seen;
  for (const auto& [n, title] : seen)
    if (n == name) return title;
  static std::mutex mu;
  static std::unordered_set<std::string> titles;
  const char* title;
  {
    std::lock_guard<std::mutex> lock(mu);
    title = titles.insert(std::string("myccl:") + name).first->c_str();
  }
  seen.emplace_back(name, title);
  return title;
}

// Costs an allocation per op: only while a RecordFunction observer is installed.
void recordParamComms(const OpInfo& info, const std::vector<at::Tensor>& inputs,
                      const std::vector<at::Tensor>& outputs) {
  int64_t inNelems = 0, outNelems = 0;
  for (const auto& t : inputs) inNelems += t.numel();
  for (const auto& t : outputs) outNelems += t.numel();
  const at::ScalarType dtype = !inputs.empty()    ? inputs[0].scalar_type()
                               : !outputs.empty() ? outputs[0].scalar_type()
                                                  : at::kByte;
  const std::vector<int64_t> noSplits;
  RECORD_PARAM_COMMS_DATA(static_cast<int64_t>(info.seq), std::make_tuple(info.group, std::string("myccl")), inputs,
                          outputs, info.rank, std::string(info.name), inNelems, outNelems, dtype, noSplits, noSplits,
                          info.rankStart, info.rankStride, info.size);
}

}  // namespace myccl
