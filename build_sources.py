"""Which C++ sources each build compiles: the extension c10d_ext._C (setup.py), the CUDA test
double c10d_ext._test_double (setup.py, MYCCL_BUILD_TESTS=1), and the C++ unit tests under
tests/cpp (tests/cpp_build.py). The one place these lists are made, so that a file moved or
split is picked up by all of them alike. Paths are relative to the repository root.

The unit tests compile a part of the extension with a test of their own. A part is named by the
files' names without their directories and resolved against the extension's list, so a file
that moves between directories needs no edit here; a name that no longer resolves fails loudly
(tests/project/test_build.py checks every part).
"""

from __future__ import annotations

import glob
import os

ROOT = os.path.dirname(os.path.abspath(__file__))

# The test double's own files: never in _C.
TEST_DOUBLE = ("src/cuda/double/", "src/python/TestDoubleModule.cpp")
# The real CUDA runtime and NCCL (their headers): only in a build with the NCCL engine.
REAL_CUDA = "src/cuda/real/"
# The seam's vocabulary (type sizes and names), which the double shares with the engine.
CUDA_SEAM = ("Runtime.cpp",)

# Parts of the extension that the C++ unit tests compile (file names, see resolve()).
PARTS = {
    # tests/cpp/test_algorithms.cpp: the flat algorithms over an in-process loopback transport,
    # with the reduce kernels, copies and scratch they run on.
    "flat_algorithms": ("FlatCommon.cpp", "Direct.cpp", "Ring.cpp", "Bruck.cpp", "HalvingDoubling.cpp", "Tree.cpp",
                        "Chain.cpp", "Common.cpp", "Tags.cpp", "Reduce.cpp", "Copy.cpp", "Parallel.cpp",
                        "Transport.cpp", "Reduction.cpp"),
    # tests/cpp/test_cuda_memory.cpp: shared device memory under whole-memory tensors (with the double).
    "shared_region": ("SharedRegion.cpp",),
}


def _glob(pattern: str) -> list[str]:
    return sorted(p.replace(os.sep, "/") for p in glob.glob(pattern, root_dir=ROOT, recursive=True))


def all_sources() -> list[str]:
    """Every .cpp under src/."""
    return _glob("src/**/*.cpp")


def extension_sources(with_nccl: bool) -> list[str]:
    """c10d_ext._C: every source but the test double's. The CUDA engine's logic builds
    everywhere; only the real runtime (src/cuda/real) needs CUDA's and NCCL's headers."""
    srcs = [s for s in all_sources() if not s.startswith(TEST_DOUBLE)]
    return srcs if with_nccl else [s for s in srcs if not s.startswith(REAL_CUDA)]


def cuda_double_sources() -> list[str]:
    """The strict CUDA/NCCL host double and the seam's vocabulary it shares with the engine."""
    return _glob("src/cuda/double/*.cpp") + resolve(CUDA_SEAM)


def test_double_sources() -> list[str]:
    """c10d_ext._test_double: the double, and the module that installs it."""
    return cuda_double_sources() + ["src/python/TestDoubleModule.cpp"]


def resolve(names) -> list[str]:
    """The extension's sources with these file names, in the order given. Raises ValueError for
    a name that matches no source or several."""
    by_name: dict[str, list[str]] = {}
    for s in extension_sources(with_nccl=False):
        by_name.setdefault(os.path.basename(s), []).append(s)
    out = []
    for n in names:
        found = by_name.get(n, [])
        if len(found) != 1:
            raise ValueError(f"build_sources: {n!r} names {len(found)} of the extension's sources"
                             + (f" ({', '.join(found)})" if found else "") + "; update build_sources.PARTS")
        out.append(found[0])
    return out


def part(name: str) -> list[str]:
    """The sources of one of PARTS."""
    return resolve(PARTS[name])
