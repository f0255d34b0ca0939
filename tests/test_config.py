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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
