import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from harness import WorldPool  # noqa: E402

_POOL = WorldPool()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than ~20 s")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "cuda" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def worlds():
    yield _POOL
    _POOL.close()


@pytest.fixture
def run(worlds):
    """run(size, fn, *args, timeout=..., env=...) -> per-rank results, on a reused world."""

    def _run(size, fn, *args, timeout=90.0, env=None, world_env=None, expect_dead=()):
        w = worlds.get(size, world_env)
        return w.run(fn, *args, timeout=timeout, env=env, expect_dead=expect_dead)

    return _run
