"""c10d_ext.horovod's engine loop (c10d_ext/horovod/loop.py): one thread per process runs the
cycles of every process set; with two sets of two or more members it runs them in lockstep, one
cycle of each set per iteration in set-id order, so ops of overlapping sets start in one order on
every rank whatever order each rank submitted them in. Each rank's values against local sums."""

from __future__ import annotations

import threading
import time

import torch

from cuda_helpers import DOUBLE
from hvd_helpers import start, stop


def _threads():
    names = [t.name for t in threading.enumerate()]
    return {"loop": names.count("hvd-loop"), "per_set": [n for n in names if n.startswith("hvd-set")]}


def _rounds(ctx, hvd, s, rounds: int) -> dict:
    """Each round: rank 0 submits its G op first, rank 1 its S op first, rank 2 (outside S) only
    G's; then every result (the distinct values of each)."""
    out = {"g": [], "s": []}
    for i in range(rounds):
        g = torch.full((32,), float(ctx.rank + 1 + i))
        x = torch.full((8,), float(10 * (ctx.rank + 1) + i))
        ops = {"g": lambda: hvd.allreduce_async(g, op=hvd.Sum, name=f"g{i}"),
               "s": lambda: hvd.allreduce_async(x, op=hvd.Sum, name=f"s{i}", process_set=s)}
        order = {0: ["g", "s"], 1: ["s", "g"]}.get(ctx.rank, ["g"])
        hs = [(k, ops[k]()) for k in order]
        for k, h in hs:
            out[k].append(sorted(set(hvd.synchronize(h).tolist())))
    return out


def _opposite_orders(ctx, rounds: int = 12):
    """G = every rank, S = ranks 0 and 1. Rank 0 submits each round's G op first, rank 1 its S op
    first, rank 2 (outside S) only G's."""
    from c10d_ext.horovod import loop

    import c10d_ext.horovod as hvd_mod

    s = hvd_mod.ProcessSet([0, 1])
    hvd = start(ctx, process_sets=[s])
    try:
        out = {"lockstep": loop._LOOP[0].lockstep, "threads": _threads()}
        out.update(_rounds(ctx, hvd, s, rounds))
        return out
    finally:
        stop(hvd)


def _expect(rank: int, rounds: int = 12):
    g = [[float(sum(r + 1 + i for r in range(3)))] for i in range(rounds)]
    s = [[float(sum(10 * (r + 1) + i for r in range(2)))] for i in range(rounds)] if rank < 2 else []
    return g, s


def test_one_loop_runs_overlapping_sets_in_lockstep(run):
    for rank, out in enumerate(run(3, _opposite_orders, timeout=120)):
        assert out["lockstep"] is True
        assert out["threads"] == {"loop": 1, "per_set": []}
        assert (out["g"], out["s"]) == _expect(rank)


def _device_order(ctx):
    """The same on the strict CUDA double with device order on: each simulated device runs one
    communicator launch at a time in launch order, so launches of G and S made in different
    orders on ranks 0 and 1 would hang (and the double would report it)."""
    import cuda_double

    td = cuda_double._module()
    out = {}
    from c10d_ext.horovod import loop

    import c10d_ext.horovod as hvd_mod

    s = hvd_mod.ProcessSet([0, 1])
    hvd = start(ctx, process_sets=[s])
    try:
        hvd.allreduce(torch.ones(2), name="warm-up")  # (every set has made its communicator)
        hvd.allreduce(torch.ones(2), name="warm-up-s", process_set=s) if ctx.rank < 2 else None
        td.set_device_order(True)
        out = _rounds(ctx, hvd, s, 12)
        cuda_double.synchronize()
        out["lockstep"] = loop._LOOP[0].lockstep
    finally:
        td.set_device_order(False)
        out["violations"] = cuda_double.violations()
        stop(hvd)
    return out


def test_overlapping_sets_in_opposite_orders_on_the_cuda_double(run):
    env = dict(DOUBLE, MYCCL_TEST_CUDA_DOUBLE_DEVICES="3", MYCCL_TEST_CUDA_DOUBLE_HANG_MS="3000")
    for rank, out in enumerate(run(3, _device_order, timeout=120, world_env=env)):
        assert out["violations"] == [], out["violations"]
        assert out["lockstep"] is True
        assert (out["g"], out["s"]) == _expect(rank)


def _dynamic(ctx):
    """Adding a second set of two or more members turns every rank's loop to lockstep at the same
    cycle of the global set; removing it turns it back, and the fast paths work again."""
    from c10d_ext.horovod import loop

    hvd = start(ctx, process_sets="dynamic")
    try:
        out = {"before": loop._LOOP[0].lockstep}
        hvd.allreduce(torch.ones(3), name="a")
        s = hvd.add_process_set([0, 1])
        out["added"] = loop._LOOP[0].lockstep
        vals = []
        for i in range(5):
            hs = []
            if ctx.rank < 2:
                x = torch.full((4,), float(ctx.rank + i))
                hs.append(hvd.allreduce_async(x, op=hvd.Sum, name=f"s{i}", process_set=s))
            hs.append(hvd.allreduce_async(torch.full((4,), float(i)), op=hvd.Sum, name=f"g{i}"))
            if ctx.rank == 1:
                hs.reverse()
            vals += [sorted(set(hvd.synchronize(h).tolist())) for h in hs]
        out["vals"] = vals
        out["removed"] = hvd.remove_process_set(s)
        out["after"] = loop._LOOP[0].lockstep
        out["last"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="b").tolist()
        return out
    finally:
        stop(hvd)


def test_adding_and_removing_a_set_switches_every_rank_at_once(run):
    size = 3
    for rank, out in enumerate(run(size, _dynamic, timeout=120, world_env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})):
        assert (out["before"], out["added"], out["removed"], out["after"]) == (False, True, True, False)
        want = []
        for i in range(5):
            pair = []
            if rank < 2:
                pair.append([float(0 + i + 1 + i)])
            pair.append([float(size * i)])
            if rank == 1:
                pair.reverse()
            want += pair
        assert out["vals"] == want
        assert out["last"] == [float(size)] * 2


def _busy_outside(ctx):
    """Lockstep: rank 2 (in G only) is busy outside Horovod for longer than the groups' timeout
    while ranks 0 and 1 run ops on S; their iterations need G's cycles with rank 2, which its
    loop takes part in meanwhile."""
    import c10d_ext.horovod as hvd

    ctx.init(timeout=3)  # Horovod's groups take the default group's timeout
    s = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[s])
    try:
        out = []
        if ctx.rank == 2:
            time.sleep(8.0)  # (the groups' timeout is 3 s)
        else:
            for i in range(10):
                out.append(hvd.allreduce(torch.full((2,), float(ctx.rank + i)), op=hvd.Sum, name=f"s{i}",
                                         process_set=s).tolist())
        out.append(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="g").tolist())
        return out
    finally:
        stop(hvd)


def test_a_busy_rank_does_not_time_out_its_peers_in_lockstep(run):
    for rank, out in enumerate(run(3, _busy_outside, timeout=120)):
        s = [[float(2 * i + 1)] * 2 for i in range(10)] if rank < 2 else []
        assert out == s + [[3.0]]
