"""What the CUDA tests share: the two kinds of world they run in (ranks sharing a real GPU, and the
strict CUDA double with CPU tensors standing for CUDA ones), the `mode` parameter that picks one,
and the per-rank helpers that select a device, synchronise and collect the double's violations.
Every test module of the CUDA engine, and the layers' CUDA tests, import them from here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from harness import SHARED_GPU

# A world of its own for fault injection: an aborted communicator must not leak into other tests.
FAULT_WORLD = dict(SHARED_GPU, MYCCL_TEST_WORLD="faults")

DOUBLE_DEVICES = 2
# The strict double: each rank's stream delays seeded differently; a hang is reported after 20 s
# (every test that expects a peer to be missing uses a shorter group timeout).
DOUBLE = {
    "MYCCL_TEST_CUDA_DOUBLE": "1",
    "MYCCL_TEST_CUDA_DOUBLE_SEED": "1{rank}",
    "MYCCL_TEST_CUDA_DOUBLE_DEVICES": str(DOUBLE_DEVICES),
    "MYCCL_TEST_CUDA_DOUBLE_HANG_MS": "20000",
}
DOUBLE_FAULTS = dict(DOUBLE, MYCCL_TEST_WORLD="faults")

WORLD = {"gpu": SHARED_GPU, "double": DOUBLE}
FAULTS = {"gpu": FAULT_WORLD, "double": DOUBLE_FAULTS}
MODES = [pytest.param("double", id="double"), pytest.param("gpu", id="gpu", marks=pytest.mark.cuda)]


def double_world() -> dict:
    """The double's world env; skips the test where the double is not built (MYCCL_BUILD_TESTS=1)."""
    import cuda_double

    if not cuda_double.available():
        pytest.skip("the CUDA test double is not built (MYCCL_BUILD_TESTS=1)")
    return DOUBLE


# ---- run inside the rank processes -------------------------------------------------------------

class Report(harness.Report):
    """harness.Report, plus: under the double, every strictness violation is a failure."""

    def __init__(self, ctx, mode="gpu"):
        super().__init__(ctx)
        self.mode = mode
        if mode == "double":
            import cuda_double

            cuda_double.clear_violations()

    def result(self):
        if self.mode == "double":
            # Whatever the engine did that real CUDA/NCCL would hang on or get wrong.
            import cuda_double

            sync(self.mode)
            for v in cuda_double.violations():
                self.failures.append(f"rank {self.rank}: strict double: {v}")
            self.checks += 1
        return self.checks, self.failures


def _device(ctx, mode="gpu", index=None) -> torch.device:
    """Selects this rank's device: the double's devices alternate between ranks (its CUDA tensors
    are CPU tensors), ranks on GPUs take them in turn."""
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % DOUBLE_DEVICES if index is None else index)
        return torch.device("cpu")
    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count() if index is None else index)
    torch.cuda.set_device(dev)
    return dev


def sync(mode="gpu"):
    if mode == "double":
        import cuda_double

        cuda_double.synchronize()
    else:
        torch.cuda.synchronize()


def _init(ctx, compare: bool = False, timeout: float = 120.0, mode: str = "gpu", **options):
    """myccl as the default group, and torch's "nccl" (gloo under the double) on the same ranks."""
    import c10d_ext

    dev = _device(ctx, mode)
    ctx.init(timeout=timeout, pg_options=c10d_ext.Options(**options) if options else None)
    ref = dist.new_group(backend="gloo" if mode == "double" else "nccl") if compare else None
    return dev, ref


def counters(mode) -> dict:
    """The double's counters (communicators made, events, mapped memory...); empty on a GPU."""
    if mode != "double":
        return {}
    import cuda_double

    return cuda_double.counters()
