"""c10d_ext: the "myccl" torch.distributed backend.

``import c10d_ext`` registers the backend; then ``dist.init_process_group("myccl")`` works
wherever "gloo" or "nccl" does. CPU tensors travel over myccl's own transports, CUDA tensors
over NCCL.
"""

from __future__ import annotations

import atexit as _atexit
import logging as _logging

import torch

try:
    from ._build_info import BUILD_INFO as _BUILD_INFO
except ImportError:  # pragma: no cover - source tree without a build
    raise ImportError(
        "c10d_ext is not built: run `pip install --no-build-isolation .` in the source tree"
    ) from None


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _rebuild_command() -> str:
    import os
    import sys

    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(src, "setup.py")):  # a source tree (editable install)
        return f"{sys.executable} -m pip install --no-build-isolation --no-deps -e {src}"
    return (f"{sys.executable} -m pip install --no-build-isolation --no-deps --force-reinstall "
            "<the c10d_ext source tree>")


# The ABI guard: c10d's C++ classes have no stable ABI, so a build is for one torch minor release.
if _minor(torch.__version__) != _BUILD_INFO["torch_minor"]:
    raise ImportError(
        f"c10d_ext {_BUILD_INFO.get('version', '')} was built for torch {_BUILD_INFO['torch_version']} but "
        f"torch {torch.__version__} is installed, and c10d's C++ API has no stable ABI across torch "
        f"releases. Rebuild it against this torch: {_rebuild_command()}"
    )

__version__ = _BUILD_INFO.get("version", "0+unknown")

import torch.distributed as dist  # noqa: E402

from . import _C  # noqa: E402
from . import trace  # noqa: E402
from .backend import Options, create_backend  # noqa: E402
from .config import parse_env as _parse_env  # noqa: E402

BACKEND_NAME = "myccl"

if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


# batch_isend_irecv and coalesced collectives: a block whose body raises leaves nothing behind.
from . import _coalescing  # noqa: E402

_coalescing.install()

_env = _parse_env()
if _env["trace"]:
    trace.start(_env["trace"])

# C++ messages go to the "c10d_ext" logger. Its level is the application's to set (Python's
# default shows warnings and errors); only MYCCL_LOG_LEVEL sets one here.
logger = _logging.getLogger("c10d_ext")
if _env["log_level"]:
    logger.setLevel(_env["log_level"].upper())
_C.set_log_level(logger.getEffectiveLevel())
_C.set_log_sink(lambda level, msg: logger.log(level, msg))
_atexit.register(_C.set_log_sink, None)


def build_info() -> dict:
    """What this build contains: torch it was built for, NCCL, kernels, compiler flags."""
    info = dict(_BUILD_INFO)
    info.update(_C.build_info())
    return info


__all__ = ["BACKEND_NAME", "Options", "build_info"]


def _myccl_backend(group=None):
    g = group if group is not None else dist.group.WORLD
    if g is None:
        raise RuntimeError("myccl: no process group: call dist.init_process_group('myccl') first")
    be = g._get_backend(torch.device("cpu"))
    if not isinstance(be, _C.MycclBackend):
        raise ValueError(f"myccl: group {g} does not use the myccl backend (it uses {type(be).__name__})")
    return be


def stats(group=None) -> dict:
    """Per op and algorithm: count, bytes and cumulative seconds of the ops run on `group`
    (default: the world). Keys are "op/algorithm"."""
    out = {}
    for op, algo, count, nbytes, seconds in _myccl_backend(group).stats():
        out[f"{op}/{algo}"] = {"op": op, "algorithm": algo, "count": count, "bytes": nbytes, "seconds": seconds}
    return out


def reset_stats(group=None) -> None:
    _myccl_backend(group).reset_stats()


def link_model(group=None) -> dict | None:
    """What MYCCL_HIERARCHICAL=auto measured and chose for `group` (default: the world), or None
    before its first op with a two-level version (and when the choice was forced or there is
    none to make). Keys: hierarchical (the choice), declared (the link rate came from
    MYCCL_LINK_MBIT), link_bytes_per_s (one host's link, its ranks sending at once; the slowest
    host), local_bytes_per_s (what a rank takes in from its host's ranks through shared memory;
    the slowest rank), hosts, ranks_per_host, seconds and bytes (what measuring cost this rank)."""
    m = _myccl_backend(group).link_model()
    if not m:
        return None
    out = dict(m)
    for key in ("hierarchical", "declared"):
        out[key] = bool(out[key])
    for key in ("hosts", "bytes"):
        out[key] = int(out[key])
    return out


__all__ += ["stats", "reset_stats", "link_model"]


def shared_tensor(shape, dtype: torch.dtype = torch.float32, group=None) -> torch.Tensor:
    """A CPU tensor held once per host and mapped by every rank of `group` on that host.

    Collective: every rank of the group calls it, in the same order as its other
    shared_tensor calls. The tensor starts zero-filled; a write by one rank is visible to the
    other ranks of its host after a barrier (ranks on other hosts have their own copy). Good
    for large read-mostly data (embedding tables, datasets) that would otherwise be loaded
    once per rank.
    """
    if isinstance(shape, int):
        shape = [shape]
    return _myccl_backend(group).shared_tensor(list(shape), dtype)


__all__ += ["shared_tensor"]


def local_rank(group=None) -> int:
    """This rank's index among the group's ranks on this host (Horovod's local_rank)."""
    return _myccl_backend(group).local_rank


def local_size(group=None) -> int:
    """How many of the group's ranks share this host."""
    return _myccl_backend(group).local_size


def cross_rank(group=None) -> int:
    """This host's index among the group's hosts (hosts numbered by their lowest rank)."""
    return _myccl_backend(group).cross_rank


def cross_size(group=None) -> int:
    """How many hosts the group spans."""
    return _myccl_backend(group).cross_size


__all__ += ["local_rank", "local_size", "cross_rank", "cross_size"]


def survivors(timeout=None, group=None) -> list[int]:
    """After a failure, the ranks of `group` that are still running, the same list on every one.

    Collective among the survivors: each calls it (typically where it caught the error of a
    failed op) and gets the group ranks that called it within `timeout` (a timedelta or
    seconds; default: the group's timeout). Ranks this rank saw die are not waited for, so
    when a process was killed the survivors settle at once; a rank that is silent but not known
    to be dead is waited for until the timeout. A rank that arrives after the others settled
    raises: it is not part of the group that goes on. Meets through the group's store, so it
    works on a group whose links a failure closed. Then, on torch 2.14 or newer:

        alive = c10d_ext.survivors()
        dist.shrink_group([r for r in range(dist.get_world_size()) if r not in alive])
    """
    ms = 0
    if timeout is not None:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        if seconds <= 0:
            raise ValueError(f"myccl: survivors: timeout must be positive, got {timeout!r}")
        ms = max(1, int(seconds * 1000))
    import datetime as _dt

    return list(_myccl_backend(group).survivors(_dt.timedelta(milliseconds=ms)))


def vanished_ranks(group=None) -> list[int]:
    """The ranks of `group` whose process this rank saw die: their links ended without a word
    (not ranks that left orderly or reported a failure of their own)."""
    return list(_myccl_backend(group).vanished_ranks)


__all__ += ["survivors", "vanished_ranks"]


from . import hooks  # noqa: E402
from .ddp import DistributedDataParallel  # noqa: E402

__all__ += ["DistributedDataParallel", "hooks"]
