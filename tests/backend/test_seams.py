"""The core knows its seams, not what plugs into them. The CUDA test double enters only through
the CUDA platform that routing asks (include/myccl/Engine.hpp, CudaPlatform), so no file of the
backend, the CPU engine or the Reducer names it and no error a user sees mentions it. Ops of
layers above enter the CPU engine through its one extension point (include/myccl/cpu/Extension.hpp)
and move bytes through the algorithms' entry points, so no file outside src/cpu/algorithms
includes that folder's private headers. A PREMUL_SUM on CPU tensors is what the DDP Reducer's
fused average uses: its factor is each rank's own, and the sum is exact either way."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import cuda_double
from cuda_helpers import DOUBLE
from harness import ROOT, Report, assert_reports


# Routing, the backend, the CPU engine and the Reducer, with the shared files above them.
CORE_DIRS = ("src/backend", "src/cpu", "src/reducer", "include/myccl/backend", "include/myccl/cpu",
             "include/myccl/reducer")
CORE_FLAT = ("src", "include/myccl")  # their own files only (src/cuda, src/python are not the core)
NAMES_THE_DOUBLE = re.compile(r"test[ _]?runtime|test[ _]?double|testdouble|cuda[ _]?double|stands in for cuda",
                              re.IGNORECASE)
PRIVATE_ALGORITHM_HEADERS = re.compile(r'#include\s+"[^"]*algorithms/(?!Algorithms\.hpp|LinkModel\.hpp|Tags\.hpp)'
                                       r'[A-Za-z]+\.hpp"')


def _sources(dirs=CORE_DIRS, flat=CORE_FLAT):
    out = []
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            out += [os.path.join(base, f) for f in files if f.endswith((".cpp", ".hpp"))]
    for d in flat:
        full = os.path.join(ROOT, d)
        out += [os.path.join(full, f) for f in os.listdir(full) if f.endswith((".cpp", ".hpp"))]
    return sorted(out)


def _offenders(pattern, files):
    hits = []
    for path in files:
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if pattern.search(line):
                hits.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    return hits


def test_the_core_never_names_the_test_double():
    files = _sources()
    assert any(f.endswith("Engines.cpp") for f in files) and any(f.endswith("EngineFactory.cpp") for f in files)
    hits = _offenders(NAMES_THE_DOUBLE, files)
    assert not hits, "the core names the CUDA test double (it enters through CudaPlatform):\n  " + "\n  ".join(hits)


def test_the_scan_finds_a_mention(tmp_path):
    (tmp_path / "Routing.cpp").write_text("// CPU tensors go to the CUDA engine while a test runtime is installed\n")
    assert _offenders(NAMES_THE_DOUBLE, _sources(dirs=(), flat=(str(tmp_path),)))


def test_only_the_algorithms_include_their_private_headers():
    outside = [f for f in _sources(dirs=("src", "include"), flat=())
               if not os.path.relpath(f, ROOT).startswith("src/cpu/algorithms/")]
    hits = _offenders(PRIVATE_ALGORITHM_HEADERS, outside)
    assert not hits, ("files outside src/cpu/algorithms include its private headers (use Algorithms.hpp's entry "
                      "points, which Select.cpp chooses behind):\n  " + "\n  ".join(hits))


def test_the_include_scan_finds_one(tmp_path):
    (tmp_path / "Ops.cpp").write_text('#include "cpu/algorithms/ShmAlgorithms.hpp"\n')
    (tmp_path / "Fine.cpp").write_text('#include "myccl/cpu/algorithms/Algorithms.hpp"\n')
    hits = _offenders(PRIVATE_ALGORITHM_HEADERS, _sources(dirs=(), flat=(str(tmp_path),)))
    assert len(hits) == 1 and "Ops.cpp" in hits[0], hits


# ---- behaviour -------------------------------------------------------------------------------

def body_agreed_under_the_double(ctx):
    """Under the double the CUDA engine takes CPU tensors: the agreed all_reduce (a CPU engine op)
    is unavailable, alike on every rank, and asking for it anyway is a clear error that names
    the op and the rank and says nothing of how the CUDA engine is made."""
    ctx.init(timeout=30)
    cuda_double.set_device(ctx.rank % 2)
    rep = Report(ctx)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rep.check(not backend._agreed_available, "the agreed all_reduce is offered where CPU tensors go to the CUDA engine")
    t = torch.ones(4)
    flag = torch.zeros(1, dtype=torch.uint8)
    try:
        backend._agreed_all_reduce(t, flag, 7, dist.ReduceOp.SUM).wait()
        rep.fail("the agreed all_reduce ran on a tensor the CUDA engine takes")
    except ValueError as e:
        msg = str(e)
        rep.check("agreed all_reduce" in msg and f"rank {ctx.rank}" in msg and "CUDA engine" in msg, msg)
        rep.check(not NAMES_THE_DOUBLE.search(msg), f"the error names the test double: {msg}")
    # The group goes on: a plain all_reduce of the same tensor runs on the CUDA engine.
    dist.all_reduce(t)
    cuda_double.synchronize()
    rep.check(t.tolist() == [float(ctx.size)] * 4, f"all_reduce after the refused op: {t.tolist()}")
    rep.check(not cuda_double.violations(), f"double violations: {cuda_double.violations()}")
    return rep.result()


def test_agreed_all_reduce_under_the_double_is_refused_plainly(run):
    if not cuda_double.available():
        pytest.skip("the CUDA test double is not built (MYCCL_BUILD_TESTS=1)")
    assert_reports(run(2, body_agreed_under_the_double, timeout=120, world_env=DOUBLE))


def body_premul_sum_factors(ctx):
    """PREMUL_SUM all_reduces of float32/float64 CPU tensors, each rank its own factor or all the
    same one, at the sizes of each shared-memory path (one step, sliced, zero copy) and over TCP:
    bit for bit the rank-order sum of each rank's input times its factor, rounded in the type."""
    import c10d_ext

    ctx.init(timeout=60, pg_options=c10d_ext.Options(shm_buffer_bytes=64 * 1024))
    rep = Report(ctx)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    sizes = (5, 3000, 100_000)  # one step; sliced through 64 KiB buffers; zero-copy candidates
    for dtype in (torch.float32, torch.float64):
        for numel in sizes:
            for mode in ("same", "own"):
                g = torch.Generator().manual_seed(numel + len(mode))
                xs = [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) * 100 for _ in range(ctx.size)]
                factors = [0.25] * ctx.size if mode == "same" else [0.5 + 0.25 * r for r in range(ctx.size)]
                want = xs[0] * factors[0]
                for r in range(1, ctx.size):
                    want = want + xs[r] * factors[r]
                for alloc in (False, True):
                    t = (backend.allocate_tensor(numel, dtype=dtype, device=torch.device("cpu")) if alloc
                         else torch.empty(numel, dtype=dtype))
                    t.copy_(xs[ctx.rank])
                    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factors[ctx.rank]))
                    rep.check(torch.equal(t, want), f"PREMUL_SUM {mode} factors {dtype} x {numel} "
                                                    f"(registered memory: {alloc}): max diff "
                                                    f"{(t.double() - want.double()).abs().max().item()}")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_premul_sum_is_exact_with_each_ranks_factor(run, size):
    assert_reports(run(size, body_premul_sum_factors, timeout=180))
