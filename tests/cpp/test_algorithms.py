"""The flat algorithms without sockets or processes: tests/cpp/test_algorithms.cpp runs ring,
Bruck, halving-doubling, tree, chain and the direct exchanges as threads over an in-process
loopback transport, at 1-8 ranks, uneven and empty blocks, on a buffering and on a rendezvous
transport, and compares every rank's result with a local expectation (bit for bit where sums
fold in rank order). An algorithm bug shows up here by name, not as a hung multi-process test.

The program reports what it ran: its tables of rank counts and transports, and for each case name
the (ranks, transport) pairs it ran at. Every algorithm it calls must have run at every pair of
its tables, and every family of src/cpu/algorithms/Flat.hpp must be among them."""

import os
import re

import build_sources
from cpp_build import build, run

from harness import ROOT

PROGRAM = "tests/cpp/test_algorithms.cpp"
SOURCES = [PROGRAM] + build_sources.part("flat_algorithms")


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _called() -> set[str]:
    """The flat algorithms the program calls by name."""
    return set(re.findall(r"\bflat::(\w+)", _read(PROGRAM)))


def _families() -> dict[str, set[str]]:
    """Flat.hpp's algorithms by the file that holds them (its "// ---- Ring.cpp" sections), for
    the family files the build compiles into the flat algorithms."""
    out: dict[str, set[str]] = {}
    family = None
    built = {os.path.basename(p) for p in build_sources.part("flat_algorithms")}
    for line in _read("src/cpu/algorithms/Flat.hpp").splitlines():
        m = re.match(r"// ---- (\w+\.cpp)", line)
        if m:
            family = m.group(1) if m.group(1) in built else None
            continue
        m = re.match(r"void (\w+)\(CollCtx&", line)
        if m and family:
            out.setdefault(family, set()).add(m.group(1))
    return out


def _report(out: str):
    """(rank counts, transports, {algorithm: {(ranks, transport)}}) as the program printed them."""
    ranks = [int(x) for x in re.search(r"^ranks((?: \d+)+)$", out, re.M).group(1).split()]
    modes = re.search(r"^modes((?: \w+)+)$", out, re.M).group(1).split()
    ran: dict[str, set[tuple[int, str]]] = {}
    for name, cases in re.findall(r"^ran (.+?):((?: \d+/\w+)*)$", out, re.M):
        algo = re.match(r"\w+", name).group(0)  # "chainBroadcast(2 hosts)" is chainBroadcast too
        ran.setdefault(algo, set()).update((int(n), m) for n, m in (c.split("/") for c in cases.split()))
    return ranks, modes, ran


def test_flat_algorithms(tmp_path):
    exe = build(tmp_path, "test_algorithms", SOURCES, with_torch=True)
    out = run(exe, timeout=300, what="algorithm unit tests")
    m = re.search(r"^(\d+) checks, (\d+) failed$", out, re.M)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", out[-2000:]
    ranks, modes, ran = _report(out)
    # What the docstring promises: 1 to 8 ranks, powers of two and others, both kinds of transport.
    assert min(ranks) == 1 and max(ranks) == 8 and any(n & (n - 1) for n in ranks), ranks
    assert sorted(modes) == ["eager", "rendezvous"], modes
    every = {(n, mode) for n in ranks for mode in modes}
    called = _called()
    assert called, f"found no flat:: calls in {PROGRAM}"
    missing = {a: sorted(every - ran.get(a, set())) for a in called if every - ran.get(a, set())}
    assert not missing, f"algorithms not run at every rank count and transport: {missing}\n" + out[-2000:]
    families = _families()
    assert families, "found no algorithm sections in Flat.hpp"
    untested = [f for f, algos in families.items() if not algos & set(ran)]
    assert not untested, f"families of Flat.hpp whose algorithms the program never ran: {untested}"


def test_the_report_is_read_as_printed():
    out = ("ranks 1 2 3\nmodes eager rendezvous\nran chainBroadcast: 1/eager 2/eager\n"
           "ran chainBroadcast(2 hosts): 3/rendezvous\nran missing rank: 2/eager\n7 checks, 0 failed\n")
    ranks, modes, ran = _report(out)
    assert ranks == [1, 2, 3] and modes == ["eager", "rendezvous"]
    assert ran == {"chainBroadcast": {(1, "eager"), (2, "eager"), (3, "rendezvous")}, "missing": {(2, "eager")}}


def test_every_family_is_found():
    assert {"Direct.cpp", "Ring.cpp", "Bruck.cpp", "Tree.cpp", "Chain.cpp"} <= set(_families())
    assert {"ringAllreduce", "rhdAllreduce", "pairwiseAlltoallv"} <= _called()
