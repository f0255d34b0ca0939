"""c10d_ext.horovod: every op of horovod.torch at 1-4 ranks, each rank's result against a local
expectation (Horovod's semantics: /docs/HOROVOD.md); fusion, autograd, the CUDA path on the
strict double. Process sets, join, errors and launch: tests/horovod/test_horovod_sets.py."""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import DOUBLE
from hvd_helpers import quiet_heartbeat, start, stop, value

DTYPES_REDUCE = [torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
DTYPES_MOVE = DTYPES_REDUCE + [torch.uint8, torch.int8, torch.int16]


# (world size, world env): 1-4 ranks on CPU, and 2 ranks whose tensors myccl's CUDA engine takes
# (the strict CUDA double stands in for CUDA and NCCL)
SIZES = [pytest.param(n, None, id=str(n)) for n in (1, 2, 3, 4)] + [pytest.param(2, DOUBLE, id="2-cuda-double")]


# ---- basics -------------------------------------------------------------------------------------
def _basics(ctx):
    import torch.distributed as dist

    import c10d_ext.horovod as hvd

    out = {}
    try:
        hvd.size()
    except ValueError as e:
        out["before"] = str(e)
    try:
        hvd.allreduce(torch.ones(1))
    except hvd.HorovodInternalError as e:
        out["op_before"] = str(e)
    hvd = start(ctx)
    hvd.init()  # idempotent
    out.update(size=hvd.size(), rank=hvd.rank(), dist=(dist.get_world_size(), dist.get_rank()),
               local=(hvd.local_rank(), hvd.local_size()), cross=(hvd.cross_rank(), hvd.cross_size()),
               homog=hvd.is_homogeneous(), init=hvd.is_initialized(),
               flags=(hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.ddl_built(), hvd.ccl_built(),
                      hvd.rocm_built(), hvd.cuda_built(), hvd.nccl_built() > 0))
    try:
        hvd.mpi_threads_supported()
    except ValueError as e:
        out["mpi_threads"] = str(e)
    hvd.shutdown()
    out["after_shutdown"] = hvd.is_initialized()
    try:
        hvd.allreduce(torch.ones(1))
    except hvd.HorovodInternalError:
        out["op_after_shutdown"] = True
    hvd.init()
    out["again"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_basics(run, size):
    import c10d_ext

    built = bool(c10d_ext.build_info().get("with_nccl"))
    for r, out in enumerate(run(size, _basics, timeout=60)):
        assert out["before"] == "Horovod has not been initialized; use hvd.init()."
        assert out["op_before"] == "Horovod has not been initialized; use hvd.init()."
        assert (out["size"], out["rank"]) == (size, r) and out["dist"] == (size, r)
        assert out["local"] == (r, size) and out["cross"] == (0, 1) and out["homog"] and out["init"]
        assert out["flags"] == (False, False, False, False, False, False, built, built)
        assert "MPI is not enabled" in out["mpi_threads"]
        assert out["after_shutdown"] is False and out["op_after_shutdown"]
        assert out["again"] == [float(size)] * 2


# ---- allreduce ----------------------------------------------------------------------------------
def _expect_reduce(size, dtype, op, shape=(5,), pre=1.0, post=1.0, salt=0):
    # Horovod scales integers through a double and truncates: before the reduction, and after
    ins = [value(r, torch.float64, shape, salt) * pre for r in range(size)]
    if not dtype.is_floating_point:
        ins = [t.trunc() for t in ins]
    stack = torch.stack(ins)
    if op == 0:
        out = stack.sum(0) * (post / size)
    elif op == 1:
        out = stack.sum(0) * post
    elif op == 3:
        out = stack.min(0).values * post
    elif op == 4:
        out = stack.max(0).values * post
    else:
        out = stack.prod(0) * post
    return out.trunc().to(dtype) if not dtype.is_floating_point else out.to(dtype)


def _allreduce(ctx, cases):
    hvd = start(ctx)
    try:
        got = []
        for i, (dtype, op, pre, post, mode) in enumerate(cases):
            t = value(ctx.rank, dtype, salt=i % 2)
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post, name=f"c{i}" if i % 3 else None)
            if mode == "sync":
                out = hvd.allreduce(t, **kw)
            elif mode == "async":
                out = hvd.synchronize(hvd.allreduce_async(t, **kw))
            elif mode == "inplace":
                out = hvd.allreduce_(t, **kw)
                assert out is t
            else:
                h = hvd.allreduce_async_(t, **kw)
                out = hvd.synchronize(h)
                assert out is t and hvd.synchronize(h) is None
            got.append(out)
        return got
    finally:
        stop(hvd)


def _reduce_cases():
    cases = []
    modes = ["sync", "async", "inplace", "async_"]
    i = 0
    for dtype in DTYPES_REDUCE:
        for op in (0, 1, 3, 4, 5):
            pre, post = ((0.5, 3.0) if op in (0, 1) and i % 2 else (1.0, 1.0))
            cases.append((dtype, op, pre, post, modes[i % 4]))
            i += 1
    return cases


@pytest.mark.parametrize("size,world_env", SIZES)
def test_allreduce(run, size, world_env):
    cases = _reduce_cases()
    for r, got in enumerate(run(size, _allreduce, cases, timeout=120, world_env=world_env)):
        for i, ((dtype, op, pre, post, _), out) in enumerate(zip(cases, got)):
            want = _expect_reduce(size, dtype, op, pre=pre, post=post, salt=i % 2)
            assert out.dtype == dtype, (i, out.dtype)
            torch.testing.assert_close(out, want, rtol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6,
                                       atol=1e-2, msg=f"rank {r} case {i} {dtype} op {op}")


def _average_compat(ctx):
    import warnings

    hvd = start(ctx)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = hvd.allreduce(torch.tensor([2.0]), average=False).item()
            b = hvd.allreduce(torch.tensor([2.0]), average=True).item()
        try:
            hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
            err = None
        except ValueError as e:
            err = str(e)
        return a, b, [str(x.message) for x in w if x.category is DeprecationWarning], err
    finally:
        stop(hvd)


def test_average_argument(run):
    for a, b, warns, err in run(2, _average_compat, timeout=60):
        assert (a, b) == (4.0, 2.0)
        assert warns and "replaced with `op`" in warns[0]
        assert err == "The op parameter supersedes average. Please provide only one of them."


def _fusion(ctx, n, threshold):
    import c10d_ext
    from c10d_ext.horovod.basics import STATE

    def reduces():
        stats = c10d_ext.stats(STATE.group)
        # a cycle of one tensor that every rank offered is reduced by the agreed op (one host)
        count = sum(v["count"] for k, v in stats.items() if isinstance(v, dict) and
                    (v.get("op") == "all_reduce" or k == "agreed_all_reduce/shm-agreed"))
        c10d_ext.reset_stats(STATE.group)
        return count

    quiet_heartbeat()  # the test counts the set's collectives
    hvd = start(ctx)
    try:
        c10d_ext.reset_stats(STATE.group)
        handles = [hvd.allreduce_async(torch.full((3,), float(i + ctx.rank)), name=f"f{i}", op=hvd.Sum)
                   for i in range(n)]
        outs = [hvd.synchronize(h).tolist() for h in handles]
        async_reduces = reduces()
        grouped = hvd.grouped_allreduce([torch.full((2,), float(i)) for i in range(n)], op=hvd.Sum)
        return outs, [g.tolist() for g in grouped], async_reduces, reduces()
    finally:
        stop(hvd)


@pytest.mark.parametrize("threshold", [None, "0"])
def test_fusion(run, threshold):
    """100 async allreduces and a grouped one of 100: fused into few collectives (the grouped
    one, synchronous on an idle set, into exactly one: the agreed op of one fused buffer, on one
    host), or with HOROVOD_FUSION_THRESHOLD=0 one per tensor; the values are the same."""
    n, size = 100, 2
    env = {"HOROVOD_FUSION_THRESHOLD": threshold} if threshold else None
    for outs, grouped, async_reduces, grouped_reduces in run(size, _fusion, n, threshold, env=env, timeout=120):
        assert outs == [[float(2 * i + 1)] * 3 for i in range(n)]
        assert grouped == [[float(2 * i)] * 2 for i in range(n)]
        if threshold == "0":
            assert (async_reduces, grouped_reduces) == (n, n)
        else:
            assert grouped_reduces == 1, grouped_reduces
            assert async_reduces < n, async_reduces  # how many depends on when they were submitted


# ---- allgather, broadcast, alltoall, reducescatter ----------------------------------------------
def _movers(ctx):
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    try:
        out = {}
        out["ag"] = [hvd.allgather(value(r, dt, (r + 1, 2)), name=f"ag{i}") for i, dt in enumerate(DTYPES_MOVE)]
        out["ag_async"] = hvd.synchronize(hvd.allgather_async(torch.full((r % 2, 3), float(r))))
        out["gag"] = hvd.grouped_allgather([torch.full((r + 1,), r), torch.full((1, 2), float(r))])
        out["bc"] = [hvd.broadcast(value(r, dt, (2, 3)), root_rank=n - 1) for dt in DTYPES_MOVE]
        t = value(r, torch.float32, (4,))
        out["bc_"] = (hvd.broadcast_(t, 0) is t, t)
        t2 = value(r, torch.int64, (3,))
        out["bc_async_"] = hvd.synchronize(hvd.broadcast_async_(t2, root_rank=0)) is t2 and t2.tolist()
        splits = [(r + j) % 3 for j in range(n)]
        src = torch.arange(sum(splits) + 1, dtype=torch.float32) + 100 * r  # one trailing row is not sent
        out["a2a"] = hvd.alltoall(src, splits=splits)
        out["a2a_even"] = hvd.alltoall(torch.arange(2 * n) + 10 * r)
        out["a2a_async"] = hvd.synchronize(hvd.alltoall_async(torch.arange(n, dtype=torch.int8)))
        out["a2a_tensor_splits"] = hvd.alltoall(torch.ones(n, 2), splits=torch.ones(n, dtype=torch.int32))
        rows = 2 * n + 1  # uneven: the first rank gets one row more
        x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) + r
        out["rs_avg"] = hvd.reducescatter(x)
        out["rs_sum"] = hvd.reducescatter(x.to(torch.int32), op=hvd.Sum, prescale_factor=2.0)
        out["rs_small"] = hvd.reducescatter(torch.ones(1, 3) * (r + 1), op=hvd.Sum)  # fewer rows than ranks
        out["grs"] = hvd.grouped_reducescatter([x, torch.ones(n, 1)], op=hvd.Sum)
        return out
    finally:
        stop(hvd)


def _rows(total, n, r):
    d, extra = divmod(total, n)
    start = r * d + min(r, extra)
    return start, d + (1 if r < extra else 0)


@pytest.mark.parametrize("size,world_env", SIZES)
def test_allgather_broadcast_alltoall_reducescatter(run, size, world_env):
    for r, out in enumerate(run(size, _movers, timeout=120, world_env=world_env)):
        for dt, got in zip(DTYPES_MOVE, out["ag"]):
            assert torch.equal(got, torch.cat([value(s, dt, (s + 1, 2)) for s in range(size)])), dt
        assert torch.equal(out["ag_async"], torch.cat([torch.full((s % 2, 3), float(s)) for s in range(size)]))
        g0, g1 = out["gag"]
        assert torch.equal(g0, torch.cat([torch.full((s + 1,), s) for s in range(size)]))
        assert torch.equal(g1, torch.cat([torch.full((1, 2), float(s)) for s in range(size)]))
        for dt, got in zip(DTYPES_MOVE, out["bc"]):
            assert torch.equal(got, value(size - 1, dt, (2, 3))), dt
        same, t = out["bc_"]
        assert same and torch.equal(t, value(0, torch.float32, (4,)))
        assert out["bc_async_"] == value(0, torch.int64, (3,)).tolist()
        got, recv = out["a2a"]
        want, want_splits = [], []
        for s in range(size):
            sp = [(s + j) % 3 for j in range(size)]
            off = sum(sp[:r])
            want.append(torch.arange(sum(sp) + 1, dtype=torch.float32)[off:off + sp[r]] + 100 * s)
            want_splits.append(sp[r])
        assert torch.equal(got, torch.cat(want)) and recv.tolist() == want_splits and recv.dtype == torch.int32
        assert torch.equal(out["a2a_even"], torch.cat([torch.arange(2 * r, 2 * r + 2) + 10 * s for s in range(size)]))
        got, recv = out["a2a_async"]
        assert got.tolist() == [r] * size and recv.tolist() == [1] * size
        got, recv = out["a2a_tensor_splits"]
        assert got.shape == (size, 2) and recv.tolist() == [1] * size
        rows = 2 * size + 1
        full = sum(torch.arange(rows * 2, dtype=torch.float64).view(rows, 2) + s for s in range(size))
        st, k = _rows(rows, size, r)
        torch.testing.assert_close(out["rs_avg"], (full / size).float()[st:st + k])
        full_i = sum((torch.arange(rows * 2).view(rows, 2) + s) * 2 for s in range(size)).to(torch.int32)
        assert torch.equal(out["rs_sum"], full_i[st:st + k])
        st1, k1 = _rows(1, size, r)
        assert torch.equal(out["rs_small"], (torch.ones(1, 3) * sum(range(1, size + 1)))[st1:st1 + k1])
        a, b = out["grs"]
        torch.testing.assert_close(a, full.float()[st:st + k])
        sb, kb = _rows(size, size, r)
        assert torch.equal(b, torch.full((size, 1), float(size))[sb:sb + kb])


# ---- autograd -----------------------------------------------------------------------------------
def _grads(ctx):
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    try:
        out = {}
        x = torch.full((3,), float(r + 1), requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
        out["allreduce"] = x.grad.tolist()
        xs = [torch.full((2,), 1.0, requires_grad=True) for _ in range(2)]
        ys = hvd.grouped_allreduce(xs, op=hvd.Average)
        (ys[0] * (r + 1) + ys[1] * 2).sum().backward()
        out["grouped"] = [t.grad.tolist() for t in xs]
        x = torch.ones(r + 1, 2, requires_grad=True)
        y = hvd.allgather(x)
        (y * torch.arange(y.shape[0]).view(-1, 1) * (r + 1)).sum().backward()
        out["allgather"] = x.grad.tolist()
        x = torch.ones(2, requires_grad=True)
        (hvd.broadcast(x, root_rank=n - 1) * (r + 1)).sum().backward()
        out["broadcast"] = x.grad.tolist()
        x = torch.arange(float(n), requires_grad=True)
        y = hvd.alltoall(x)
        (y * (r + 1)).sum().backward()
        out["alltoall"] = x.grad.tolist()
        x = torch.ones(n, 2, requires_grad=True)
        (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
        out["reducescatter"] = x.grad.tolist()
        return out
    finally:
        stop(hvd)


@pytest.mark.parametrize("size", [2, 3])
def test_autograd(run, size):
    """Horovod's gradients: allreduce's backward is the same allreduce; allgather's the average
    of the upstream gradients, this rank's rows; broadcast's the average on the root, zero
    elsewhere; alltoall's the reverse alltoall; reducescatter(Sum)'s size x the allgather."""
    total = sum(range(1, size + 1))
    for r, out in enumerate(run(size, _grads, timeout=120)):
        assert out["allreduce"] == [float(total)] * 3
        assert out["grouped"] == [[total / size] * 2, [2.0] * 2]
        offs = sum(s + 1 for s in range(r))
        rows = sum(s + 1 for s in range(size))
        avg = [[(total / size) * i] * 2 for i in range(rows)]
        assert out["allgather"] == avg[offs:offs + r + 1]
        assert out["broadcast"] == ([total / size] * 2 if r == size - 1 else [0.0] * 2)
        assert out["alltoall"] == [float(s + 1) for s in range(size)]
        assert out["reducescatter"] == [[float(size * (s + 1))] * 2 for s in range(size)]


def _sparse(ctx):
    hvd = start(ctx)
    r = hvd.rank()
    try:
        t = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0, 2.0 * (r + 1)]), (5,))
        avg = hvd.sparse_allreduce_async(t, "emb", hvd.Average)().to_dense()
        summed = hvd.sparse_allreduce_async(t, "emb2", hvd.Sum)().to_dense()
        return avg.tolist(), summed.tolist()
    finally:
        stop(hvd)


def test_sparse_allreduce(run):
    size = 3
    dense = sum(torch.sparse_coo_tensor(torch.tensor([[s, 3]]), torch.tensor([1.0, 2.0 * (s + 1)]), (5,)).to_dense()
                for s in range(size))
    for avg, summed in run(size, _sparse, timeout=60):
        assert summed == dense.tolist()
        torch.testing.assert_close(torch.tensor(avg), dense / size)


# ---- CUDA path on the strict double ------------------------------------------------------------
def _on_double(ctx):
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    try:
        out = {"sum": hvd.allreduce(torch.full((4,), float(r + 1)), op=hvd.Sum).tolist(),
               "ag": hvd.allgather(torch.full((r + 1,), float(r))).tolist(),
               "bc": hvd.broadcast(torch.full((3,), float(r)), root_rank=1).tolist(),
               "rs": hvd.reducescatter(torch.ones(2 * n + 1), op=hvd.Sum).tolist(),
               "a2a": hvd.alltoall(torch.arange(float(n)) + r)}
        hs = [hvd.allreduce_async(torch.full((2,), float(i)), name=f"d{i}", op=hvd.Sum) for i in range(20)]
        out["fused"] = [hvd.synchronize(h).tolist() for h in hs]
        import cuda_double

        out["violations"] = cuda_double.violations()
        out["counters"] = cuda_double.counters()
    finally:
        stop(hvd)
    return out


def test_cuda_path_on_double(run):
    """With the strict CUDA double installed, myccl routes these tensors to its CUDA engine: the
    Horovod layer (negotiation on CPU, data on the engine's streams) gives the same results and
    the double sees no stream or event misuse."""
    size = 2
    for r, out in enumerate(run(size, _on_double, timeout=120, world_env=DOUBLE)):
        assert out["sum"] == [3.0] * 4
        assert out["ag"] == [0.0, 1.0, 1.0]
        assert out["bc"] == [1.0] * 3
        st, k = _rows(2 * size + 1, size, r)
        assert out["rs"] == [float(size)] * k
        assert out["a2a"].tolist() == [float(r + s) for s in range(size)]
        assert out["fused"] == [[2.0 * i] * 2 for i in range(20)]
        assert out["violations"] == [], out["violations"]
        assert any(v > 0 for k, v in out["counters"].items() if "launch" in k or "coll" in k), out["counters"]
