"""c10d_ext.wholememory's guarantees that the kind tests do not reach: the modules' one-way
imports, the descriptor exchange at any number of local ranks, zero-filled memory, the
consistency of DISTRIBUTED gathers read in place, releases and registrations of CUDA memory, and
agreement at creation. CUDA paths run on the strict CUDA double (tests/cuda_double.py)."""

from __future__ import annotations

import ast
import os

import pytest
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "c10d_ext", "wholememory")


def _imports(path: str) -> set[str]:
    """The package's own modules a module imports (``from . import x``, ``from .x import y``)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_modules_import_one_way():
    """No module of the layer imports one that imports it back, directly or around a loop."""
    mods = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
    graph = {m: _imports(os.path.join(PACKAGE, m + ".py")) & mods for m in mods}

    def cycle_from(start):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = [c for c in (cycle_from(m) for m in sorted(mods)) if c]
    assert not cycles, cycles
