"""The strict CUDA/NCCL double without a GPU: compiles tests/cpp/test_cuda_double.cpp with the
double's sources (src/cuda/double, and the seam's src/cuda/Runtime.cpp) against the running interpreter's torch (CPU headers and
libraries only) and runs it, so a broken double shows up here by test name rather than as odd
failures of the CUDA engine's tests that run on it."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(ROOT, "src", "cuda", "double")


def _torch():
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch is not importable from {sys.executable}: {e}")
    return os.path.dirname(torch.__file__), int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def test_cuda_double_unit_tests(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler (g++) on PATH")
    torch_dir, abi = _torch()
    sources = sorted(os.path.join(DOUBLE, f) for f in os.listdir(DOUBLE) if f.endswith(".cpp"))
    # The seam's own vocabulary (type sizes and names), which the double shares with the engine.
    sources.append(os.path.join(ROOT, "src", "cuda", "Runtime.cpp"))
    sources.append(os.path.join(ROOT, "tests", "cpp", "test_cuda_double.cpp"))
    # torch's own headers are system headers here: -Wextra is for our code, not theirs.
    flags = [
        "-std=c++20", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", os.path.join(ROOT, "include"),
        "-isystem", os.path.join(torch_dir, "include"),
        "-isystem", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
    ]

    def compile_one(src):
        obj = tmp_path / (os.path.basename(src) + ".o")
        r = subprocess.run([cxx, *flags, "-c", src, "-o", str(obj)], capture_output=True, text=True, timeout=600)
        return src, obj, r

    with ThreadPoolExecutor(max_workers=2) as pool:  # small CI machines: two compile jobs
        results = list(pool.map(compile_one, sources))
    for src, _, r in results:
        assert r.returncode == 0, f"{os.path.relpath(src, ROOT)} did not compile:\n" + r.stdout + r.stderr

    exe = tmp_path / "test_cuda_double"
    lib = os.path.join(torch_dir, "lib")
    link = subprocess.run(
        [cxx, "-pthread", *[str(obj) for _, obj, _ in results], "-o", str(exe),
         "-L", lib, f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"],
        capture_output=True, text=True, timeout=300)
    assert link.returncode == 0, "test_cuda_double did not link:\n" + link.stdout + link.stderr

    # The binary bounds itself (a watchdog ends a hung test with its name); this is the backstop.
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, (f"CUDA double unit tests failed (exit {run.returncode}):\n" + run.stdout
                                 + "\n--- stderr (violations the double printed) ---\n" + run.stderr[-20000:])
