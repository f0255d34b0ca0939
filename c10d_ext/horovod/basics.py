"""Horovod's state in this process (``STATE``: its world, groups and what the next ``init``
needs) and the topology and build queries (``rank``, ``size``, ``local_rank``, ..., ``nccl_built``).
``init`` and ``shutdown`` are in lifecycle.py, which every other module of the layer stands below;
this module stands below all of them.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

from . import launch_env
from .exceptions import NOT_INITIALIZED


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.initialized = False
        self.made_default = False  # hvd created the default group (and destroys it at exit)
        self.group = None  # the myccl group of Horovod's global process set (its controller's)
        self.admin = None  # same ranks: the caller thread's own collectives (topology, registration)
        self.torch_ranks: list[int] = []  # hvd rank -> default-group rank
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.cross_rank = 0
        self.cross_size = 1
        self.homogeneous = True
        self.lost_rank = False  # a collective failed for a lost peer: the next init shrinks
        self.failed_group = None  # the group that saw it: the survivors meet through its store
        self.failed_default = None  # the default group then (shrunk by the next init)
        self.timeout = timedelta(minutes=30)
        self.group_timeout = None  # Horovod's groups' op timeout: the default group's (init)
        self.atexit = False
        # The job's store (a TCPStore; its server, where this process hosts it, stays up while
        # Horovod resets): later default groups are made on it, and processes join through it.
        self.job_store = None
        self.world = None  # (rank, size) of the last default group Horovod made and destroyed
        self.generation = 0  # the world's generation: 0 as launched, then one per admission (join.py)
        self.incarnation = 0  # default groups made on job_store in this generation (the same on every member)
        self.join = None  # (generation, members) admitted at a commit: the next init makes it


STATE = _State()


def _rendezvous() -> tuple[str | None, int | None]:
    return launch_env.rendezvous(os.environ)


def _timeout() -> timedelta:
    seconds = os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")
    # Horovod's 30 s is for its rendezvous; the groups' own op timeout stays torch's default.
    return timedelta(seconds=max(30, int(seconds))) if seconds else timedelta(minutes=30)


def is_initialized() -> bool:
    return STATE.initialized


def _check() -> _State:
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)
    return STATE


def size() -> int:
    return _check().size


def rank() -> int:
    return _check().rank


def local_size() -> int:
    return _check().local_size


def local_rank() -> int:
    return _check().local_rank


def cross_size() -> int:
    return _check().cross_size


def cross_rank() -> int:
    return _check().cross_rank


def is_homogeneous() -> bool:
    return _check().homogeneous


def mpi_threads_supported() -> bool:
    raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    """Horovod's gloo controller is the one this layer behaves as; no gloo library is involved."""
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """NCCL_VERSION_CODE of the NCCL myccl's CUDA engine was built with, or 0 without one."""
    import c10d_ext

    info = c10d_ext.build_info()
    if not info.get("with_nccl"):
        return 0
    major, minor, patch = (int(x) for x in info.get("nccl_build_header", "0.0.0").split(".")[:3])
    # NCCL's own encoding: from 2.9 on major*10000 + minor*100 + patch, before major*1000 + ...
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    import c10d_ext

    return bool(c10d_ext.build_info().get("with_nccl"))


def rocm_built() -> bool:
    return False
