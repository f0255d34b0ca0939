"""The build and its guard: a build names the torch it is for, and refuses any other torch minor
with the command that rebuilds it (c10d's C++ classes have no stable ABI across releases)."""

import os
import shutil
import subprocess
import sys

import torch

import c10d_ext

from harness import ROOT


def _minor(v):
    return ".".join(v.split("+")[0].split(".")[:2])


def test_version_names_the_torch_it_was_built_for():
    info = c10d_ext.build_info()
    assert info["torch_minor"] == _minor(torch.__version__)
    assert info["version"] == c10d_ext.__version__
    assert c10d_ext.__version__.endswith("+torch" + _minor(torch.__version__)), c10d_ext.__version__
    # The extension itself was compiled against this torch (its own macro, not setup.py's file).
    assert _minor(info["torch_version"]) == _minor(torch.__version__), (info["torch_version"], torch.__version__)


def test_build_for_another_torch_refuses_to_load(tmp_path):
    # A copy of the package whose build says it is for another torch minor: import must fail
    # before the extension is loaded, naming both versions and the rebuild command.
    pkg = tmp_path / "c10d_ext"
    shutil.copytree(os.path.join(ROOT, "c10d_ext"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    info = dict(c10d_ext.build_info())
    info = {k: info[k] for k in ("version", "torch_version", "torch_minor", "with_nccl", "python")}
    info.update(torch_version="2.99.0", torch_minor="2.99", version="0.2.0+torch2.99")
    (pkg / "_build_info.py").write_text(f"BUILD_INFO = {info!r}\n")
    (tmp_path / "setup.py").write_text("")  # looks like a source tree: the editable rebuild command
    code = "import c10d_ext"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode != 0, "a build for torch 2.99 loaded under torch " + torch.__version__
    err = p.stderr.strip().splitlines()[-1]
    assert err.startswith("ImportError: c10d_ext 0.2.0+torch2.99 was built for torch 2.99.0"), err
    assert f"torch {torch.__version__} is installed" in err, err
    assert f"{sys.executable} -m pip install --no-build-isolation --no-deps -e {tmp_path}" in err, err


def test_source_lists_are_the_builds():
    """The C++ unit tests compile parts of the extension named in build_sources.py, the module
    setup.py takes its lists from: each part resolves to sources the extension builds, and the
    test double's own files are never in the extension."""
    import pytest

    import build_sources

    ext = build_sources.extension_sources(with_nccl=True)
    assert ext == sorted(ext) and ext[0].startswith("src/") and "src/backend/ProcessGroupMyccl.cpp" in ext
    for name in build_sources.PARTS:
        part = build_sources.part(name)
        assert part and set(part) <= set(ext), name
    assert not any(s.startswith(build_sources.TEST_DOUBLE) for s in ext)
    double = build_sources.test_double_sources()
    assert set(double) & set(ext) == set(build_sources.resolve(build_sources.CUDA_SEAM))
    with pytest.raises(ValueError, match="'Nowhere.cpp' names 0 of the extension's sources"):
        build_sources.resolve(["Nowhere.cpp"])


def test_the_distribution_carries_every_module_of_the_package(tmp_path):
    """setup.py's package list: every module under c10d_ext/ is in what a wheel or an sdist ships
    (egg_info's SOURCES.txt, which `pip install .` and `make wheel` build from), new subpackages too."""
    env = dict(os.environ, MYCCL_BUILD_TESTS="0")
    p = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (info,) = [d for d in os.listdir(tmp_path) if d.endswith(".egg-info")]
    shipped = set(open(os.path.join(tmp_path, info, "SOURCES.txt")).read().split())
    modules = {os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "c10d_ext"))
               for f in fs if f.endswith(".py") and "__pycache__" not in d and f != "_build_info.py"}
    assert "c10d_ext/wholememory/embedding.py" in modules
    assert not modules - shipped, sorted(modules - shipped)
