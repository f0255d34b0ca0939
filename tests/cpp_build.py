"""Builds and runs the C++ unit tests under tests/cpp (receive matching, the flat algorithms, the
CUDA double) with the system compiler: -Werror, checked iterators, and, where a test needs torch's
headers (c10 errors, ATen types), the running interpreter's torch (CPU headers and libraries only).
Each test binary prints its failed checks and exits non-zero if any failed. Which of the
extension's sources a test compiles comes from build_sources.py, the lists the build itself uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler (g++) on PATH")
    return cxx


def _torch():
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch is not importable from {sys.executable}: {e}")
    return os.path.dirname(torch.__file__), int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def build(tmp_path, name: str, sources: list[str], with_torch: bool, debug_iterators: bool = False) -> str:
    """Compiles `sources` (paths relative to the repository) into tmp_path/name; returns its path."""
    cxx = compiler()
    flags = ["-std=c++20", "-O1", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-pthread",
             "-I", os.path.join(ROOT, "include"), "-I", os.path.join(ROOT, "src"), "-I", os.path.join(ROOT, "tests", "cpp")]
    if debug_iterators:
        flags.append("-D_GLIBCXX_DEBUG")  # checked iterators: an erase through a stale one fails loudly
    libs = []
    if with_torch:
        torch_dir, abi = _torch()
        # torch's own headers are system headers here: -Wextra is for our code, not theirs.
        flags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                  "-isystem", os.path.join(torch_dir, "include"),
                  "-isystem", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include")]
        lib = os.path.join(torch_dir, "lib")
        libs = ["-L", lib, f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]

    def compile_one(src):
        obj = tmp_path / (os.path.basename(src) + ".o")
        r = subprocess.run([cxx, *flags, "-c", os.path.join(ROOT, src), "-o", str(obj)],
                           capture_output=True, text=True, timeout=600)
        return src, obj, r

    with ThreadPoolExecutor(max_workers=2) as pool:  # small CI machines: two compile jobs
        results = list(pool.map(compile_one, sources))
    for src, _, r in results:
        assert r.returncode == 0, f"{src} did not compile:\n" + r.stdout + r.stderr
    exe = tmp_path / name
    link = subprocess.run([cxx, "-pthread", *[str(obj) for _, obj, _ in results], "-o", str(exe), *libs],
                          capture_output=True, text=True, timeout=300)
    assert link.returncode == 0, f"{name} did not link:\n" + link.stdout + link.stderr
    return str(exe)


def run(exe: str, timeout: float, what: str) -> str:
    """Runs a built test binary; fails with its output unless it exits 0. Returns its stdout."""
    r = subprocess.run([exe], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (f"{what} failed (exit {r.returncode}):\n" + r.stdout
                               + "\n--- stderr ---\n" + r.stderr[-20000:])
    return r.stdout
