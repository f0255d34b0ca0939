"""The strict CUDA test double, for tests: installs it in this process and wraps its hooks.

Under the double (c10d_ext._test_double, a test-only extension built with MYCCL_BUILD_TESTS=1),
CPU tensors stand for CUDA tensors and the CUDA engine runs on simulated devices whose streams are
worker threads and whose NCCL moves data through the store. Where real CUDA or NCCL would hang or
misbehave, the double records a violation instead; tests assert that none was recorded.

A process that sets MYCCL_TEST_CUDA_DOUBLE=1 gets it installed by the harness (harness._worker);
MYCCL_TEST_CUDA_DOUBLE_{DEVICES,SEED,DELAY_US,EAGER_BYTES,HANG_MS,CAPABILITY,ABORT_MS} shape the
simulated machine (these knobs are the tests', not the product's).
"""

from __future__ import annotations

import os


def _module():
    try:
        from c10d_ext import _test_double
    except ImportError as e:
        raise RuntimeError(
            "the CUDA test double is not built: rebuild with MYCCL_BUILD_TESTS=1 (scripts/setup.sh does)"
        ) from e
    return _test_double


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20)):
        if raw.upper().endswith(suffix):
            raw, mult = raw[:-1], m
    return int(raw, 0) * mult


def available() -> bool:
    try:
        _module()
    except RuntimeError:
        return False
    return True


def install() -> None:
    """Makes this process's simulated machine from the environment and makes every myccl group's
    CUDA engine run on it (CPU tensors standing for CUDA tensors)."""
    from c10d_ext import _C

    td = _module()
    capsule = td.configure(
        _int("MYCCL_TEST_CUDA_DOUBLE_DEVICES", 2),
        _int("MYCCL_TEST_CUDA_DOUBLE_SEED", 0),
        _int("MYCCL_TEST_CUDA_DOUBLE_DELAY_US", 100),
        _int("MYCCL_TEST_CUDA_DOUBLE_EAGER_BYTES", 64 * 1024),
        _int("MYCCL_TEST_CUDA_DOUBLE_HANG_MS", 10000),
        _int("MYCCL_TEST_CUDA_DOUBLE_CAPABILITY", 90),
        _int("MYCCL_TEST_CUDA_DOUBLE_ABORT_MS", 100),
    )
    _C._install_cuda_platform(capsule)


def set_device(index: int) -> None:
    """The calling thread's simulated device (torch.cuda.set_device)."""
    _module().set_device(int(index))


def current_device() -> int:
    return _module().current_device()


def new_stream() -> int:
    """A new stream on the calling thread's simulated device (torch.cuda.Stream()); its id."""
    return _module().new_stream()


def current_stream() -> int:
    """The id of the calling thread's current stream on its device (0: the default stream)."""
    return _module().current_stream()


def set_stream(stream_id: int) -> None:
    """Makes stream `stream_id` of the calling thread's device its current stream
    (torch.cuda.set_stream); tensor ops still run on the host, engine work lands on it."""
    _module().set_stream(int(stream_id))


def synchronize() -> None:
    """Waits until every simulated stream has run what it holds (torch.cuda.synchronize)."""
    _module().synchronize()


def violations() -> list[str]:
    """Every strictness violation recorded in this process so far, in order."""
    return list(_module().violations())


def clear_violations() -> None:
    _module().clear_violations()


def hold_memory_releases(on: bool) -> None:
    """While on, releases of shared device memory and host registrations stay queued (their
    device synchronisation waits); off lets them run."""
    _module().hold_memory_releases(bool(on))


def counters() -> dict[str, int]:
    """Facts about what the engine asked of the double (communicators made, premul residences...)."""
    return dict(_module().counters())
