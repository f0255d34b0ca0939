"""The flat algorithms without sockets or processes: tests/cpp/test_algorithms.cpp runs ring,
Bruck, halving-doubling, tree, chain and the direct exchanges as threads over an in-process
loopback transport, at 1-8 ranks, uneven and empty blocks, on a buffering and on a rendezvous
transport, and compares every rank's result with a local expectation (bit for bit where sums
fold in rank order). An algorithm bug shows up here by name, not as a hung multi-process test."""

import re

import build_sources
from cpp_build import build, run

SOURCES = ["tests/cpp/test_algorithms.cpp"] + build_sources.part("flat_algorithms")


def test_flat_algorithms(tmp_path):
    exe = build(tmp_path, "test_algorithms", SOURCES, with_torch=True)
    out = run(exe, timeout=300, what="algorithm unit tests")
    m = re.search(r"(\d+) checks, 0 failed", out)
    assert m and int(m.group(1)) > 1000, out[-2000:]
