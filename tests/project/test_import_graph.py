"""Within c10d_ext, modules depend one way: the graph of which module imports which has no cycle;
and so do the C++ files of include/ and src/ (the graph of their `#include "..."`).
Every `import` and `from ... import` counts, those inside functions too (a lazy import only hides
a cycle). An import of a submodule runs its package's __init__ first; that implicit edge is left
out (every package imports its own modules), the explicit imports of the package are not.

The tests and benchmarks share code only through helper modules (harness.py and the per-layer
helpers): no test module imports another test module, and no two test files under tests/ share a
name (the harness's workers find a test module by its name)."""

import ast
import os
import re

from harness import ROOT

PACKAGE = os.path.join(ROOT, "c10d_ext")

def _modules() -> dict[str, str]:
    """Dotted name -> path, for every Python module and extension module of the package."""
    mods = {}
    for d, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py") or f.endswith(".so"):
                base = f[:-3] if f.endswith(".py") else f.split(".")[0]
                parts = os.path.relpath(os.path.join(d, base), ROOT).split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                mods.setdefault(".".join(parts), os.path.join(d, f))
    return mods


def _imports(name: str, path: str, mods: dict) -> set[str]:
    """The package's modules that module `name` imports anywhere in its body."""
    if not path.endswith(".py"):
        return set()
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in mods:
                    out.add(sub)  # from pkg import module
                elif target in mods:
                    out.add(target)  # from module import name
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    assert "c10d_ext.horovod.controller" in graph and "c10d_ext._C" in graph  # the scan saw the package
    found = _cycles(graph)
    detail = "\n".join(" <-> ".join(c) + "\n" + "\n".join(f"    {m} imports {sorted(graph[m] & set(c))}" for m in c)
                       for c in found)
    assert not found, "import cycles in c10d_ext:\n" + detail


def test_the_scan_finds_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from .b import f\n")
    mods = {"p": str(pkg / "__init__.py"), "p.a": str(pkg / "a.py"), "p.b": str(pkg / "b.py"), "p.c": str(pkg / "c.py")}
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert graph == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.b"}}
    assert _cycles(graph) == [["p.a", "p.b"]]


# `import test_x` / `from test_x import ...` / `from tests.test_x import ...`, also inside the
# scripts that tests write out and run (strings), and as lazy imports inside functions.
_TEST_IMPORT = re.compile(r"^[ \t]*(?:from|import)[ \t]+(?:[\w.]*\.)?(test_\w+)", re.M)


def _test_imports(text: str) -> list[str]:
    return _TEST_IMPORT.findall(text)


def test_no_test_module_imports_another():
    seen, found = 0, []
    for top in ("tests", "benchmarks", "examples", "scripts"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    seen += 1
                    found += [f"{os.path.relpath(path, ROOT)} imports {m}" for m in _test_imports(open(path).read())]
    assert seen > 10, "the scan found no Python files"
    assert not found, ("what test modules share belongs in tests/harness.py or a layer's helper module "
                       "(tests/*_helpers.py):\n" + "\n".join(found))


def test_the_scan_finds_test_imports():
    text = ("import harness\nfrom test_cuda import WORLD\ndef f():\n    import test_horovod as h\n"
            "SCRIPT = \"\"\"\nfrom tests.test_wholememory import _reference\n\"\"\"\n"
            "from cuda_helpers import MODES  # test_cuda's worlds\n")
    assert _test_imports(text) == ["test_cuda", "test_horovod", "test_wholememory"]


def test_test_modules_are_found_by_name():
    """A worker of the harness imports a test function's module by name, with tests/ and every
    layer's folder on its path (harness.layer_dirs()): two test files of one name in two folders
    would make one of them the other."""
    import harness

    where: dict[str, list[str]] = {}
    for d, _, files in os.walk(harness.TESTS):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                where.setdefault(f, []).append(os.path.relpath(d, ROOT))
    assert len(where) > 10, "the scan found no test files"
    assert not {f: ds for f, ds in where.items() if len(ds) > 1}, where
    layers = {os.path.relpath(d, ROOT) for d in harness.layer_dirs()}
    assert layers == {d for ds in where.values() for d in ds} - {"tests"}, layers


# ---- the C++ files ------------------------------------------------------------------------------
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _cpp_graph(root: str) -> dict[str, set[str]]:
    """Every C++ file under root's include/ and src/ -> the files of those trees it includes
    (resolved as the build does: beside the file, then include/, then src/)."""
    files = set()
    for top in ("include", "src"):
        for d, _, names in os.walk(os.path.join(root, top)):
            files |= {os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith((".hpp", ".h", ".cpp"))}

    def resolve(src: str, inc: str):
        for base in (os.path.dirname(src), "include", "src"):
            p = os.path.normpath(os.path.join(base, inc))
            if p in files:
                return p
        return None

    graph = {}
    for f in files:
        text = open(os.path.join(root, f), errors="replace").read()
        graph[f] = {r for i in _INCLUDE.findall(text) if (r := resolve(f, i)) is not None}
    return graph


def test_no_include_cycles():
    cycles = _cycles(_cpp_graph(ROOT))
    assert not cycles, "C++ files that include each other (a header's layer is unclear):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_include_scan_finds_a_cycle(tmp_path):
    (tmp_path / "include" / "myccl").mkdir(parents=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "include" / "myccl" / "A.hpp").write_text('#pragma once\n#include "myccl/B.hpp"\n')
    (tmp_path / "include" / "myccl" / "B.hpp").write_text('#pragma once\n#include "myccl/A.hpp"\n')
    (tmp_path / "src" / "A.cpp").write_text('#include "myccl/A.hpp"\n')
    assert _cycles(_cpp_graph(str(tmp_path))) == [["include/myccl/A.hpp", "include/myccl/B.hpp"]]
