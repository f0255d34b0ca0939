"""Hooks into the strict CUDA test double (MYCCL_TEST_CUDA_DOUBLE=1), for tests.

Under the double, CPU tensors stand for CUDA tensors and the CUDA engine runs on simulated
devices whose streams are worker threads and whose NCCL moves data through the store. Where
real CUDA or NCCL would hang or misbehave, the double records a violation instead; tests assert
that none was recorded. The machine is made from the MYCCL_TEST_CUDA_DOUBLE_* variables.
"""

from __future__ import annotations

from . import _C
from .backend import make_config


def set_device(index: int) -> None:
    """The calling thread's simulated device (torch.cuda.set_device)."""
    _C._cuda_double_set_device(int(index), make_config())


def current_device() -> int:
    return _C._cuda_double_current_device(make_config())


def new_stream() -> int:
    """A new stream on the calling thread's simulated device (torch.cuda.Stream()); its id."""
    return _C._cuda_double_new_stream(make_config())


def current_stream() -> int:
    """The id of the calling thread's current stream on its device (0: the default stream)."""
    return _C._cuda_double_current_stream(make_config())


def set_stream(stream_id: int) -> None:
    """Makes stream `stream_id` of the calling thread's device its current stream
    (torch.cuda.set_stream); tensor ops still run on the host, engine work lands on it."""
    _C._cuda_double_set_stream(int(stream_id), make_config())


def synchronize() -> None:
    """Waits until every simulated stream has run what it holds (torch.cuda.synchronize)."""
    _C._cuda_double_synchronize(make_config())


def violations() -> list[str]:
    """Every strictness violation recorded in this process so far, in order."""
    return list(_C._cuda_double_violations(make_config()))


def clear_violations() -> None:
    _C._cuda_double_clear_violations(make_config())


def counters() -> dict[str, int]:
    """Facts about what the engine asked of the double (communicators made, premul residences...)."""
    return dict(_C._cuda_double_counters(make_config()))
