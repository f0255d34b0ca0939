"""c10d_ext.horovod at the edges a real job meets: join with every collective whichever rank joins
first, the same answer from join() everywhere, unnamed ops named after their own handle, new
tensors as results, one fusion threshold and one choice of the agreed step per set, poll's
progress, and no torch warning caused by the layer's own calls."""

from __future__ import annotations

import pytest
import torch

from harness import Logged
from hvd_helpers import start, stop

JOIN_ERRORS = {
    "allgather": "Allgather is not supported with Join at this time.",
    "broadcast": "Broadcast is not supported with Join at this time.",
    "alltoall": "Alltoall is not supported with Join at this time.",
    "reducescatter": "Reducescatter is not supported with Join at this time.",
}


# ---- join -----------------------------------------------------------------------------------------
def _join_rounds(ctx):
    """Every rank joins first in turn. The others run one of each collective meanwhile, unnamed
    (so their handle numbers, and the names made of them, differ from the joined rank's), then
    join. Returns per round: the outcome of each op and what join() returned."""
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    rounds = []
    try:
        for first in range(n):
            got = {}
            if r != first:
                t = torch.full((n * 2, 3), float(r + 1))
                got["allreduce"] = hvd.allreduce(t, op=hvd.Sum, name=f"ar{first}").tolist()
                got["allreduce_avg"] = hvd.allreduce(t, name=f"avg{first}").tolist()
                got["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([t, t[0]], op=hvd.Sum, name=f"gr{first}")]
                ops = {
                    "allgather": lambda: hvd.allgather(t),
                    "broadcast": lambda: hvd.broadcast(t, root_rank=(first + 1) % n),
                    "alltoall": lambda: hvd.alltoall(t),
                    "reducescatter": lambda: hvd.reducescatter(t),
                }
                for kind, fn in ops.items():
                    try:
                        fn()
                        got[kind] = "returned"
                    except RuntimeError as e:  # HorovodInternalError
                        got[kind] = str(e)
            got["last"] = hvd.join()
            got["every_last"] = hvd.allgather_object(got["last"])
            got["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"after{first}").tolist()
            rounds.append(got)
        return rounds
    finally:
        stop(hvd)


@pytest.mark.parametrize("n", [3, 4])
def test_join_with_every_collective_each_rank_joining_first(run, n):
    """Horovod's test_horovod_join_* at 3 and 4 ranks: allreduces sum the others' tensors (the
    joined rank adds zeros; Average still divides by the set's size), every other collective fails
    with Horovod's message, and join() returns the same rank on every rank, never the first to
    join. Before, the second round hung at 4 ranks: the unnamed allgathers of the ranks still
    working had different names, and the joined rank was not counted for them."""
    results = run(n, _join_rounds, timeout=240)
    for first in range(n):
        others = [q for q in range(n) if q != first]
        total = float(sum(q + 1 for q in others))
        lasts = {results[q][first]["last"] for q in range(n)}
        assert len(lasts) == 1, (first, [results[q][first]["last"] for q in range(n)])
        last = lasts.pop()
        assert last != first and last in others, (first, last)
        for q in range(n):
            got = results[q][first]
            assert got["every_last"] == [last] * n
            assert got["after"] == [float(n)] * 2
            if q == first:
                continue
            assert got["allreduce"] == [[total] * 3] * (n * 2), (q, first)
            avg = (torch.tensor(total) * (1.0 / n)).item()  # Horovod's Average: the sum scaled by 1/n, in float32
            assert got["allreduce_avg"] == [[avg] * 3] * (n * 2)
            assert got["grouped"] == [[[total] * 3] * (n * 2), [total] * 3]
            for kind, msg in JOIN_ERRORS.items():
                assert got[kind].startswith(msg), (q, first, kind, got[kind])


# ---- names and handles ----------------------------------------------------------------------------
def _threads_unnamed(ctx, per_thread):
    import sys
    import threading

    hvd = start(ctx)
    r = hvd.rank()
    errors, handles, values = [], [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        def body():
            try:
                for _ in range(per_thread):
                    # prescale: not held, so each op is named and queued in Python
                    h = hvd.allreduce_async(torch.full((4,), float(r + 1)), op=hvd.Sum, prescale_factor=2.0)
                    handles.append(h)
                    values.append(hvd.synchronize(h).tolist())
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=body) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"errors": errors, "handles": handles, "values": values}
    finally:
        sys.setswitchinterval(old)
        stop(hvd)


def test_unnamed_ops_from_two_threads_are_named_after_their_own_handles(run):
    """An op takes its handle number first and is named after it: two threads issuing unnamed ops
    at once never share a name (before, both could read the same next number, and the second
    was refused as a duplicate name or the two ranks paired different ops)."""
    per_thread = 150
    n = 2
    want = [2.0 * sum(q + 1 for q in range(n))] * 4
    for out in run(n, _threads_unnamed, per_thread, timeout=180):
        assert out["errors"] == []
        assert len(out["handles"]) == 2 * per_thread and len(set(out["handles"])) == 2 * per_thread
        assert all(v == want for v in out["values"])


def _results(ctx):
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    out = {}
    try:
        t = torch.arange(12, dtype=torch.float32).reshape(4, 3) + r

        def fresh(x):
            return x._base is None and x.untyped_storage().nbytes() == x.numel() * x.element_size()

        out["agreed"] = hvd.allreduce(t, op=hvd.Sum, name="agreed")
        out["negotiated"] = hvd.allreduce(t, op=hvd.Sum, name="neg", prescale_factor=2.0)
        out["fused"] = hvd.grouped_allreduce([t, t + 1, t[0].clone()], op=hvd.Sum, name="fused", prescale_factor=2.0)
        hs = [hvd.allreduce_async(t * k, op=hvd.Sum, name=f"fa{k}", prescale_factor=1.5) for k in range(3)]
        out["fused_async"] = [hvd.synchronize(h) for h in hs]
        out["allgather"] = hvd.allgather(t[: r + 1])
        out["grouped_allgather"] = hvd.grouped_allgather([t[: r + 1], t[:2]])
        out["reducescatter"] = hvd.reducescatter(torch.ones(2 * n + 1, 3) * (r + 1), op=hvd.Sum)
        out["alltoall"] = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32) + r)
        out["broadcast"] = hvd.broadcast(t, root_rank=0)
        flat = {}
        for k, v in out.items():
            vs = v if isinstance(v, (list, tuple)) else [v]
            flat[k] = ([fresh(x) for x in vs], [x.tolist() for x in vs])
        return flat
    finally:
        stop(hvd)


@pytest.mark.parametrize("n", [2, 3])
def test_results_are_new_tensors_as_horovods(run, n):
    """Every op that does not work in place returns new tensors, as Horovod does: never a view of a
    fusion buffer or of a larger result (which would keep the whole buffer alive and alias it)."""
    for r, flat in enumerate(run(n, _results, timeout=120)):
        t = [torch.arange(12, dtype=torch.float32).reshape(4, 3) + q for q in range(n)]
        total = sum(t)
        want = {
            "agreed": [total],
            "negotiated": [2 * total],
            "fused": [2 * total, 2 * (total + n), 2 * total[0]],
            "fused_async": [1.5 * total * k for k in range(3)],
            "allgather": [torch.cat([t[q][: q + 1] for q in range(n)])],
            "grouped_allgather": [torch.cat([t[q][: q + 1] for q in range(n)]), torch.cat([x[:2] for x in t])],
            "broadcast": [t[0]],
        }
        rows = (2 * n + 1) // n + (1 if r < (2 * n + 1) % n else 0)
        want["reducescatter"] = [torch.full((rows, 3), float(sum(q + 1 for q in range(n))))]
        want["alltoall"] = [torch.tensor([[2 * r + q, 2 * r + 1 + q] for q in range(n)], dtype=torch.float32).reshape(-1)]
        for key, (fresh, values) in flat.items():
            assert all(fresh), (r, key, fresh)
            assert values == [w.tolist() for w in want[key]], (r, key)


# ---- one decision per set ---------------------------------------------------------------------------
def _fusion(ctx, thresholds):
    import os

    os.environ["HOROVOD_FUSION_THRESHOLD"] = str(thresholds[ctx.rank])
    with Logged("c10d_ext.horovod") as seen:
        try:
            return _fused_values(start(ctx), seen)
        finally:
            os.environ.pop("HOROVOD_FUSION_THRESHOLD", None)


def _fused_values(hvd, seen):
    r = hvd.rank()
    try:
        ts = [torch.full((64 + k,), float(r + k)) for k in range(8)]
        # queued and negotiated (prescale): the members fuse them by the threshold
        grouped = hvd.grouped_allreduce(ts, op=hvd.Sum, name="g", prescale_factor=3.0)
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"a{k}", prescale_factor=2.0) for k, x in enumerate(ts)]
        asyncs = [hvd.synchronize(h).tolist() for h in hs]
        return {"grouped": [x.tolist() for x in grouped], "async": asyncs,
                "warned": [m for m in seen if "HOROVOD_FUSION_THRESHOLD" in m]}
    finally:
        stop(hvd)


@pytest.mark.parametrize("thresholds", [(0, 64 << 20), (64 << 20, 0), (1024, 64 << 20)])
def test_fusion_is_set_rank_zeros_on_every_rank(run, thresholds):
    """Members with different HOROVOD_FUSION_THRESHOLD fuse the same way (the set's rank 0's, as
    Horovod's coordinator decides for all), and a member whose setting differs says so naming it;
    before, they built collectives of different sizes."""
    n = len(thresholds)
    for r, out in enumerate(run(n, _fusion, thresholds, timeout=120)):
        for k in range(8):
            s = float(sum(q + k for q in range(n)))
            assert out["grouped"][k] == [3 * s] * (64 + k)
            assert out["async"][k] == [2 * s] * (64 + k)
        if thresholds[r] != thresholds[0]:
            assert len(out["warned"]) == 1 and str(thresholds[0]) in out["warned"][0], out["warned"]
        else:
            assert out["warned"] == []


def _agreed_needs_all(ctx):
    import sys

    import torch.distributed as dist

    import c10d_ext.horovod.controller as C

    real = dist.ProcessGroup.__dict__["_get_backend"]  # (the descriptor itself, to put back as it was)

    class WithoutAgreedStep:
        """This member's CPU backend as the set sees it, saying it has no agreed step."""

        _agreed_available = False

        def __init__(self, backend):
            self._backend = backend

        def __getattr__(self, name):
            return getattr(self._backend, name)

    def patched(group, device):
        b = real.__get__(group)(device)
        if sys._getframe(1).f_code.co_name == "_agree_settings":  # the set's question only
            return WithoutAgreedStep(b)
        return b

    if ctx.rank == 1:
        dist.ProcessGroup._get_backend = patched
    hvd = start(ctx)
    try:
        r = hvd.rank()
        out = []
        for k in range(5):  # synchronous ops only: the one-step path is taken or not
            out.append(hvd.allreduce(torch.full((3,), float(r + k)), op=hvd.Sum, name=f"s{k}").tolist())
            out.append([x.tolist() for x in hvd.grouped_allreduce([torch.full((2,), float(r))] * 2, op=hvd.Sum,
                                                                  name=f"g{k}")])
        return {"values": out, "agreed_ok": C._CONTROLLERS[hvd.global_process_set.process_set_id].agreed_ok}
    finally:
        stop(hvd)
        dist.ProcessGroup._get_backend = real


def test_the_agreed_step_is_used_only_where_every_member_has_it(run):
    """Whether a set takes the one-step path is agreed in its first cycle: a member without it
    makes every member negotiate (before, the others offered the agreed step alone and waited)."""
    n = 2
    for out in run(n, _agreed_needs_all, timeout=90):
        assert out["agreed_ok"] is False
        for k in range(5):
            assert out["values"][2 * k] == [float(sum(q + k for q in range(n)))] * 3
            assert out["values"][2 * k + 1] == [[float(sum(range(n)))] * 2] * 2


# ---- poll -----------------------------------------------------------------------------------------
def _poll_only(ctx):
    import time

    from c10d_ext.horovod.mpi_ops import _allreduce_async

    hvd = start(ctx)
    r = hvd.rank()
    out = {}
    try:
        hvd.allreduce(torch.ones(1), name="warm")
        # An untimed op (DistributedOptimizer's kind) held in a list of its own on an idle set:
        # only a synchronize would have run it.
        h = _allreduce_async(torch.full((4,), float(r)), None, "alone", hvd.Sum, 1.0, 1.0, hvd.global_process_set,
                             timed=False)
        while not hvd.poll(h):
            time.sleep(0.001)
        out["untimed_alone"] = hvd.synchronize(h).tolist()
        for pause in (0.0, 1.5):  # 1.5 s: the set's thread has gone to sleep
            time.sleep(pause)
            handles = {
                "held": hvd.allreduce_async(torch.full((4,), float(r)), op=hvd.Sum, name=f"held{pause}"),
                "queued": hvd.allreduce_async(torch.full((4,), float(r)), op=hvd.Sum, name=f"q{pause}",
                                              prescale_factor=2.0),
                "allgather": hvd.allgather_async(torch.full((2,), float(r)), name=f"ag{pause}"),
                "untimed": _allreduce_async(torch.full((4,), float(r)), None, f"u{pause}", hvd.Sum, 1.0, 1.0,
                                            hvd.global_process_set, timed=False),
            }
            for kind, h in handles.items():
                while not hvd.poll(h):  # nothing synchronizes until poll says done (the harness times a hang)
                    time.sleep(0.001)
                out[f"{kind}{pause}"] = hvd.synchronize(h).tolist()
        return out
    finally:
        stop(hvd)


@pytest.mark.parametrize("n", [1, 2])
def test_poll_alone_sees_every_kind_of_op_complete(run, n):
    """A job that only polls (never synchronizes until poll says done) sees every op finish:
    held, queued, negotiated and untimed, right after other work and after the set slept. Before,
    an untimed held op (the kind DistributedOptimizer issues) in a list of its own never ran."""
    s = float(sum(range(n)))
    for out in run(n, _poll_only, timeout=120):
        assert out["untimed_alone"] == [s] * 4
        for pause in (0.0, 1.5):
            assert out[f"held{pause}"] == [s] * 4
            assert out[f"queued{pause}"] == [2 * s] * 4
            assert out[f"allgather{pause}"] == [float(q) for q in range(n) for _ in range(2)]
            assert out[f"untimed{pause}"] == [s] * 4


# ---- torch's warnings -------------------------------------------------------------------------------
def _no_deprecated_calls(ctx):
    import torch.distributed as dist

    saved = {k: getattr(dist, k) for k in ("all_gather_into_tensor", "reduce_scatter_tensor")}

    def refuse(name):
        def call(*a, **k):
            raise AssertionError(f"c10d_ext.horovod called torch.distributed.{name}, which this torch deprecates")
        return call

    for k in saved:
        setattr(dist, k, refuse(k))
    try:
        hvd = start(ctx, process_sets="dynamic")
        r, n = hvd.rank(), hvd.size()
        try:
            t = torch.ones(2 * n, 2) * (r + 1)
            hvd.allreduce(t, name="a", prescale_factor=2.0)
            hvd.allgather(t[: r + 1], name="g")
            hvd.grouped_allgather([t, t[:1]], name="gg")
            hvd.reducescatter(t, name="rs")
            hvd.reducescatter(torch.ones(2 * n + 1), name="rs_uneven")
            ps = hvd.add_process_set([0])
            if r == 0:
                hvd.allreduce(t, name="ps", process_set=ps)
            hvd.remove_process_set(ps)
            hvd.allreduce(torch.ones(4), op=hvd.Adasum, name="adasum")
            return True
        finally:
            stop(hvd)
    finally:
        for k, v in saved.items():
            setattr(dist, k, v)


def test_the_layer_uses_torchs_current_names(run):
    """The layer's own collectives use torch's current single-tensor names (all_gather_single,
    reduce_scatter_single), so a user's job sees no deprecation warning caused by Horovod's layer."""
    import torch.distributed as dist

    if not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch has no all_gather_single: all_gather_into_tensor is its current name")
    assert run(2, _no_deprecated_calls, timeout=120) == [True, True]


# ---- an idle or busy rank ---------------------------------------------------------------------------
def _busy_rank(ctx, busy_s):
    import os
    import time

    import c10d_ext.horovod as hvd

    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = "2"
    ctx.init(timeout=5)  # Horovod's groups take the default group's timeout
    hvd.init()
    r = hvd.rank()
    try:
        with Logged("c10d_ext.horovod") as seen:
            if r == 0:
                time.sleep(busy_s)  # evaluation or a checkpoint: nothing of Horovod's for longer than the timeout
            h = hvd.allgather_async(torch.full((1,), float(r)), name="late_ag")
            out = {"allreduce": hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, name="late").tolist(),
                   "allgather": hvd.synchronize(h).tolist()}
        out["stall_warnings"] = [m for m in seen if "Missing ranks" in m]
        return out
    finally:
        os.environ.pop("HOROVOD_STALL_CHECK_TIME_SECONDS", None)
        stop(hvd)


def test_a_rank_busy_longer_than_the_timeout_does_not_fail_its_peers(run):
    """Rank 0 spends twice the groups' timeout outside Horovod while rank 1 waits in an allreduce
    and an allgather: the idle rank's heartbeat cycles keep rank 1's cycles going, rank 0 (the
    set's rank 0, which inspects) warns of the stall naming itself as the missing rank, and both
    ops complete with the right values once rank 0 submits them. Before, rank 1's cycle waited on
    rank 0 in a collective until the group's timeout failed the set."""
    out = run(2, _busy_rank, 11.0, timeout=120)
    for r in range(2):
        assert out[r]["allreduce"] == [3.0, 3.0]
        assert out[r]["allgather"] == [0.0, 1.0]
    assert any("\n0: [" in w for w in out[0]["stall_warnings"]), out[0]["stall_warnings"]


def _one_leaves(ctx):
    import time

    import c10d_ext.horovod as hvd
    import c10d_ext.horovod.basics as basics

    hvd = start(ctx)
    r = hvd.rank()
    out = {}
    try:
        hvd.allreduce(torch.ones(1), name="before")
        with Logged("c10d_ext.horovod") as seen:
            if r == 0:
                hvd.shutdown()  # rank 1 is idle meanwhile: its heartbeat hears that rank 0 left
                time.sleep(3.0)
            else:
                time.sleep(2.0)
                try:
                    hvd.allreduce(torch.ones(1), name="after")
                    out["after"] = "returned"
                except hvd.HorovodInternalError as e:
                    out["after"] = str(e)
                hvd.shutdown()
        out["warned"] = [m for m in seen if "failed" in m]
        out["lost_rank"] = basics.STATE.lost_rank
        hvd.init()  # the same ranks again: nobody was lost
        out["again"] = hvd.allreduce(torch.full((1,), float(r + 1)), op=hvd.Sum, name="again").tolist()
        return out
    finally:
        stop(hvd)


def test_a_rank_that_shuts_down_stops_its_peers_sets_in_order(run):
    """hvd.shutdown() on one rank ends the set on the others too, as in Horovod: an idle peer hears
    of it in its next heartbeat and its next op raises Horovod's shut-down error; nobody counts as
    lost, so init() goes on with the same ranks."""
    from c10d_ext.horovod.exceptions import SHUT_DOWN

    out = run(2, _one_leaves, timeout=120)
    assert out[1]["after"] == SHUT_DOWN
    for r in range(2):
        assert out[r]["warned"] == [], out[r]["warned"]  # an orderly end, not a failure
        assert out[r]["lost_rank"] is False
        assert out[r]["again"] == [3.0]
