"""Backend contract pieces of torch 2.14+: abort hooks (run before a group that failed on a
timeout or an error aborts; unregistered ones not) and ephemeral timeouts (added to the ops
created after the call, until the first of them completes)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import Report, assert_reports

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
needs_214 = pytest.mark.skipif(TORCH < (2, 14), reason="abort hooks and ephemeral timeouts are torch 2.14 APIs")


def body_abort_hooks(ctx):
    ctx.init(timeout=1.5)
    rep = Report(ctx)
    pg = dist.group.WORLD
    if TORCH >= (2, 15):
        rep.check(pg.supports_abort_hooks is True, f"supports_abort_hooks is {pg.supports_abort_hooks}")
    calls = []
    pg.register_abort_hook(1, lambda: calls.append("hook 1"))
    pg.register_abort_hook(2, lambda: calls.append("hook 2"))
    pg.register_abort_hook(3, lambda: (_ for _ in ()).throw(RuntimeError("a hook that raises")))
    pg.unregister_abort_hook(2)
    dist.all_reduce(torch.ones(4))  # a good op calls no hook
    rep.check(calls == [], f"hooks ran without a failure: {calls}")
    if ctx.rank == 1:
        time.sleep(4)  # misses the next all_reduce's timeout on rank 0
        return rep.result()
    err, seen_at_raise = "", None
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        err, seen_at_raise = str(e), list(calls)  # what had run when the error reached the caller
    rep.check("Timed out" in err, f"all_reduce did not time out: {err}")
    rep.check(calls == ["hook 1"], f"hooks run: {calls}")
    rep.check(seen_at_raise == ["hook 1"], f"the hook had not run when the error was raised: {seen_at_raise}")
    return rep.result()


@needs_214
def test_abort_hooks_run_before_a_failed_group_aborts(run):
    assert_reports(run(2, body_abort_hooks, timeout=60))


def body_ephemeral(ctx):
    ctx.init(timeout=1.0)
    rep = Report(ctx)
    dist.all_reduce(torch.ones(2))
    dist.distributed_c10d._add_ephemeral_timeout_for_all_pgs(timedelta(seconds=4))
    # the first op after the call gets 1 s + 4 s: a peer 2 s late is waited for
    if ctx.rank == 1:
        time.sleep(2)
    x = torch.ones(2)
    try:
        dist.all_reduce(x)
        rep.check(torch.equal(x, torch.full((2,), 2.0)), f"extended all_reduce: {x.tolist()}")
    except Exception as e:  # noqa: BLE001
        rep.fail(f"the extended op timed out: {e}")
        return rep.result()
    dist.barrier()
    # that op completed: the extension is gone, a peer 2.5 s late now misses the 1 s timeout
    if ctx.rank == 1:
        time.sleep(2.5)
        return rep.result()
    try:
        dist.all_reduce(torch.ones(2))
        rep.fail("the op after the extension expired did not time out")
    except Exception as e:  # noqa: BLE001
        rep.check("Timed out after 1000 ms" in str(e), f"after expiry: {e}")
    return rep.result()


@needs_214
def test_ephemeral_timeout_lasts_until_the_next_op_completes(run):
    assert_reports(run(2, body_ephemeral, timeout=60))
