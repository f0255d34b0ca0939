"""myccl inside torch.distributed: every way of initialising, re-initialising, sub-groups and
device meshes, DDP (compared with gloo on the same model and data), object and functional
collectives (eager and compiled), DTensor, the Work API and profiler, TORCH_DISTRIBUTED_DEBUG,
timeouts, abort and shutdown.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

from expect import make
from harness import Report, assert_reports, free_port, seq_number, work_exception


def _cpu_backend(group=None):
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu"))


def _smoke(rep: Report, ctx, what: str, group=None, ranks=None):
    """all_reduce, broadcast and all_gather on `group` (ranks: its global ranks), checked."""
    ranks = list(range(ctx.size)) if ranks is None else ranks
    n = len(ranks)
    x = make(ctx.rank, (33,), torch.float64, 1)
    t = x.clone()
    dist.all_reduce(t, group=group)
    want = make(ranks[0], (33,), torch.float64, 1)
    for q in ranks[1:]:
        want = want + make(q, (33,), torch.float64, 1)
    rep.check(torch.equal(t, want), f"{what}: all_reduce")
    b = x.clone()
    dist.broadcast(b, src=ranks[-1], group=group)
    rep.check(torch.equal(b, make(ranks[-1], (33,), torch.float64, 1)), f"{what}: broadcast")
    outs = [torch.empty(33, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, x, group=group)
    rep.check(all(torch.equal(outs[i], make(q, (33,), torch.float64, 1)) for i, q in enumerate(ranks)),
              f"{what}: all_gather")


# ---- init methods ---------------------------------------------------------------------------

def body_init_methods(ctx, env_port, tcp_port, file_path):
    rep = Report(ctx)
    # env:// as torchrun sets it up
    ctx.init_env(env_port, timeout=30)
    rep.check(dist.get_backend() == "myccl" and dist.get_world_size() == ctx.size and dist.get_rank() == ctx.rank,
              "env:// rank/size/backend")
    _smoke(rep, ctx, "env://")
    dist.destroy_process_group()
    # tcp://
    dist.init_process_group("myccl", init_method=f"tcp://127.0.0.1:{tcp_port}", rank=ctx.rank,
                            world_size=ctx.size, timeout=timedelta(seconds=30))
    _smoke(rep, ctx, "tcp://")
    dist.destroy_process_group()
    # file://
    dist.init_process_group("myccl", init_method=f"file://{file_path}", rank=ctx.rank, world_size=ctx.size,
                            timeout=timedelta(seconds=30))
    _smoke(rep, ctx, "file://")
    dist.destroy_process_group()
    # an explicit store (a FileStore here; the harness's ctx.init uses a TCPStore)
    store = dist.FileStore(file_path + ".store", ctx.size)
    dist.init_process_group("myccl", store=store, rank=ctx.rank, world_size=ctx.size, timeout=timedelta(seconds=30))
    _smoke(rep, ctx, "FileStore")
    dist.destroy_process_group()
    # backend given per device, as "cpu:myccl"
    ctx.init(backend="cpu:myccl", timeout=30)
    _smoke(rep, ctx, "backend='cpu:myccl'")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_init_methods(run, size, tmp_path):
    results = run(size, body_init_methods, free_port(), free_port(), str(tmp_path / "init"), timeout=120)
    assert_reports(results)


def body_reinit(ctx):
    """destroy + init again in the same process, several times, with the same store object."""
    rep = Report(ctx)
    store = ctx.store("reinit")
    for it in range(4):
        if it % 2 == 0:
            dist.init_process_group("myccl", store=store, rank=ctx.rank, world_size=ctx.size,
                                    timeout=timedelta(seconds=30))
        else:
            ctx.init(timeout=30)  # a fresh PrefixStore over the same TCPStore each time
        _smoke(rep, ctx, f"incarnation {it}")
        sub = dist.new_group(list(range(0, ctx.size, 2)))
        if ctx.rank % 2 == 0:
            _smoke(rep, ctx, f"incarnation {it} new_group", group=sub, ranks=list(range(0, ctx.size, 2)))
        # leave an async op's Work behind: destroy must not trip over it
        w = dist.all_reduce(torch.ones(100), async_op=True)
        if it == 3:
            w.wait()
        dist.destroy_process_group()
        rep.check(not dist.is_initialized(), f"incarnation {it}: destroyed")
    return rep.result()


@pytest.mark.parametrize("size", [2, 4])
def test_destroy_and_reinit(run, size):
    assert_reports(run(size, body_reinit, timeout=120))


# ---- groups and meshes ------------------------------------------------------------------------

def body_new_groups(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    g02 = dist.new_group([0, 2])
    rest = [q for q in range(n) if q not in (0, 2)]
    grest = dist.new_group(rest)
    if r in (0, 2):
        rep.check(dist.get_rank(g02) == [0, 2].index(r) and dist.get_world_size(g02) == 2, "rank/size in [0,2]")
        rep.check(dist.get_backend(g02) == "myccl", f"new_group backend is {dist.get_backend(g02)}")
        _smoke(rep, ctx, "group [0,2]", group=g02, ranks=[0, 2])
        t = torch.full((4,), float(r))
        dist.broadcast(t, group_src=1, group=g02)
        rep.check(torch.equal(t, torch.full((4,), 2.0)), "broadcast with group_src in [0,2]")
    else:  # non-members do not take part; they use their own group meanwhile
        rep.check(dist.get_rank(g02) == -1, "non-member rank in [0,2] is -1")
        if len(rest) > 1:
            _smoke(rep, ctx, f"group {rest}", group=grest, ranks=rest)
    _smoke(rep, ctx, "WORLD after sub-groups")
    # new_subgroups: consecutive pairs
    if n % 2 == 0:
        cur, subs = dist.new_subgroups(group_size=2)
        pair = [r - r % 2, r - r % 2 + 1]
        rep.check(len(subs) == n // 2, "number of subgroups")
        _smoke(rep, ctx, f"subgroup {pair}", group=cur, ranks=pair)
        cur2, _ = dist.new_subgroups_by_enumeration([[q for q in range(n) if q % 2 == 0], [q for q in range(n) if q % 2]])
        _smoke(rep, ctx, "subgroups by enumeration", group=cur2, ranks=[q for q in range(n) if q % 2 == r % 2])
    # Last: torch advances its group counter only on the ranks that create a local-sync group,
    # so any ordinary new_group after one would get different names on different ranks.
    solo = dist.new_group([r], use_local_synchronization=True)
    t = torch.arange(3.0) + r
    dist.all_reduce(t, group=solo)
    rep.check(torch.equal(t, torch.arange(3.0) + r), "single-rank group all_reduce")
    if r in (1, n - 1):  # a group created only by its members
        lg = dist.new_group([1, n - 1], use_local_synchronization=True)
        _smoke(rep, ctx, "local-sync group", group=lg, ranks=[1, n - 1])
    return rep.result()


@pytest.mark.parametrize("size", [3, 4])
def test_new_group_and_subgroups(run, size):
    assert_reports(run(size, body_new_groups, timeout=120))


def body_device_mesh(ctx):
    from torch.distributed.device_mesh import init_device_mesh

    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    mesh1 = init_device_mesh("cpu", (n,))
    g = mesh1.get_group()
    rep.check(dist.get_backend(g) == "myccl", f"1-D mesh backend {dist.get_backend(g)}")
    _smoke(rep, ctx, "1-D mesh", group=g)
    if n == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh["tp"].get_group()
        dp_ranks = [r % 2, r % 2 + 2]
        tp_ranks = [r - r % 2, r - r % 2 + 1]
        rep.check(dist.get_process_group_ranks(dp) == dp_ranks, f"dp ranks {dist.get_process_group_ranks(dp)}")
        rep.check(dist.get_process_group_ranks(tp) == tp_ranks, f"tp ranks {dist.get_process_group_ranks(tp)}")
        rep.check(dist.get_backend(dp) == "myccl" and dist.get_backend(tp) == "myccl", "mesh sub-group backends")
        # interleave ops on the two dimensions
        for it in range(3):
            _smoke(rep, ctx, f"dp {it}", group=dp, ranks=dp_ranks)
            _smoke(rep, ctx, f"tp {it}", group=tp, ranks=tp_ranks)
        x = torch.full((8,), float(r))
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, x, group=tp)
        rep.check(torch.equal(out, torch.full((4,), float(sum(tp_ranks)))), "reduce_scatter_tensor on tp")
    return rep.result()


@pytest.mark.parametrize("size", [2, 4])
def test_device_mesh(run, size):
    assert_reports(run(size, body_device_mesh, timeout=120))


# ---- DDP --------------------------------------------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 64)
        self.l2 = torch.nn.Linear(64, 32)
        self.head_a = torch.nn.Linear(32, 4)
        self.head_b = torch.nn.Linear(32, 4)

    def forward(self, x, use=None):
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        if use is None:
            return self.head_a(h) + self.head_b(h)
        return self.head_b(h) if use == "b" else self.head_a(h)


def _train(ctx, group, mode):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(1234 + ctx.rank)  # different on purpose: DDP must broadcast rank 0's
    net = _Net()
    ddp = DDP(net, process_group=group, bucket_cap_mb=0.01, find_unused_parameters=(mode == "unused"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(99 + ctx.rank)
    for step in range(4):
        opt.zero_grad()
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        if mode == "no_sync":
            with ddp.no_sync():
                torch.nn.functional.mse_loss(ddp(x[:4]), y[:4]).backward()
            torch.nn.functional.mse_loss(ddp(x[4:]), y[4:]).backward()
        else:
            use = ("a", "b")[step % 2] if mode == "unused" else None  # one head unused each step
            torch.nn.functional.mse_loss(ddp(x, use), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def body_ddp(ctx, mode):
    ctx.init(timeout=60)
    rep = Report(ctx)
    gloo = dist.new_group(backend="gloo")
    mine = _train(ctx, None, mode)
    ref = _train(ctx, gloo, mode)
    exact = ctx.size == 2
    for i, (a, b) in enumerate(zip(mine, ref)):
        ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        rep.check(ok, f"DDP {mode}: parameter {i} differs from gloo's (max diff {(a - b).abs().max().item():.3g})")
    # the replicas agree with each other
    flat = torch.cat([p.reshape(-1) for p in mine])
    r0 = flat.clone()
    dist.broadcast(r0, src=0, group=gloo)
    rep.check(torch.equal(flat, r0), f"DDP {mode}: replicas diverged from rank 0")
    return rep.result()


@pytest.mark.parametrize("mode", ["plain", "unused", "no_sync"])
@pytest.mark.parametrize("size", [2, 3])
def test_ddp_matches_gloo(run, size, mode):
    assert_reports(run(size, body_ddp, mode, timeout=120))


# ---- object collectives --------------------------------------------------------------------

def _obj(r):
    return {"rank": r, "items": list(range(r * 3)), "blob": "x" * (r * 50_000), "t": torch.arange(r + 1)}


def _same_obj(a, b):
    return (isinstance(a, dict) and a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(b[k], torch.Tensor) else a[k] == b[k] for k in b))


def body_objects(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    objs = [_obj(r), "hello", 42] if r == 1 else [None, None, None]
    dist.broadcast_object_list(objs, src=1)
    rep.check(_same_obj(objs[0], _obj(1)) and objs[1:] == ["hello", 42], "broadcast_object_list")
    out = [None] * n
    dist.all_gather_object(out, _obj(r))
    rep.check(all(_same_obj(out[q], _obj(q)) for q in range(n)), "all_gather_object")
    dst = n - 1
    gl = [None] * n if r == dst else None
    dist.gather_object(_obj(r), gl, dst=dst)
    if r == dst:
        rep.check(all(_same_obj(gl[q], _obj(q)) for q in range(n)), "gather_object")
    got = [None]
    dist.scatter_object_list(got, [_obj(q) for q in range(n)] if r == 0 else None, src=0)
    rep.check(_same_obj(got[0], _obj(r)), "scatter_object_list")
    return rep.result()


def test_object_collectives(run):
    assert_reports(run(3, body_objects, timeout=60))


# ---- functional collectives, torch.compile, DTensor ----------------------------------------

def _funcol_program(x, group_name, n):
    import torch.distributed._functional_collectives as funcol

    a = funcol.all_reduce(x, "sum", group_name)
    b = funcol.all_gather_tensor(a * 2, 0, group_name)
    c = funcol.reduce_scatter_tensor(b, "sum", 0, group_name)
    d = funcol.all_to_all_single(b, None, None, group_name)
    e = funcol.broadcast(x, n - 1, group_name)
    f = funcol.all_reduce(x, "max", group_name)
    return a, b, c, d, e, f


def _funcol_expect(n, r):
    xs = [torch.arange(8.0) * (q + 1) + q for q in range(n)]
    a = sum(xs)
    b = torch.cat([a * 2] * n)
    c = (b * n)[r * 8:(r + 1) * 8]
    d = b  # every rank's b is the same, so block q from each rank reassembles b
    e = xs[n - 1]
    f = torch.stack(xs).max(0).values
    return xs[r], (a, b, c, d, e, f)


def body_funcol(ctx, compile_backend):
    import torch.distributed._functional_collectives as funcol

    ctx.init(timeout=120)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    name = dist.group.WORLD.group_name
    x, want = _funcol_expect(n, r)
    got = [funcol.wait_tensor(t) if isinstance(t, torch.Tensor) else t for t in _funcol_program(x, name, n)]
    for k, (g, w) in enumerate(zip(got, want)):
        rep.check(torch.equal(g, w), f"eager funcol result {k}: {g[:4].tolist()} vs {w[:4].tolist()}")
    # coalesced and list forms
    ys = funcol.all_reduce_coalesced([x, x * 2], "sum", name)
    rep.check(torch.equal(ys[0], want[0]) and torch.equal(ys[1], want[0] * 2), "all_reduce_coalesced")
    if compile_backend:
        fn = torch.compile(lambda t: _funcol_program(t, name, n), backend=compile_backend, fullgraph=True)
        got = fn(x)
        for k, (g, w) in enumerate(zip(got, want)):
            rep.check(torch.equal(g, w), f"compiled ({compile_backend}) funcol result {k}")
        got = fn(x)  # second call: the cached graph
        rep.check(torch.equal(got[0], want[0]), f"compiled ({compile_backend}) second call")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_functional_collectives_eager_and_aot_eager(run, size):
    assert_reports(run(size, body_funcol, "aot_eager", timeout=180))


@pytest.mark.slow
def test_functional_collectives_inductor(run):
    """The default torch.compile backend (inductor, C++ codegen): ~50 s on a cold 2-core box."""
    assert_reports(run(2, body_funcol, "inductor", timeout=400))


def body_dtensor(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    ctx.init(timeout=60)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(5)
    A = torch.randn(12, 8, generator=g, dtype=torch.float64)
    B = torch.randn(8, 6, generator=g, dtype=torch.float64)
    dA = distribute_tensor(A, mesh, [Shard(0)])
    rep.check(torch.equal(dA.to_local(), A.chunk(n)[r]), "Shard(0) local piece")
    full = dA.redistribute(mesh, [Replicate()])
    rep.check(torch.equal(full.to_local(), A), "Shard(0) -> Replicate")
    back = full.redistribute(mesh, [Shard(1)])
    rep.check(torch.equal(back.to_local(), A.chunk(n, dim=1)[r]), "Replicate -> Shard(1)")
    dB = distribute_tensor(B, mesh, [Replicate()])
    C = dA @ dB  # Shard(0) x Replicate -> Shard(0)
    rep.check(torch.allclose(C.full_tensor(), A @ B), "Shard(0) @ Replicate")
    C2 = back @ distribute_tensor(B, mesh, [Shard(0)])  # Shard(1) x Shard(0) -> Partial
    rep.check(isinstance(C2.placements[0], Partial), f"Shard(1) @ Shard(0) placement {C2.placements}")
    rep.check(torch.allclose(C2.full_tensor(), A @ B), "Shard(1) @ Shard(0) -> Partial -> full")
    s = C2.redistribute(mesh, [Shard(0)])  # reduce-scatter
    rep.check(torch.allclose(s.to_local(), (A @ B).chunk(n)[r]), "Partial -> Shard(0)")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3])
def test_dtensor(run, size):
    assert_reports(run(size, body_dtensor, timeout=120))


# ---- Work API, profiler, sequence numbers ----------------------------------------------------

def body_work_api(ctx):
    from torch.profiler import ProfilerActivity, profile

    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    total = float(sum(range(1, n + 1)))
    t = torch.full((1000,), float(r + 1))
    w = dist.all_reduce(t, async_op=True)
    rep.check(w.wait(timedelta(seconds=10)) is True, "wait(timeout) returns True")
    rep.check(w.is_completed() and w.is_success() and work_exception(w) is None, "completed / success / no exception")
    res = w.result()
    rep.check(len(res) == 1 and torch.equal(res[0], torch.full((1000,), total)), "result()")
    fut = w.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    rep.check(torch.equal(doubled, torch.full((1000,), 2 * total)), "get_future().then(...)")
    d = w._get_duration()
    rep.check(isinstance(d, float) and 0 <= d < 10_000, f"_get_duration() = {d!r} ms")
    # the future of an op still in flight, chained before completion
    big = torch.full((2_000_000,), float(r + 1))
    w2 = dist.all_reduce(big, async_op=True)
    chained = w2.get_future().then(lambda f: f.value()[0][:3].sum().item())
    w2.wait()
    rep.check(chained.wait() == 3 * total, "then() registered before completion")
    # all ops give a Work with a future
    for name, fn in [("broadcast", lambda: dist.broadcast(torch.ones(3), src=0, async_op=True)),
                     ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(3 * n), torch.ones(3), async_op=True)),
                     ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * n), async_op=True)),
                     ("barrier", lambda: dist.barrier(async_op=True))]:
        wk = fn()
        wk.get_future().wait()
        # (the future completes a moment before the Work, as in gloo: check after wait())
        wk.wait()
        rep.check(wk.is_completed() and wk.is_success(), f"{name}: completed")
    # wait(timeout) shorter than a late peer: raises, the op goes on and completes correctly.
    # Rank 1 joins only once rank 0's wait(200 ms) has raised (the store tells it).
    t = torch.full((10,), float(r + 1))
    late = ctx.store("late_peer")
    if r == 1:
        late.wait(["waited"], timedelta(seconds=60))
    w = dist.all_reduce(t, async_op=True)
    if r == 0:
        try:
            w.wait(timedelta(milliseconds=200))
            rep.fail("wait(200 ms) returned although rank 1 had not joined")
        except Exception as e:  # noqa: BLE001
            # Its own timeout ended the wait, not the op.
            rep.check("still in progress" in str(e), f"wait(timeout) error: {str(e)[:200]}")
        rep.check(not w.is_completed(), "the all_reduce completed without rank 1")
        late.set("waited", "1")
    w.wait()
    rep.check(torch.equal(t, torch.full((10,), total)), "all_reduce after an earlier wait(timeout)")
    # profiler: ranges named myccl:<op> with the input shapes
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(torch.ones(5, 3))
        dist.broadcast(torch.ones(7), src=0, async_op=True).wait()
        dist.all_gather_into_tensor(torch.empty(4 * n), torch.ones(4))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
        dist.all_to_all_single(torch.empty(3 * n), torch.ones(3 * n))
        dist.barrier()
    ev = {}
    for e in prof.events():
        if e.name.startswith("myccl:"):
            ev.setdefault(e.name, e.input_shapes)
    for name, shapes in [("myccl:all_reduce", [[5, 3]]), ("myccl:broadcast", [[7]]),
                         ("myccl:all_gather_into_tensor", [[4]]), ("myccl:reduce_scatter_tensor", [[2 * n]]),
                         ("myccl:all_to_all_single", [[3 * n]]),
                         ("myccl:barrier", None)]:
        rep.check(name in ev, f"profiler has no {name} (got {sorted(ev)})")
        if name in ev and shapes is not None:
            rep.check(ev[name] == shapes, f"{name} input shapes {ev[name]} != {shapes}")
    # torch's comm metadata: a "record_param_comms" event per op, as torch's own backends emit it
    import json
    import os
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), f"trace{r}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    comms = [e.get("args", {}) for e in events if e.get("name") == "record_param_comms"]
    names = {a.get("Collective name") for a in comms}
    want = {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
            "barrier"}
    rep.check(want <= names, f"record_param_comms collectives {sorted(map(str, names))}")
    ar = [a for a in comms if a.get("Collective name") == "all_reduce"]
    rep.check(bool(ar) and ar[0].get("In msg nelems") == 15 and ar[0].get("Out msg nelems") == 15 and
              ar[0].get("Group size") == n and ar[0].get("dtype") == "Float" and
              str(ar[0].get("Process Group Name")) == dist.group.WORLD.group_name and
              ar[0].get("Process Group Ranks") == str(list(range(n))).replace(" ", "").replace(",", ", "),
              f"all_reduce comm metadata {ar[:1]}")
    seq = seq_number()
    return rep.result(), seq


def test_work_api_and_profiler(run):
    results = run(2, body_work_api, timeout=90)
    assert_reports([x[0] for x in results])
    seqs = [x[1] for x in results]
    assert len(set(seqs)) == 1 and seqs[0] > 0, f"sequence numbers {seqs}"


def body_threads_and_single_apis(ctx):
    """Three threads drive three groups at once; torch's *_single entry points (2.13+), or on an
    older torch the names they replaced, which reach the same Backend methods."""
    import threading

    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    groups = [None, dist.new_group(list(range(n))), dist.new_group(list(range(n)))]
    errors = []

    def loop(g, base, numel):
        try:
            for i in range(20):
                t = torch.full((numel,), float(base + r + i))
                dist.all_reduce(t, group=g)
                if not torch.equal(t, torch.full((numel,), float(sum(base + q + i for q in range(n))))):
                    errors.append(f"group {base}: iteration {i}: {t[:2].tolist()}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"group {base}: {type(e).__name__}: {str(e)[:200]}")

    threads = [threading.Thread(target=loop, args=(g, 100 * k, numel))
               for k, (g, numel) in enumerate(zip(groups, [77, 1000, 300_000]))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    rep.check(not any(th.is_alive() for th in threads), "threads still running after 60 s")
    rep.check(not errors, f"concurrent groups: {errors[:5]}")
    x = torch.arange(4.0) + 10 * r
    out = torch.empty(4 * n)
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x)
    rep.check(torch.equal(out, torch.cat([torch.arange(4.0) + 10 * q for q in range(n)])), "all_gather_single")
    o = torch.empty(2)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(o, torch.arange(2.0 * n) + r)
    rep.check(torch.equal(o, (torch.arange(2.0 * n) * n + sum(range(n)))[2 * r:2 * r + 2]), "reduce_scatter_single")
    outs = [torch.empty(4 * n), torch.empty(2 * n)]
    pg = dist.group.WORLD
    getattr(pg, "all_gather_single_coalesced", pg.allgather_into_tensor_coalesced)(outs, [x, x[:2].clone()]).wait()
    rep.check(torch.equal(outs[1], torch.cat([torch.arange(2.0) + 10 * q for q in range(n)])), "all_gather_single_coalesced")
    return rep.result()


def test_concurrent_groups_and_single_apis(run):
    assert_reports(run(3, body_threads_and_single_apis, timeout=90))


def body_debug_detail(ctx):
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    rep.check(dist.get_debug_level() == dist.DebugLevel.DETAIL, f"debug level {dist.get_debug_level()}")
    ctx.init(timeout=30)
    pg = dist.group.WORLD
    seqs = [seq_number(pg)]
    _smoke(rep, ctx, "DETAIL")
    seqs.append(seq_number(pg))
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * n))
    rep.check(torch.equal(out, torch.arange(2.0 * n)[2 * r:2 * r + 2] * n), "DETAIL reduce_scatter_tensor")
    dist.barrier()
    seqs.append(seq_number(pg))
    # torch's wrapper catches ranks that call different collectives, before myccl runs them
    try:
        dist.all_reduce(torch.ones(3 + r))
        rep.fail("mismatched shapes under DETAIL raised nothing")
    except RuntimeError as e:
        rep.check("mismatch" in str(e).lower() or "inconsistent" in str(e).lower(), f"DETAIL mismatch error: {str(e)[:200]}")
    _smoke(rep, ctx, "DETAIL after a caught mismatch")
    seqs.append(seq_number(pg))
    return rep.result(), seqs


def test_torch_distributed_debug_detail(run):
    results = run(2, body_debug_detail, timeout=90, world_env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert_reports([x[0] for x in results])
    seqs = [x[1] for x in results]
    assert all(s == seqs[0] for s in seqs), f"sequence numbers differ between ranks: {seqs}"
    assert seqs[0] == sorted(seqs[0]) and seqs[0][-1] > seqs[0][0], f"sequence numbers did not advance: {seqs[0]}"


# ---- timeouts, set_timeout, abort, shutdown, get_error ----------------------------------------

def body_absent_rank(ctx, transport):
    """Rank n-1 never joins an all_reduce: the others fail within the 3 s timeout naming the op,
    the group then refuses further use, and destroy + init gives a working group again."""
    import c10d_ext

    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    absent = n - 1
    store = ctx.store("absent")
    ctx.init(timeout=3, pg_options=c10d_ext.Options(transport=transport))
    _smoke(rep, ctx, "before the hang")
    be = _cpu_backend()
    rep.check(be.get_error() == ErrorType.SUCCESS, f"get_error() before any failure: {be.get_error()}")
    msg = None
    if r != absent:
        t = torch.ones(50_000)
        w = dist.all_reduce(t, async_op=True)
        try:
            w.wait()
            rep.fail("all_reduce with an absent rank completed")
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0]
            rep.check(isinstance(e, dist.DistBackendError), f"error type {type(e).__name__}")
            rep.check("myccl" in msg and "all_reduce" in msg, f"error does not name the op: {msg}")
            # the group's own timeout ended it
            rep.check("Timed out after 3000 ms" in msg, f"error does not say Timed out after 3000 ms: {msg}")
            rep.check(f"rank {absent}" in msg, f"error does not name the absent rank {absent}: {msg}")
        rep.check(w.is_completed() and not w.is_success() and work_exception(w) is not None,
                  "failed Work: is_completed / is_success / exception()")
        try:
            w.get_future().wait()
            rep.fail("the failed op's future has no error")
        except Exception:  # noqa: BLE001
            pass
        rep.check(be.get_error() == ErrorType.TIMEOUT, f"get_error() after a timeout: {be.get_error()}")
        try:
            dist.all_reduce(torch.ones(3))
            rep.fail("the group accepted an op after a timeout")
        except Exception as e:  # noqa: BLE001
            # refused for the earlier failure (which it quotes), not after a timeout of its own
            own, _, earlier = str(e).partition("unusable after an earlier failure")
            rep.check(bool(earlier) and "Timed out" not in own, f"refusal after a failure: {str(e)[:300]}")
            rep.check("myccl" in str(e), f"refusal does not name myccl: {str(e)[:200]}")
        store.add("failed", 1)
    else:
        while int(store.add("failed", 0)) < n - 1:
            time.sleep(0.05)
        # the absent rank arrives late: it learns from the peers that gave up, not by its own timeout
        try:
            dist.all_reduce(torch.ones(50_000))
            rep.fail("the late rank's all_reduce completed although its peers gave up")
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0]
            own, _, peers = msg.partition("closed its connections")
            rep.check(bool(peers) and "Timed out" not in own, f"the late rank waited out its own timeout: {msg[:300]}")
            rep.check("myccl" in msg and "all_reduce" in msg and ("rank 0" in msg or "rank 1" in msg),
                      f"late rank's error does not say which peer gave up: {msg}")
    dist.destroy_process_group()
    ctx.init(timeout=30)
    _smoke(rep, ctx, "after destroy + init")
    return rep.result(), msg


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_absent_rank_times_out_then_reinit(run, transport):
    results = run(3, body_absent_rank, transport, timeout=90)
    assert_reports([x[0] for x in results])


def body_set_timeout(ctx):
    rep = Report(ctx)
    ctx.init(timeout=60)
    be = _cpu_backend()
    if hasattr(dist, "set_timeout"):  # torch 2.14+
        dist.set_timeout(timedelta(seconds=2))
    else:
        dist.group.WORLD.set_timeout(timedelta(seconds=2))
    rep.check(be.timeout == timedelta(seconds=2), f"backend timeout after set_timeout: {be.timeout}")
    _smoke(rep, ctx, "after set_timeout")
    store = ctx.store("set_timeout")
    if ctx.rank == 0:
        try:
            dist.all_reduce(torch.ones(4))
            rep.fail("all_reduce without peers completed")
        except Exception as e:  # noqa: BLE001
            # the new timeout ended it (the group was made with 60 s)
            rep.check("Timed out after 2000 ms" in str(e), f"error does not give the new timeout: {str(e).splitlines()[0]}")
        store.set("gave_up", "1")
    else:
        store.wait(["gave_up"], timedelta(seconds=60))  # stays away until rank 0 gave up
    return rep.result()


def test_set_timeout(run):
    assert_reports(run(2, body_set_timeout, timeout=60))


def body_abort(ctx):
    """rank 0 aborts while rank 1 waits in an all_reduce: rank 1 learns at once (not after
    its 60 s timeout); rank 0's group refuses further ops; both re-init and work."""
    rep = Report(ctx)
    ctx.init(timeout=60)
    _smoke(rep, ctx, "before abort")
    if ctx.rank == 0:
        time.sleep(1.0)
        dist.group.WORLD.abort()
        try:
            dist.all_reduce(torch.ones(2))
            rep.fail("all_reduce after abort() completed")
        except Exception as e:  # noqa: BLE001
            rep.check("abort" in str(e).lower() or "myccl" in str(e), f"error after abort: {str(e)[:200]}")
    else:
        try:
            dist.all_reduce(torch.ones(2))
            rep.fail("all_reduce completed although rank 0 aborted")
        except Exception as e:  # noqa: BLE001
            # learned from rank 0's abort, not from its own 60 s timeout
            rep.check("Timed out" not in str(e), f"peer of an aborted rank waited out its timeout: {str(e)[:200]}")
            rep.check("rank 0" in str(e), f"error does not name rank 0: {str(e).splitlines()[0]}")
            err = _cpu_backend().get_error()
            rep.check(err == ErrorType.COMM_ERROR or err == ErrorType.REMOTE_ERROR,
                      f"get_error() on the peer of an aborted rank: {err}")
    dist.destroy_process_group()
    ctx.init(timeout=30)
    _smoke(rep, ctx, "after abort + re-init")
    # shutdown(): orderly; later ops raise; destroy still fine
    dist.group.WORLD.shutdown()
    try:
        dist.all_reduce(torch.ones(2))
        rep.fail("all_reduce after shutdown() completed")
    except Exception as e:  # noqa: BLE001
        rep.check("shut down" in str(e), f"error after shutdown: {str(e)[:200]}")
    dist.destroy_process_group()
    ctx.init(timeout=30)
    _smoke(rep, ctx, "after shutdown + re-init")
    return rep.result()


def test_abort_and_shutdown(run):
    assert_reports(run(2, body_abort, timeout=90))
