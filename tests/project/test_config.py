"""The public configuration speaks one language: every MYCCL_* variable is the Options field of the
same name, Options behaves as a dataclass that refuses unknown fields, `python -m c10d_ext.info`
shows values as users write them, importing c10d_ext leaves the application's logging alone, a
public function takes its group as torch's keyword `group=None`, and docs/CONFIG.md is what
config.py generates."""

import dataclasses
import inspect
import logging
import os
import subprocess
import sys
import warnings

import pytest

from harness import ROOT


def test_options_fields_are_the_variables_names():
    import c10d_ext
    from c10d_ext import _C, config

    names = {f.name for f in dataclasses.fields(c10d_ext.Options)}
    for var in config.VARS:
        assert var.field == var.name[len("MYCCL_"):].lower()
        if var.cpp:
            assert var.field in names, var.name
            assert hasattr(_C.Config(), var.field), var.name  # the C++ field has the same name
    assert "split_links" in names and "flight_recorder" in names and "debug" in names
    assert not any(n.startswith("test_cuda_double") for n in names)  # the double is the tests' own


def test_options_is_a_dataclass_that_refuses_typos():
    import c10d_ext

    o = c10d_ext.Options(transport="tcp", num_threads=2)
    assert dataclasses.is_dataclass(o)
    assert (o.transport, o.num_threads, o.hierarchical) == ("tcp", 2, None)
    assert repr(o) == "c10d_ext.Options(transport='tcp', num_threads=2)"
    with pytest.raises(TypeError, match="no field 'tranport'.*transport"):
        c10d_ext.Options(tranport="tcp")
    with pytest.raises(AttributeError):
        o.tranport = "tcp"
    with pytest.warns(FutureWarning, match="split_shares_links.*split_links"):
        old = c10d_ext.Options(split_shares_links=False)
    assert old.split_links is False


def test_options_values_are_validated_like_the_environment():
    import c10d_ext
    from c10d_ext.backend import make_config

    cfg = make_config(c10d_ext.Options(debug="DETAIL", split_links=False, flight_recorder=16), environ={})
    assert (cfg.debug, cfg.split_links, cfg.flight_recorder) == (True, False, 16)
    assert make_config(environ={"MYCCL_DEBUG": "DETAIL", "MYCCL_SPLIT_LINKS": "0"}).debug is True
    with pytest.raises(ValueError, match=r"Options.num_threads=0 is invalid"):
        make_config(c10d_ext.Options(num_threads=0), environ={})


def test_values_are_shown_as_users_write_them():
    from c10d_ext import config

    rows = {name: (value, default) for name, value, default, _ in config.describe(environ={})}
    assert rows["MYCCL_HIERARCHICAL"] == ("auto (default)", "auto")
    assert rows["MYCCL_STREAM_STORE_BYTES"] == ("auto (default)", "auto")
    assert rows["MYCCL_TCP_EAGER_BYTES"][1] == "64K"
    assert rows["MYCCL_DEBUG"][1] == "OFF"
    assert "MYCCL_TEST_CONNECT_DELAY_MS" not in rows  # testing knobs only when set
    rows = {name: value for name, value, _, _ in config.describe(environ={"MYCCL_HIERARCHICAL": "0",
                                                                         "MYCCL_DEBUG": "DETAIL",
                                                                         "MYCCL_SHM_BUFFER_BYTES": "4M"})}
    assert (rows["MYCCL_HIERARCHICAL"], rows["MYCCL_DEBUG"], rows["MYCCL_SHM_BUFFER_BYTES"]) == ("0", "DETAIL", "4M")


def test_info_prints_words_not_codes():
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MYCCL_HIERARCHICAL", None)
    res = subprocess.run([sys.executable, "-m", "c10d_ext.info"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    line = next(l for l in res.stdout.splitlines() if "MYCCL_HIERARCHICAL" in l)
    assert "auto (default)" in line and "-1" not in line, line


_LOGGING = """
import logging, sys
logging.getLogger("c10d_ext").setLevel(logging.DEBUG)
import c10d_ext
print(logging.getLevelName(logging.getLogger("c10d_ext").level))
"""


@pytest.mark.parametrize("env_level, want", [(None, "DEBUG"), ("error", "ERROR")])
def test_import_leaves_the_applications_log_level(env_level, want):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MYCCL_LOG_LEVEL", None)
    if env_level:
        env["MYCCL_LOG_LEVEL"] = env_level
    res = subprocess.run([sys.executable, "-c", _LOGGING], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == want


def test_public_functions_take_group_as_torchs_keyword():
    import c10d_ext

    seen = 0
    for name in c10d_ext.__all__:
        fn = getattr(c10d_ext, name)
        if not inspect.isfunction(fn):
            continue
        params = list(inspect.signature(fn).parameters.values())
        if "group" not in [p.name for p in params]:
            continue
        seen += 1
        g = params[-1]
        assert g.name == "group" and g.default is None, f"c10d_ext.{name}{inspect.signature(fn)}"
    assert seen >= 8


def test_config_doc_is_current():
    from c10d_ext import config

    with open(os.path.join(ROOT, "docs", "CONFIG.md")) as f:
        assert f.read() == config.markdown(), "docs/CONFIG.md is stale: run python scripts/gen_config_doc.py"


# ---- one reader of the configuration -------------------------------------------------------------
# Where MYCCL_* variables may be read: the package only through config.py; the build (setup.py,
# scripts/) its BUILD_VARS; C++ never (it gets a parsed Config). The test suite's own knobs
# (MYCCL_TEST_CUDA_DOUBLE*, MYCCL_TEST_CUDA_WORLD, MYCCL_SOAK_SECONDS, read under tests/) are not
# the product's and are not scanned.
_NAME = r"MYCCL_[A-Z0-9_]+"


def _py_files(*parts):
    import glob

    out = []
    for p in parts:
        path = os.path.join(ROOT, p)
        out += [path] if p.endswith(".py") else sorted(glob.glob(os.path.join(path, "**", "*.py"), recursive=True))
    return out


def _py_reads(path):
    """(direct reads, reads through config.value, every whole MYCCL_* name) of a Python file. A
    read is os.environ.get / os.getenv / env[...] / `in env` of a name, or of a module constant
    holding one; a read through config is a call of a function named `value`."""
    import ast
    import re

    tree = ast.parse(open(path).read(), path)
    consts = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str) and re.fullmatch(_NAME, node.value.value)):
            consts.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})

    def name_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(_NAME, node.value):
            return node.value
        return consts.get(node.id) if isinstance(node, ast.Name) else None

    direct, through, named = set(), set(), set(consts.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and name_of(node):
            named.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg and re.fullmatch(_NAME, node.arg):
            named.add(node.arg)  # dict(env, MYCCL_X=...): set for a child process
        if isinstance(node, ast.Call) and node.args and name_of(node.args[0]):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn in ("get", "getenv"):
                direct.add(name_of(node.args[0]))
            elif fn == "value":
                through.add(name_of(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and name_of(node.slice):
            direct.add(name_of(node.slice))
        elif (isinstance(node, ast.Compare) and name_of(node.left)
              and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)):
            direct.add(name_of(node.left))
    return direct, through, named


def test_the_package_reads_its_variables_through_config_only():
    from c10d_ext import config

    known = config.BY_NAME.keys() | {b.name for b in config.BUILD_VARS}
    for path in _py_files("c10d_ext"):
        rel = os.path.relpath(path, ROOT)
        direct, through, named = _py_reads(path)
        if rel != os.path.join("c10d_ext", "config.py"):
            assert not direct, f"{rel} reads {sorted(direct)} itself: read them through c10d_ext.config.value"
        unknown = (through | named) - known
        assert not unknown, f"{rel} names {sorted(unknown)}, which c10d_ext/config.py's table lacks"


def test_every_variable_read_anywhere_is_in_the_table():
    import glob
    import re

    from c10d_ext import config

    runtime, build = set(config.BY_NAME), {b.name for b in config.BUILD_VARS}
    # Python outside the package: the build, its scripts, the benchmarks and examples.
    for path in _py_files("setup.py", "build_sources.py", "scripts", "benchmarks", "examples"):
        direct, through, _ = _py_reads(path)
        rel = os.path.relpath(path, ROOT)
        known = runtime | build if rel == "setup.py" or rel.startswith("scripts") else runtime
        assert (direct | through) <= known, f"{rel} reads {sorted((direct | through) - known)}: not in config.py"
    # Shell scripts and the Makefile: ${MYCCL_X} / $MYCCL_X.
    for path in sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))) + [os.path.join(ROOT, "Makefile")]:
        reads = set(re.findall(r"\$\{?(" + _NAME + ")", open(path).read()))
        assert reads <= runtime | build, f"{os.path.relpath(path, ROOT)} reads {sorted(reads - runtime - build)}"
    # C++ never reads the environment: it gets a parsed Config (Config.hpp).
    cpp = []
    for path in glob.glob(os.path.join(ROOT, "src", "**", "*.[ch]pp"), recursive=True) + \
            glob.glob(os.path.join(ROOT, "include", "**", "*.hpp"), recursive=True):
        cpp += [(os.path.relpath(path, ROOT), n) for n in
                re.findall(r"getenv\s*\(\s*\"(" + _NAME + ")\"", open(path).read())]
    assert not [c for c in cpp if c[1] not in runtime], f"C++ reads variables config.py lacks: {cpp}"
    assert not cpp, f"C++ reads the environment itself (it gets a parsed Config): {cpp}"
    # setup.py's reads are exactly the build section's.
    direct, _, _ = _py_reads(os.path.join(ROOT, "setup.py"))
    assert direct == build, (sorted(direct), sorted(build))


def test_the_scan_sees_reads(tmp_path):
    """The scan itself: each form of a read is found (else the tests above would pass vacuously)."""
    src = tmp_path / "m.py"
    src.write_text('import os\nK = "MYCCL_A"\nos.environ.get(K)\nos.getenv("MYCCL_B")\nos.environ["MYCCL_C"]\n'
                   '"MYCCL_D" in os.environ\nconfig.value("MYCCL_E")\ndict(MYCCL_F=1)\nos.environ["MYCCL_G"] = "1"\n'
                   'print("set MYCCL_H=1")\n')
    direct, through, named = _py_reads(str(src))
    assert direct == {"MYCCL_A", "MYCCL_B", "MYCCL_C", "MYCCL_D"}
    assert through == {"MYCCL_E"}
    assert named == {"MYCCL_A", "MYCCL_B", "MYCCL_C", "MYCCL_D", "MYCCL_E", "MYCCL_F", "MYCCL_G"}


def test_launcher_variables_are_read_without_the_package(tmp_path):
    """The Horovod launcher's worker wrapper runs horovod/run.py as a file: it reads its variables
    through config.py loaded from its file, and takes its rank table and output tag from them."""
    code = ("import runpy, sys\n"
            "sys.argv = ['run.py']\n"
            f"g = runpy.run_path({os.path.join(ROOT, 'c10d_ext', 'horovod', 'run.py')!r}, run_name='not_main')\n"
            "print(g['slot_env']({'MYCCL_HVD_SLOTS': '3,4,1,2,0,2;5,4,1,2,1,2', 'LOCAL_RANK': '0'}))\n"
            "print(g['_config']().value('MYCCL_HVD_TAG'))\n"
            "print('torch' in sys.modules, 'c10d_ext' in sys.modules)\n")
    env = dict(os.environ, MYCCL_HVD_TAG="7")
    env.pop("PYTHONPATH", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = res.stdout.splitlines()
    assert rows[0] == str({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
                           "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2"})
    assert rows[1:] == ["7", "False False"]
