"""The strict CUDA/NCCL double without a GPU: compiles tests/cpp/test_cuda_double.cpp with the
double's sources (src/cuda/double, and the seam's src/cuda/Runtime.cpp) against the running interpreter's torch (CPU headers and
libraries only) and runs it, so a broken double shows up here by test name rather than as odd
failures of the CUDA engine's tests that run on it."""

import build_sources
from cpp_build import build, run


def test_cuda_double_unit_tests(tmp_path):
    # The double and the seam's own vocabulary (type sizes and names), which it shares with the engine.
    sources = build_sources.cuda_double_sources() + ["tests/cpp/test_cuda_double.cpp"]
    exe = build(tmp_path, "test_cuda_double", sources, with_torch=True)
    # The binary bounds itself (a watchdog ends a hung test with its name); this is the backstop.
    run(exe, timeout=180, what="CUDA double unit tests")


def test_cuda_memory_unit_tests(tmp_path):
    """The double's shared device memory (Memory.cpp) and SharedRegion, the C++ under whole-memory
    DEVICE and CUDA CHUNKED tensors: sharing, lifetime, every misuse, a use after unmap."""
    sources = (build_sources.cuda_double_sources() + build_sources.part("shared_region")
               + ["tests/cpp/test_cuda_memory.cpp"])
    exe = build(tmp_path, "test_cuda_memory", sources, with_torch=True)
    run(exe, timeout=120, what="CUDA memory unit tests")
