// The strict host double of the CUDA runtime and NCCL (Runtime.hpp) for machines without a GPU:
// CPU tensors stand in for device tensors, worker threads for streams, a c10d::Store for NCCL's
// wire. It runs the engine's real logic and reports, as violations, what real CUDA/NCCL would
// hang on or silently get wrong.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "myccl/cuda/Memory.hpp"
#include "myccl/cuda/Runtime.hpp"

namespace myccl::cuda::testdouble {

// version() of the double's Nccl: NCCL's encoding (major*10000 + minor*100 + patch) of 2.30.99;
// patch 99 marks the double, so logs never mistake it for a real NCCL.
constexpr int kDoubleNcclVersion = 23099;

struct Options {
  int devices = 2;                  // simulated device count
  uint64_t seed = 0;                // 0: seeded from the clock; drives the stream delays
  int maxDelayUs = 100;             // each stream item waits a random 0..maxDelayUs before running
  int64_t eagerBytes = 64 * 1024;   // sends up to this size complete without a posted receive
  int64_t hangMs = 10000;           // a wait longer than this is reported as a hang (and goes on)
  int computeCapability = 90;       // of every simulated device (90: 9.0, a Hopper GPU)
  // ncclCommAbort stops the communicator's kernels first and returns only after tearing down its
  // proxies and sockets (hundreds of ms on an H100): events after the stopped kernels fire in
  // between. The double's abort returns this long after its kernels stopped.
  int64_t abortTailMs = 100;
};

// One simulated machine: devices, streams, events, allocator, communicators, violation log.
class Machine;

// The process's own machine, created on first use with `opts` (later calls ignore opts).
std::shared_ptr<Machine> machine(const Options& opts = {});
// An independent machine (unit tests run one per simulated rank, ranks as threads).
std::shared_ptr<Machine> newMachine(const Options& opts = {});

// The Runtime of one engine: the machine's Device and an Nccl whose communicators move data
// through `store`. kind = "double".
Runtime runtime(const std::shared_ptr<Machine>& m, c10::intrusive_ptr<c10d::Store> store);
// The machine's shared device memory (Memory.hpp): "device memory" is memfd files, so handles
// travel between processes as file descriptors, as CUDA's do; granularity kMemoryGranularity.
// Every address range it reserves stays reserved (inaccessible) after it is freed, and a fault in
// one is reported on stderr before the process dies of it: a use after cuMemUnmap /
// cuMemAddressFree, or before cuMemMap / cuMemSetAccess, fails loudly, not silently.
std::shared_ptr<Memory> memory(const std::shared_ptr<Machine>& m);
constexpr size_t kMemoryGranularity = 2 << 20;
// The machine's Device alone (tests that need no NCCL).
std::shared_ptr<Device> device(const std::shared_ptr<Machine>& m);
const Options& options(const Machine& m);

// Test hooks.
std::vector<std::string> violations(const Machine& m);  // every strictness violation so far, in order
void clearViolations(Machine& m);
// Blocks until every stream of the machine has run what it held at the call
// (cudaDeviceSynchronize on every device). Past hangMs it reports a hang and returns.
void synchronize(Machine& m);
// Device order: each device runs one communicator launch at a time, in launch order (a GPU may).
void setDeviceOrder(Machine& m, bool on);
// Facts tests assert on (the first eight are always present):
//   comms_created, comms_blocking, comms_nonblocking  communicators made by init or split
//   group_launches   outermost groupEnds and ops issued outside a group (each one launch)
//   premul_host, premul_device   PreMulSum operators created, by scalar residence
//   streams          newStream calls;  violations   violations reported (clearViolations keeps it)
//   comm_nranks_<n>  communicators settled with n ranks;  comms_destroyed, aborts, splits
//   launched_ops, collectives, sends, recvs   ops launched / posted on a stream
//   launches_skipped, ops_abandoned   items skipped or stopped by abort or an earlier error
//   hangs            hang violations;  groups_failed   groups ended with an op's error
//   allocations, frees, record_streams   allocator;  events, streams_high_priority,
//   relaxed_capture_mode   Device calls;  mem_creates, mem_imports, mem_maps, and the live
//   mem_handles, mem_mapped, host_registered   shared device memory;  mem_synchronize (and
//   mem_synchronize_cuda<d> for device d)   device synchronisations before memory is given back
std::map<std::string, int64_t> counters(const Machine& m);
// A kernel of the test's own on stream `s` of the machine: after `delayMs`, `body` runs on the
// stream's worker, once the allocator has checked [p, p + nbytes) as a kernel's access named `use`
// (a freed block is a violation, as for NCCL's buffers). Like a kernel it holds no reference to
// the memory. Stands for a producer or a consumer a test orders against the engine's and the
// layers' work.
void kernel(Machine& m, const Stream& s, void* p, size_t nbytes, const std::string& use, int delayMs,
            std::function<void()> body);

// While on, every shared-memory synchronisation (the first step of each release of mapped memory
// or of a host registration) waits (up to hangMs, then reports a hang): tests hold releases
// queued to reach what happens meanwhile. Off lets them run.
void holdMemoryReleases(bool on);

// The same on the process's machine.
std::vector<std::string> violations();
void clearViolations();
void synchronize();
std::map<std::string, int64_t> counters();

}  // namespace myccl::cuda::testdouble
