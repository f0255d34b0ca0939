"""The CUDA engine's lifecycle logic, on the strict double in CI and on a GPU where there is one.

Each test here stands for something review found in the engine (the issue's list): point-to-point
on two-rank communicators with their own streams (first-op p2p between two of four ranks, an
unbatched ring of large messages, sends to self), barrier reaching the device, blocking
communicators by default, torch's async error handling (the process is taken down by default),
PREMUL_SUM's tensor factor passed on the device, coalescing blocks (batch Work covers the block,
an exception leaves no block open), NCCL ids keyed by the group's incarnation, abort hooks.
Under the double every body also fails on any strictness violation (Report.result()).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import DOUBLE, DOUBLE_DEVICES, FAULTS, MODES, WORLD, Report, _device, _init, counters, sync
from harness import ROOT, TESTS, assert_reports

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
BIG = 1 << 20  # bytes: far above the double's (and NCCL's) buffering, so sends wait for receives


def _full(n, value, dev, dtype=torch.float32):
    return torch.full((n,), float(value), dtype=dtype, device=dev)


def _error_of(work, bound_s=30.0) -> str:
    """The error a Work ends with ("" if it succeeds): polled, as a user without blocking wait
    would, until the watchdog completes it, then waited on."""
    start = time.monotonic()
    try:
        while not work.is_completed() and time.monotonic() - start < bound_s:
            time.sleep(0.02)
        work.wait()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return ""


# ---- point-to-point ------------------------------------------------------------------------

def body_p2p_patterns(ctx, mode):
    """On a fresh group: the first CUDA ops are p2p between ranks 0 and 1 only (the others are
    busy elsewhere); then every pair of ring neighbours gets its communicator; then an unbatched
    ring of large messages (isend to the next, irecv from the previous, both pending at once),
    sends to self in both orders, and a batch with a send to self in it."""
    dev, _ = _init(ctx, mode=mode, timeout=60)
    rep = Report(ctx, mode)
    n, r = ctx.size, ctx.rank
    store = ctx.store("p2p")
    nbig = BIG // 4
    # 1. first op: 0 <-> 1 while ranks 2.. wait for them to finish
    if r in (0, 1):
        peer = 1 - r
        mine, got = _full(1000, 10 + r, dev), torch.zeros(1000, device=dev)
        if r == 0:
            dist.send(mine, dst=peer)
            dist.recv(got, src=peer)
        else:
            dist.recv(got, src=peer)
            dist.send(mine, dst=peer)
        rep.check(torch.equal(got.cpu(), _full(1000, 10 + peer, "cpu")), "first-op send/recv between 0 and 1")
        store.set(f"first{r}", "1")
    else:
        store.wait(["first0", "first1"], timedelta(seconds=60))
    # 2. ring neighbours, in an order that makes every pair's communicator without a cycle
    nxt, prv = (r + 1) % n, (r - 1) % n
    small_out, small_in = _full(64, r, dev), torch.zeros(64, device=dev)
    if r % 2 == 0:
        dist.send(small_out, dst=nxt)
        dist.recv(small_in, src=prv)
    else:
        dist.recv(small_in, src=prv)
        dist.send(small_out, dst=nxt)
    rep.check(torch.equal(small_in.cpu(), _full(64, prv, "cpu")), "ring warm-up")
    # 3. the unbatched ring with large messages: each pair has its own stream, so no rank's send
    #    waits behind its own receive
    for rnd in range(3):
        out, inn = _full(nbig, 100 * rnd + r, dev), torch.zeros(nbig, device=dev)
        s = dist.isend(out, dst=nxt)
        q = dist.irecv(inn, src=prv)
        s.wait()
        q.wait()
        rep.check(torch.equal(inn.cpu(), _full(nbig, 100 * rnd + prv, "cpu")), f"unbatched ring round {rnd}")
    # reverse direction, receive posted first
    out, inn = _full(nbig, -r, dev), torch.zeros(nbig, device=dev)
    q = dist.irecv(inn, src=nxt)
    s = dist.isend(out, dst=prv)
    q.wait()
    s.wait()
    rep.check(torch.equal(inn.cpu(), _full(nbig, -nxt, "cpu")), "unbatched ring, the other way")
    # 4. to self, unbatched, send first and receive first; then inside a batch
    x, y = _full(5000, 7 + r, dev), torch.zeros(5000, device=dev)
    a = dist.isend(x, dst=r, tag=3)
    b = dist.irecv(y, src=r, tag=3)
    a.wait()
    b.wait()
    rep.check(torch.equal(y.cpu(), _full(5000, 7 + r, "cpu")), "isend/irecv to self, send first")
    y2 = torch.zeros(5000, dtype=torch.int64, device=dev)
    b = dist.irecv(y2, src=r)
    a = dist.isend(torch.arange(5000, device=dev), dst=r)
    b.wait()
    a.wait()
    rep.check(torch.equal(y2.cpu(), torch.arange(5000)), "isend/irecv to self, receive first")
    me_in, ring_in = torch.zeros(300, device=dev), torch.zeros(300, device=dev)
    ops = [dist.P2POp(dist.isend, _full(300, 50 + r, dev), r), dist.P2POp(dist.irecv, me_in, r),
           dist.P2POp(dist.isend, _full(300, 60 + r, dev), nxt), dist.P2POp(dist.irecv, ring_in, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    rep.check(torch.equal(me_in.cpu(), _full(300, 50 + r, "cpu")), "batch with a send to self")
    rep.check(torch.equal(ring_in.cpu(), _full(300, 60 + prv, "cpu")), "batch ring")
    c = counters(mode)
    if mode == "double":
        # the group's communicator (made by the batch) and one two-rank communicator per pair used
        pairs = {tuple(sorted((r, nxt))), tuple(sorted((r, prv)))} | ({(0, 1)} if r in (0, 1) else set())
        rep.check(c.get("comm_nranks_2", 0) == len({p for p in pairs if p[0] != p[1]}),
                  f"two-rank communicators: {c}")
        rep.check(c.get(f"comm_nranks_{n}", 0) == 1, f"group communicators: {c}")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", [3, 4])
def test_p2p_patterns(run, size, mode):
    if mode == "gpu" and torch.cuda.is_available() and torch.cuda.device_count() < size:
        env = dict(WORLD[mode])  # ranks share GPUs through NCCL_HOSTID
    else:
        env = WORLD[mode]
    assert_reports(run(size, body_p2p_patterns, mode, timeout=240, world_env=env))


# ---- barrier -------------------------------------------------------------------------------

def body_barrier_orders_device(ctx, mode):
    """A barrier with device_ids, or after CUDA ops, runs on the device: when it returns, the
    group's earlier CUDA ops have finished on every rank."""
    dev, _ = _init(ctx, mode=mode)
    rep = Report(ctx, mode)
    idx = ctx.rank % (DOUBLE_DEVICES if mode == "double" else torch.cuda.device_count())
    for how in ("device_ids", "after CUDA ops"):
        t = _full(1 << 20, ctx.rank + 1, dev)
        w = dist.all_reduce(t, async_op=True)
        if how == "device_ids":
            dist.barrier(device_ids=[idx])
        else:
            dist.barrier()
        rep.check(w.is_completed(), f"barrier ({how}) returned before the all_reduce before it finished")
        w.wait()
        rep.check(torch.equal(t.cpu(), _full(1 << 20, sum(range(1, ctx.size + 1)), "cpu")), f"values ({how})")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
def test_barrier_orders_device_work(run, mode):
    assert_reports(run(2, body_barrier_orders_device, mode, timeout=120, world_env=WORLD[mode]))


# ---- communicators: blocking by default, keyed by incarnation -------------------------------

def body_blocking_comms(ctx, mode, nonblocking):
    opts = {"nccl_nonblocking": True} if nonblocking else {}
    dev, _ = _init(ctx, mode=mode, **opts)
    rep = Report(ctx, mode)
    before = counters(mode)
    for _ in range(5):
        t = _full(100, 1, dev)
        dist.all_reduce(t)
        rep.check(torch.equal(t.cpu(), _full(100, ctx.size, "cpu")), "all_reduce")
    peer = 1 - ctx.rank
    got = torch.zeros(10, device=dev)
    reqs = [dist.isend(_full(10, ctx.rank, dev), dst=peer), dist.irecv(got, src=peer)]
    for q in reqs:
        q.wait()
    rep.check(torch.equal(got.cpu(), _full(10, peer, "cpu")), "send/recv")
    after = counters(mode)
    if mode == "double":
        made = {k: after.get(k, 0) - before.get(k, 0) for k in ("comms_blocking", "comms_nonblocking")}
        want = {"comms_blocking": 0 if nonblocking else 2, "comms_nonblocking": 2 if nonblocking else 0}
        rep.check(made == want, f"communicators made (group + pair): {made}, expected {want}")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_communicators_blocking_unless_asked(run, nonblocking, mode):
    assert_reports(run(2, body_blocking_comms, mode, nonblocking, timeout=120, world_env=WORLD[mode]))


def body_incarnations(ctx, mode):
    """Three incarnations of the default group on one store. In the first only rank 0 makes a
    CUDA engine (a send to itself); NCCL ids must still match in the next ones."""
    import c10d_ext  # noqa: F401

    rep = Report(ctx, mode)
    dev = _device(ctx, mode)
    store = ctx.store("incarnations")
    for inc in range(3):
        dist.init_process_group("myccl", store=store, rank=ctx.rank, world_size=ctx.size,
                                timeout=timedelta(seconds=30))
        if inc == 0:
            if ctx.rank == 0:
                y = torch.zeros(4, device=dev)
                a, b = dist.isend(_full(4, 3, dev), dst=0), dist.irecv(y, src=0)
                a.wait()
                b.wait()
                rep.check(torch.equal(y.cpu(), _full(4, 3, "cpu")), "send to self in incarnation 0")
        else:
            t = _full(8, ctx.rank + inc, dev)
            dist.all_reduce(t)
            rep.check(torch.equal(t.cpu(), _full(8, sum(r + inc for r in range(ctx.size)), "cpu")),
                      f"all_reduce in incarnation {inc}")
        dist.destroy_process_group()
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
def test_nccl_ids_follow_the_group_incarnation(run, mode):
    assert_reports(run(2, body_incarnations, mode, timeout=120, world_env=WORLD[mode]))


# ---- reductions ------------------------------------------------------------------------------

def body_premul_tensor_factor(ctx, mode):
    """PREMUL_SUM with a tensor factor: the factor goes to NCCL on the device (read when the op
    runs), never through the host; a number goes as a host scalar."""
    dev, _ = _init(ctx, mode=mode)
    rep = Report(ctx, mode)
    n = ctx.size
    before = counters(mode)
    x = _full(1000, ctx.rank + 1, dev)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(torch.tensor(0.5 + ctx.rank, device=dev)))
    want = sum((r + 1) * (0.5 + r) for r in range(n))
    rep.check(torch.allclose(x.cpu(), _full(1000, want, "cpu")), f"tensor factor: {x[:3].tolist()} vs {want}")
    y = _full(10, ctx.rank + 1, dev, torch.float64)
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(2.0))
    rep.check(torch.allclose(y.cpu(), _full(10, 2.0 * sum(range(1, n + 1)), "cpu", torch.float64)), "float factor")
    after = counters(mode)
    if mode == "double":
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("premul_device", "premul_host")}
        rep.check(d == {"premul_device": 1, "premul_host": 1}, f"premul residences: {d}")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
def test_premul_sum_tensor_factor_on_device(run, mode):
    assert_reports(run(2, body_premul_tensor_factor, mode, timeout=120, world_env=WORLD[mode]))


# ---- the launch path's economies --------------------------------------------------------------

def body_launch_economies(ctx, mode, record_streams):
    """What the lean launch path saves, seen through the double's counters: end events come from
    a pool (rounds of asynchronous ops make about one round's worth, not one each), and an
    asynchronous in-place op's tensor is recordStream'ed once (not as input and again as output)
    with MYCCL_AVOID_RECORD_STREAMS=0, and not at all by default: its Work holds it until the op
    has finished, as torch's nccl stashes it; float8 reductions ask the device's compute capability
    once, not per op. Results are checked every time."""
    dev, _ = _init(ctx, mode=mode, timeout=60)
    rep = Report(ctx, mode)
    n = ctx.size
    warm = _full(4, 1, dev)
    dist.all_reduce(warm, async_op=True).wait()  # the communicator, its stream and ready event
    if mode == "double":  # float8 reductions ask for the device's compute capability
        dist.all_reduce(torch.ones(4, device=dev).to(torch.float8_e4m3fn))
    time.sleep(0.1)
    before = counters(mode)
    rounds, per = 8, 8
    want = _full(4, n * (n + 1) // 2, "cpu")
    for k in range(rounds):
        xs = [_full(4, ctx.rank + 1, dev) for _ in range(per)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        for w in works:
            w.wait()
        rep.check(all(torch.equal(x.cpu(), want) for x in xs), f"round {k}: {[x.tolist() for x in xs][:2]}")
        del works, xs
        time.sleep(0.1)  # the watchdog lets go of finished Works within a tick
    if mode == "double":
        for k in range(4):
            f8 = torch.full((4,), float(ctx.rank + 1), device=dev).to(torch.float8_e4m3fn)
            dist.all_reduce(f8)
            rep.check(torch.equal(f8.float().cpu(), want), f"float8 all_reduce {k}: {f8.float().tolist()}")
    after = counters(mode)
    if mode == "double":
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("events", "record_stream_calls", "capability_queries")}
        rep.check(d["capability_queries"] == 0, f"4 float8 all_reduces asked the device {d['capability_queries']} times")
        rep.check(d["events"] <= 2 * per, f"{rounds * per} asynchronous ops made {d['events']} events")
        rep.check(d["record_stream_calls"] == (rounds * per if record_streams else 0),
                  f"recordStream calls for {rounds * per} in-place ops: {d['record_stream_calls']}")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("record_streams", [False, True], ids=["stash", "record-streams"])
def test_launch_path_economies(run, mode, record_streams):
    env = dict(WORLD[mode], MYCCL_AVOID_RECORD_STREAMS="0" if record_streams else "1")
    assert_reports(run(2, body_launch_economies, mode, record_streams, timeout=120, world_env=env))


# ---- coalescing ------------------------------------------------------------------------------

def body_coalescing(ctx, mode):
    dev, _ = _init(ctx, mode=mode)
    rep = Report(ctx, mode)
    n, r = ctx.size, ctx.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    # The batch's Work is the engine's own: its future holds every output of the block.
    got = torch.zeros(100, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _full(100, r, dev), nxt),
                                    dist.P2POp(dist.irecv, got, prv)])
    rep.check(len(works) == 1, f"batch_isend_irecv returned {len(works)} works")
    fut = works[0].get_future()
    value = fut.wait()
    sync(mode)
    rep.check(any(v.data_ptr() == got.data_ptr() for v in value), "the batch future's value holds the receive buffer")
    rep.check(torch.equal(got.cpu(), _full(100, prv, "cpu")), "batch values")
    # An op of a batch raises in myccl's argument checks: the block is left behind, and the
    # next batch, collective and point-to-point op work as if it never was.
    overlapping = torch.zeros(1, device=dev).expand(10)  # every element is the same memory
    try:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, _full(10, r, dev), nxt),
                                dist.P2POp(dist.irecv, overlapping, prv)])
        rep.check(False, "a batch with an overlapping receive buffer did not raise")
    except ValueError as e:
        rep.check("myccl" in str(e), f"the error names myccl: {e}")
    got = torch.zeros(100, device=dev)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, _full(100, r + 10, dev), nxt),
                                     dist.P2POp(dist.irecv, got, prv)]):
        w.wait()
    rep.check(torch.equal(got.cpu(), _full(100, prv + 10, "cpu")), "the batch after a failed one")
    t = _full(7, 1, dev)
    dist.all_reduce(t)
    rep.check(torch.equal(t.cpu(), _full(7, n, "cpu")), "all_reduce after a failed batch")
    # The body of a block raises (torch's manager then never ends it): what it held is dropped,
    # and the group's next ops run at once instead of joining the dead block.
    held = torch.zeros(5, device=dev)
    try:
        with dist.distributed_c10d._coalescing_manager(device=dev, async_ops=True):
            dist.irecv(held, src=prv)
            raise KeyError("the user's code failed inside the block")
    except KeyError:
        pass
    t = _full(9, 2, dev)
    dist.all_reduce(t)
    rep.check(torch.equal(t.cpu(), _full(9, 2 * n, "cpu")), f"all_reduce after a block that raised: {t.tolist()}")
    got = torch.zeros(4, device=dev)
    for w in [dist.isend(_full(4, r, dev), dst=nxt), dist.irecv(got, src=prv)]:
        w.wait()
    rep.check(torch.equal(got.cpu(), _full(4, prv, "cpu")), "send/recv after a block that raised")
    rep.check(torch.equal(held.cpu(), torch.zeros(5)), "the abandoned receive wrote nothing")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
def test_coalescing_blocks(run, mode):
    assert_reports(run(2, body_coalescing, mode, timeout=120, world_env=WORLD[mode]))


# ---- failures ----------------------------------------------------------------------------------

def body_abort_hooks_cuda(ctx, mode):
    """With async_error_handling=2 a CUDA timeout raises, after the abort hooks ran."""
    dev, _ = _init(ctx, mode=mode, timeout=2.0, async_error_handling=2)
    rep = Report(ctx, mode)
    pg = dist.group.WORLD
    calls = []
    pg.register_abort_hook(7, lambda: calls.append(time.monotonic()))
    t = _full(16, 1, dev)
    dist.all_reduce(t)
    sync(mode)
    store = ctx.store("hooks")
    if ctx.rank == 1:
        store.wait(["done"], timedelta(seconds=60))
        return (1, [])
    err = _error_of(dist.all_reduce(t, async_op=True))
    store.set("done", "1")
    rep.check("Timed out after 2000 ms" in err, f"error: {err}")
    rep.check(len(calls) == 1, f"abort hook calls: {calls}")
    return rep.checks, rep.failures  # the double saw an aborted op: no violation check here


@pytest.mark.skipif(TORCH < (2, 14), reason="abort hooks are a torch 2.14 API")
@pytest.mark.parametrize("mode", MODES)
def test_abort_hooks_run_on_cuda_failure(run, mode):
    assert_reports(run(2, body_abort_hooks_cuda, mode, timeout=120, world_env=FAULTS[mode]))


TEARDOWN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import c10d_ext
    import cuda_double
    cuda_double.install()
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    cuda_double.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("myccl", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        store.wait(["finish"], timedelta(seconds=60))
        os._exit(0)
    w = dist.all_reduce(t, async_op=True)   # rank 1 never joins
    print("issued", flush=True)
    time.sleep(30)                         # the watchdog must take this process down first
    print("still alive", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("handling", [None, "1"], ids=["default", "teardown"])
def test_timeout_takes_the_process_down_by_default(handling, tmp_path):
    """torch's async error handling: by default (3) a timed-out op ends the process with the
    error on stderr, so that results the device never wrote cannot reach the optimizer."""
    from harness import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = dict(os.environ, **{k: v.replace("{rank}", "0") for k, v in DOUBLE.items()})
    env.pop("MYCCL_ASYNC_ERROR_HANDLING", None)
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    if handling:
        env["MYCCL_ASYNC_ERROR_HANDLING"] = handling
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", TEARDOWN_SCRIPT, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        start = time.monotonic()
        out, errtext = procs[0].communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        master.set("finish", "1")
        for p in procs:
            try:
                p.communicate(timeout=30)
            except Exception:  # noqa: BLE001
                p.kill()
    assert "issued" in out, (out, errtext[-3000:])
    assert "still alive" not in out, "the process survived a timed-out CUDA op"
    assert procs[0].returncode == -signal.SIGABRT, (procs[0].returncode, errtext[-3000:])
    assert "Timed out after 2000 ms" in errtext and "taking the entire process down" in errtext, errtext[-3000:]


def body_creation_names_missing_rank(ctx, mode):
    """The first CUDA op of rank 0 waits for the communicator; rank 1 never comes: within the
    timeout, an error that names rank 1 (not a hang inside NCCL's init)."""
    dev, _ = _init(ctx, mode=mode, timeout=2.0)
    store = ctx.store("creation")
    if ctx.rank == 1:
        store.wait(["done"], timedelta(seconds=60))
        return None
    start = time.monotonic()
    err = None
    try:
        dist.all_reduce(_full(4, 1, dev))
    except Exception as e:  # noqa: BLE001
        err = e
    elapsed = time.monotonic() - start
    store.set("done", "1")
    return {"err": f"{type(err).__name__}: {err}" if err else None, "elapsed": elapsed,
            "dist_error": isinstance(err, dist.DistBackendError)}


@pytest.mark.parametrize("mode", MODES)
def test_communicator_creation_names_the_missing_rank(run, mode):
    res = run(2, body_creation_names_missing_rank, mode, timeout=120, world_env=FAULTS[mode])[0]
    assert res["err"] is not None and res["dist_error"], res
    assert "Timed out after 2000 ms waiting for rank(s) 1 to reach its first CUDA op" in res["err"], res["err"]


def body_foreign_open_group(ctx):
    """Something else in the process called ncclGroupStart and never ncclGroupEnd on this thread
    (torch's own "nccl" does when its scatter raises on an int16 tensor): NCCL then defers every
    NCCL call of the thread, communicator creation included. myccl's first op must say so, not
    fail later with NCCL's "invalid root 0 (root should be in the 0..0 range)" or complete ops
    that never ran."""
    import ctypes

    dev = _device(ctx, "gpu")
    ctx.init(timeout=30)
    nccl = ctypes.CDLL("libnccl.so.2")  # the library torch loaded (one NCCL per process)
    assert nccl.ncclGroupStart() == 0
    t = _full(4, 1, dev)
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
        return {"err": None, "value": t.cpu().tolist()}
    except Exception as e:  # noqa: BLE001
        return {"err": f"{type(e).__name__}: {e}", "dist_error": isinstance(e, dist.DistBackendError)}
    # the group stays open: this world ("foreign_group") serves no other test


@pytest.mark.cuda
def test_foreign_open_nccl_group_is_named(run):
    env = dict(WORLD["gpu"], MYCCL_TEST_WORLD="foreign_group")
    for res in run(2, body_foreign_open_group, timeout=120, world_env=env):
        assert res["err"] is not None and res["dist_error"], res
        assert "inside an NCCL group that something else in this process opened" in res["err"], res["err"]


def body_flight_recorder(ctx, mode, dump_dir):
    """CUDA ops are in the group's flight recorder (and hence the timeline), with their state;
    a timed-out op dumps it and the error says where."""
    import c10d_ext

    dev = _device(ctx, mode)
    ctx.init(timeout=2.0, pg_options=c10d_ext.Options(async_error_handling=2, flight_recorder_dump=dump_dir))
    rep = Report(ctx, mode)
    t = _full(100, 1, dev)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    peer = 1 - ctx.rank
    got = torch.zeros(3, device=dev)
    for w in [dist.isend(_full(3, 1, dev), dst=peer), dist.irecv(got, src=peer)]:
        w.wait()
    sync(mode)
    backend = dist.group.WORLD._get_backend(torch.device("cuda") if mode == "gpu" else torch.device("cpu"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        recs = backend.flight_recorder()
        if recs and all(r["state"] == "completed" for r in recs):
            break
        time.sleep(0.05)
    ops = [(r["op"].split(" ")[0], r["transport"], r["state"], r["p2p"]) for r in recs]
    rep.check(ops[:4] == [("all_reduce", "nccl", "completed", False), ("broadcast", "nccl", "completed", False),
                          ("send", "nccl", "completed", True), ("recv", "nccl", "completed", True)],
              f"flight recorder: {ops}")
    store = ctx.store("fr")
    if ctx.rank == 1:
        store.wait(["done"], timedelta(seconds=60))
        return rep.checks, rep.failures
    err = _error_of(dist.all_reduce(t, async_op=True))
    store.set("done", "1")
    rep.check("Timed out after 2000 ms" in err and "[flight recorder: " + dump_dir in err, f"error: {err}")
    last = backend.flight_recorder()[-1]
    rep.check(last["state"] == "failed" and "Timed out" in last["error"], f"last record: {last}")
    return rep.checks, rep.failures


@pytest.mark.parametrize("mode", MODES)
def test_flight_recorder_has_cuda_ops(run, mode, tmp_path):
    assert_reports(run(2, body_flight_recorder, mode, str(tmp_path), timeout=120, world_env=FAULTS[mode]))
    assert any(tmp_path.iterdir()), "no flight recorder dump was written"


def body_eager_device_id(ctx):
    """init_process_group(device_id=...) makes the group's communicator during init (torch 2.14+
    binds the device when it registers the backend), and the first op uses it."""
    dev = _device(ctx, "gpu")
    import c10d_ext  # noqa: F401

    dist.init_process_group("myccl", store=ctx.store("eager"), rank=ctx.rank, world_size=ctx.size,
                            timeout=timedelta(seconds=60), device_id=dev)
    rep = Report(ctx, "gpu")
    t = _full(10, ctx.rank + 1, dev)
    dist.all_reduce(t)
    rep.check(torch.equal(t.cpu(), _full(10, sum(range(1, ctx.size + 1)), "cpu")), "all_reduce after eager init")
    dist.barrier()  # on the bound device
    return rep.result()


@pytest.mark.cuda
def test_eager_init_with_device_id(run):
    assert_reports(run(2, body_eager_device_id, timeout=120, world_env=WORLD["gpu"]))


def body_split_on_gpu(ctx):
    """split_group on a group bound to a device (init with device_id, as DeviceMesh does): the
    NCCL communicator is split with ncclCommSplit and the new groups' ops run on it; a group of
    every rank, then one rank each."""
    dev = _device(ctx, "gpu")
    import c10d_ext  # noqa: F401

    dist.init_process_group("myccl", store=ctx.store("split"), rank=ctx.rank, world_size=ctx.size,
                            timeout=timedelta(seconds=60), device_id=dev)
    rep = Report(ctx, "gpu")
    n = ctx.size
    whole = dist.split_group(split_ranks=[list(range(n))[::-1]])  # reversed: rank n-1 is rank 0
    t = _full(16, ctx.rank + 1, dev)
    dist.all_reduce(t, group=whole)
    rep.check(torch.equal(t.cpu(), _full(16, sum(range(1, n + 1)), "cpu")), "all_reduce on a split of every rank")
    b = _full(4, ctx.rank, dev)
    dist.broadcast(b, group_src=0, group=whole)
    rep.check(torch.equal(b.cpu(), _full(4, n - 1, "cpu")), "broadcast from the split's rank 0 (global rank n-1)")
    solo = dist.split_group(split_ranks=[[q] for q in range(n)])
    t = _full(8, ctx.rank + 5, dev)
    dist.all_reduce(t, group=solo)
    rep.check(torch.equal(t.cpu(), _full(8, ctx.rank + 5, "cpu")), "all_reduce on a one-rank split")
    t = _full(8, 1, dev)
    dist.all_reduce(t)  # the parent still works
    rep.check(torch.equal(t.cpu(), _full(8, n, "cpu")), "parent after splits")
    return rep.result()


@pytest.mark.cuda
@pytest.mark.skipif(TORCH < (2, 14), reason="torch < 2.14 splits through the backend's `options` and split "
                    "virtuals that myccl implements from 2.14 on (as the CPU split tests)")
def test_split_group_on_gpu(run):
    assert_reports(run(2, body_split_on_gpu, timeout=120, world_env=WORLD["gpu"]))


def body_desync_detail(ctx, mode):
    """MYCCL_DEBUG=DETAIL: ranks that call different CUDA collectives get an error naming what
    each called, before NCCL is asked (instead of a hung kernel)."""
    dev, _ = _init(ctx, mode=mode, timeout=20.0, debug="DETAIL", async_error_handling=2)
    t = _full(8, 1, dev)
    dist.all_reduce(t)  # agreed: runs
    ok = torch.equal(t.cpu(), _full(8, ctx.size, "cpu"))
    err = None
    try:
        if ctx.rank == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    return {"ok": ok, "err": err}


@pytest.mark.parametrize("mode", MODES)
def test_desync_detail_names_what_each_rank_called(run, mode):
    for res in run(2, body_desync_detail, mode, timeout=120, world_env=FAULTS[mode]):
        assert res["ok"], res
        err = res["err"] or ""
        assert "ranks called different collectives" in err, err
        assert "ranks [0] called desync check of all_reduce #2" in err and "ranks [1] called desync check of broadcast #2" in err, err
