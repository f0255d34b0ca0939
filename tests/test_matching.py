"""Receive matching without a socket: compiles tests/cpp/test_matching.cpp against the matcher
header TcpTransport uses (no torch headers) and runs it, so a matching bug shows up here by name
instead of as a hung or failed end-to-end p2p test."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_matching_unit_tests(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler (g++) on PATH")
    exe = tmp_path / "test_matching"
    # _GLIBCXX_DEBUG: checked iterators, so an erase through a stale iterator fails loudly.
    build = subprocess.run(
        [cxx, "-std=c++20", "-O1", "-Wall", "-Wextra", "-Werror", "-D_GLIBCXX_DEBUG",
         "-I", os.path.join(ROOT, "include"), os.path.join(ROOT, "tests", "cpp", "test_matching.cpp"),
         "-o", str(exe)],
        capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, "test_matching.cpp did not compile:\n" + build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"matching unit tests failed (exit {run.returncode}):\n" + run.stdout + run.stderr
