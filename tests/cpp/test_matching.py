"""Receive matching without a socket: compiles tests/cpp/test_matching.cpp against the matcher
header TcpTransport uses (no torch headers) and runs it, so a matching bug shows up here by name
instead of as a hung or failed end-to-end p2p test."""

from cpp_build import build, run


def test_matching_unit_tests(tmp_path):
    exe = build(tmp_path, "test_matching", ["tests/cpp/test_matching.cpp"], with_torch=False, debug_iterators=True)
    run(exe, timeout=60, what="matching unit tests")
