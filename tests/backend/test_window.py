"""One-sided windows (torch 2.15's Window API) on CPU groups: puts and signals between every pair,
UNIFIED views of local peers' windows in shared memory, SEPARATE windows over TCP, bounds and
dtype errors, deregistration that drains the puts in flight."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from expect import make
from harness import Report, assert_reports

pytestmark = pytest.mark.skipif(not hasattr(dist.distributed_c10d, "_new_window"),
                                reason=f"torch {torch.__version__} has no window API")

WACCESS = None


def _access():
    from torch._C._distributed_c10d import WindowAccessType

    return WindowAccessType


def body_ring(ctx, shared: bool, count: int):
    """Every rank puts its block into the next rank's window at its own offset, signals it, and
    waits for the previous rank's signal; then its window holds the previous rank's block."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    rep.check(pg.supports_window, "supports_window")
    rounds = 3
    if shared:
        buf = be.allocate_tensor(count * n * rounds, dtype=torch.float32, device=torch.device("cpu"))
        buf.zero_()
    else:
        buf = torch.zeros(count * n * rounds)
    win = dist.distributed_c10d._new_window()
    win.tensor_register(buf)
    nxt, prv = (r + 1) % n, (r - 1) % n
    mine = make(r, (count,), torch.float32, 5)

    def block(it, q):  # where rank q's put of round `it` lands in its target's window
        return slice((it * n + q) * count, (it * n + q + 1) * count)

    for it in range(rounds):
        w = win.put(mine + it, nxt, block(it, r).start, it % 2 == 1)
        if it % 2 == 1:
            w.wait()
        win.signal(nxt, False)
        win.wait_signal(prv, it == 2).wait()
        rep.check(torch.equal(buf[block(it, prv)], make(prv, (count,), torch.float32, 5) + it),
                  f"round {it}: block from rank {prv}")
    local = be.local_ranks
    for q in range(n):
        attr = win.get_attr(q).access_type
        unified = q == r or (shared and q in local and be.uses_shared_memory)
        rep.check(attr == (_access().UNIFIED if unified else _access().SEPARATE), f"get_attr({q}) = {attr}")
        if unified and q != r:
            view = win.map_remote_tensor(q)
            dist.barrier()
            rep.check(view.numel() == count * n * rounds and
                      torch.equal(view[block(2, (q - 1) % n)], make((q - 1) % n, (count,), torch.float32, 5) + 2),
                      f"map_remote_tensor({q}) shows rank {q}'s window")
            dist.barrier()
        elif q != r:
            try:
                win.map_remote_tensor(q)
                rep.fail(f"map_remote_tensor({q}) of a SEPARATE window did not raise")
            except ValueError as e:
                rep.check("cannot be mapped here" in str(e), f"map_remote_tensor({q}): {e}")
    win.tensor_deregister()
    return rep.result()


@pytest.mark.parametrize("shared", [True, False], ids=["unified", "separate"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_window_ring(run, size, shared):
    assert_reports(run(size, body_ring, shared, 1000, timeout=120))


def test_window_large_puts_over_tcp(run):
    # 3 MiB puts: past the eager limit (the owner's chain posts the payload's receive, then CTS)
    assert_reports(run(2, body_ring, False, 3 << 18, timeout=120))


def body_all_to_all(ctx):
    """Every rank puts into every rank's window (itself included), with signals; then
    deregistration drains puts still on their way: a put just before tensor_deregister lands."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    buf = torch.full((n * 8,), -1.0)  # [0, 4n): the all-to-all; [4n, 8n): the puts before deregistering
    win = dist.distributed_c10d._new_window(buf)  # registered at creation
    for q in range(n):
        win.put(torch.full((4,), float(r * 10 + q)), q, r * 4, True)
    for q in range(n):
        win.signal(q, True)
    for q in range(n):
        win.wait_signal(q, False)
    rep.check(all(torch.equal(buf[q * 4:(q + 1) * 4], torch.full((4,), float(q * 10 + r))) for q in range(n)),
              f"window after all-to-all puts: {buf.tolist()}")
    # puts right before deregistering, no signal: deregister waits for them
    win.put(torch.full((4,), 99.0 + r), (r + 1) % n, n * 4 + r * 4, False)
    win.tensor_deregister()
    prv = (r - 1) % n
    rep.check(torch.equal(buf[n * 4 + prv * 4:n * 4 + (prv + 1) * 4], torch.full((4,), 99.0 + prv)),
              "put just before deregister landed")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_window_all_to_all_and_deregister(run, size):
    assert_reports(run(size, body_all_to_all, timeout=120))


def body_errors(ctx):
    ctx.init(timeout=5)
    rep = Report(ctx)
    n = ctx.size
    win = dist.distributed_c10d._new_window()

    def expect(fn, words, what):
        try:
            fn()
            rep.fail(f"{what}: no error")
        except (ValueError, RuntimeError) as e:
            rep.check(all(w in str(e) for w in words), f"{what}: {e}")

    expect(lambda: win.put(torch.ones(2), 0, 0, False), ["put", "no tensor is registered"], "put before register")
    expect(lambda: win.tensor_register(torch.ones(4, 4).t()), ["contiguous"], "non-contiguous")
    win.tensor_register(torch.zeros(10))
    expect(lambda: win.tensor_register(torch.zeros(3)), ["already registered"], "second register")
    expect(lambda: win.put(torch.ones(5), n, 0, False), ["rank " + str(n), "not in [0, "], "bad rank")
    expect(lambda: win.put(torch.ones(5), 0, 6, False), ["do not fit", "window of 10 elements"], "out of bounds")
    expect(lambda: win.put(torch.ones(5), 0, -1, False), ["negative"], "negative offset")
    expect(lambda: win.put(torch.ones(5, dtype=torch.float64), 0, 0, False), ["float64", "float32"], "dtype")
    # wait_signal with nobody signalling: Timed out, and the window goes on
    try:
        win.wait_signal((ctx.rank + 1) % n, False)
        rep.fail("wait_signal without a signal returned")
    except Exception as e:  # noqa: BLE001
        rep.check("Timed out" in str(e), f"wait_signal timeout: {e}")
    win.put(torch.ones(10), ctx.rank, 0, False)
    win.tensor_deregister()
    return rep.result()


def test_window_errors(run):
    assert_reports(run(2, body_errors, timeout=90))
