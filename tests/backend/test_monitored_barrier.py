"""monitored_barrier with gloo's semantics and words: every rank passes when all call it; rank 0
names the first rank that did not arrive in time (or, with wait_all_ranks, every one of them);
the ranks that did arrive say they reached it and rank 0 failed them. The same assertions run
against gloo, so the words are gloo's. Unlike gloo's (whose pairs time out and close), a myccl
group's collectives are still in step and correct afterwards."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import Report, assert_reports

TORCH_2_14 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)


def monitored_barrier(timeout: float, wait_all_ranks: bool = False) -> None:
    # dist.monitored_barrier accepts any CPU backend from torch 2.14; before, only gloo by name,
    # while the ProcessGroup method (what it calls) works for every backend.
    if TORCH_2_14:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=wait_all_ranks)
    else:
        dist.group.WORLD.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=wait_all_ranks)


def body_all_arrive(ctx, backend):
    ctx.init(backend=backend, timeout=30)
    rep = Report(ctx)
    for k in range(3):
        monitored_barrier(10)  # raises if some rank is reported missing
    # a rank that arrives late, within the timeout, is waited for
    if ctx.rank == ctx.size - 1:
        time.sleep(0.5)
    monitored_barrier(10, wait_all_ranks=True)
    x = torch.full((5,), float(ctx.rank + 1))
    dist.all_reduce(x)
    rep.check(torch.equal(x, torch.full((5,), float(sum(range(1, ctx.size + 1))))), f"all_reduce after: {x.tolist()}")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_passes(run, size):
    assert_reports(run(size, body_all_arrive, "myccl", timeout=90))


def body_missing(ctx, backend, missing, wait_all):
    ctx.init(backend=backend, timeout=30)
    err = ""
    if ctx.rank in missing:
        time.sleep(2.5)  # never calls monitored_barrier; joins the collective below
    else:
        try:
            monitored_barrier(1.0, wait_all_ranks=wait_all)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    if backend == "gloo":
        return err, None  # gloo's group is broken after a failed monitored barrier; ours is not
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x)
    return err, x.tolist()


@pytest.mark.parametrize("backend", ["myccl", "gloo"])
def test_first_missing_rank_is_named(run, backend):
    out = run(3, body_missing, backend, [2], False, timeout=90)
    e0, e1 = out[0][0], out[1][0]
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in e0, e0
    assert "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0" in e1, e1
    assert out[2][0] == "", out[2]
    # the group is still in step: a collective after the failed barrier is correct everywhere
    # (gloo's pairs time out and close instead)
    if backend == "myccl":
        assert all(x == [6.0, 6.0, 6.0] for _, x in out), out


@pytest.mark.parametrize("backend", ["myccl", "gloo"])
def test_wait_all_ranks_names_every_missing_rank(run, backend):
    out = run(4, body_missing, backend, [1, 3], True, timeout=90)
    e0 = out[0][0]
    assert "Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms" in e0, e0
    assert "Rank 2 successfully reached monitoredBarrier" in out[2][0], out[2][0]
    if backend == "myccl":
        assert all(x == [10.0] * 3 for _, x in out), out


def body_bad_timeout(ctx):
    ctx.init(timeout=30)
    try:
        dist.group.WORLD.monitored_barrier(timeout=timedelta(seconds=-1))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_negative_timeout_is_refused(run):
    for msg in run(2, body_bad_timeout, timeout=60):
        assert "timeout" in msg, msg


def body_zero_timeout(ctx, backend):
    """torch's test_monitored_barrier_gloo_rank_0_timeout: a zero timeout is valid, and rank 0,
    alone in the barrier, reports at once that it timed out."""
    ctx.init(backend=backend, timeout=30)
    err = ""
    if ctx.rank == 0:
        try:
            dist.group.WORLD.monitored_barrier(timeout=timedelta(seconds=0))
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    if backend == "gloo":
        return err, None
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x)
    return err, x.tolist()


@pytest.mark.parametrize("backend", ["myccl", "gloo"])
def test_zero_timeout_times_out_at_once_on_rank_0(run, backend):
    out = run(2, body_zero_timeout, backend, timeout=90)
    assert "Rank 0 timed out in monitoredBarrier" in out[0][0], out[0][0]
    assert out[1][0] == "", out[1]
    if backend == "myccl":
        assert all(x == [3.0] * 3 for _, x in out), out  # the group stays in step
