"""Every collective x reduce op x dtype x shape class at world sizes 1-4, each rank comparing
its result with a local expectation (bit for bit where torch can compute it the same way).

Shape classes: empty, 0-dim, small, 2-D, medium (takes the sliced path), large (many
pipeline segments: the tests shrink the segment size), non-contiguous.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import Report
from expect import SHAPES, ALL_DTYPES, cases, inputs, COMPLEX, REDOPS, exact, make, premul_factor, redop, reduce_all, same, valid

LARGE_DTYPES = {torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.complex64}
WORLD_SIZES = [1, 2, 3, 4]
CHUNK = 64 * 1024  # small pipeline segments so "large" really is multi-segment


def _init(ctx, transport):
    import c10d_ext

    ctx.init(pg_options=c10d_ext.Options(transport=transport, tcp_chunk_bytes=CHUNK, shm_buffer_bytes=CHUNK))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    want_shm = transport == "auto" and ctx.size > 1
    if backend.uses_shared_memory != want_shm:
        raise AssertionError(f"transport={transport}: uses_shared_memory={backend.uses_shared_memory}")


def _inputs(ctx, shape_name, dtype, seed):
    return inputs(ctx.size, shape_name, dtype, seed)


def _cases(dtypes=ALL_DTYPES, shapes=SHAPES):
    return cases(dtypes, LARGE_DTYPES, shapes)


# ---- per-rank bodies -----------------------------------------------------------------------

def body_all_reduce(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    seed = 0
    for dtype, shape_name in _cases():
        for op in REDOPS:
            seed += 1
            xs = _inputs(ctx, shape_name, dtype, seed)
            t = xs[ctx.rank].clone()
            what = f"all_reduce {op} {dtype} {shape_name}"
            # torch's own all_reduce refuses these for complex tensors before any backend runs
            torch_rejects = dtype in COMPLEX and op in ("PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
            if not valid(op, dtype) or torch_rejects:
                rep.expect_value_error(lambda: dist.all_reduce(t, op=redop(op, ctx.rank)), what)
                continue
            dist.all_reduce(t, op=redop(op, ctx.rank))
            rep.check(same(t, reduce_all(xs, op), exact(op, dtype)), what)
            rep.check(t.stride() == xs[ctx.rank].stride(), what + " (strides kept)")
    if transport == "tcp" and ctx.size >= 4:
        import c10d_ext

        rep.check("all_reduce/tcp-ring" in c10d_ext.stats(), f"ring all_reduce never ran: {sorted(c10d_ext.stats())}")
    # async + wait + future
    t = torch.ones(1000) * (ctx.rank + 1)
    w = dist.all_reduce(t, async_op=True)
    fut = w.get_future()
    w.wait()
    rep.check(w.is_completed() and w.is_success(), "async all_reduce completed")
    rep.check(torch.equal(fut.value()[0], torch.full((1000,), float(sum(range(1, ctx.size + 1))))), "future value")
    return rep.result()


def body_reduce(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    seed = 100
    for root in range(ctx.size):
        for dtype, shape_name in _cases(shapes=["scalar", "small", "medium", "large", "noncontig", "empty"]):
            for op in REDOPS:
                if not valid(op, dtype):
                    continue
                seed += 1
                xs = _inputs(ctx, shape_name, dtype, seed)
                t = xs[ctx.rank].clone()
                dist.reduce(t, dst=root, op=redop(op, ctx.rank))
                what = f"reduce root={root} {op} {dtype} {shape_name}"
                if ctx.rank == root:
                    rep.check(same(t, reduce_all(xs, op), exact(op, dtype)), what)
                else:
                    rep.check(torch.equal(t, xs[ctx.rank]), what + " (non-root input untouched)")
    return rep.result()


def body_broadcast(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    for root in range(ctx.size):
        for dtype, shape_name in _cases():
            xs = _inputs(ctx, shape_name, dtype, root + 7)
            t = xs[ctx.rank].clone()
            dist.broadcast(t, src=root)
            rep.check(torch.equal(t, xs[root]), f"broadcast root={root} {dtype} {shape_name}")
    if transport == "tcp" and ctx.size >= 4:
        import c10d_ext

        rep.check("broadcast/tcp-binomial-tree" in c10d_ext.stats(), "tree broadcast never ran")
    # Large enough for the scatter+all-gather path at 4 ranks.
    big = make(ctx.rank, (400_000,), torch.float32, 3)
    dist.broadcast(big, src=ctx.size - 1)
    rep.check(torch.equal(big, make(ctx.size - 1, (400_000,), torch.float32, 3)), "broadcast 1.6 MB")
    return rep.result()


def body_all_gather(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    n = ctx.size
    for dtype, shape_name in _cases():
        xs = _inputs(ctx, shape_name, dtype, 11)
        outs = [torch.empty_like(xs[r]) for r in range(n)]
        dist.all_gather(outs, xs[ctx.rank])
        rep.check(all(torch.equal(outs[r], xs[r]) for r in range(n)), f"all_gather {dtype} {shape_name}")
        # into one tensor, concatenated along dim 0 and stacked
        x = xs[ctx.rank]
        if x.dim() >= 1:
            cat = torch.empty((x.shape[0] * n, *x.shape[1:]), dtype=dtype)
            dist.all_gather_into_tensor(cat, x.contiguous())
            rep.check(torch.equal(cat, torch.cat(xs)), f"all_gather_into_tensor cat {dtype} {shape_name}")
        stk = torch.empty((n, *x.shape), dtype=dtype)
        dist.all_gather_into_tensor(stk, x)
        rep.check(torch.equal(stk, torch.stack(xs)), f"all_gather_into_tensor stack {dtype} {shape_name}")
    # uneven blocks
    outs = [torch.empty(r + 1) for r in range(n)]
    dist.all_gather(outs, torch.full((ctx.rank + 1,), float(ctx.rank)))
    rep.check(all(torch.equal(outs[r], torch.full((r + 1,), float(r))) for r in range(n)), "all_gather uneven")
    # non-contiguous outputs
    base = torch.zeros(4, n * 3)
    outs = [base[:, r * 3:(r + 1) * 3] for r in range(n)]
    x = make(ctx.rank, (4, 3), torch.float32, 5)
    dist.all_gather(outs, x)
    rep.check(torch.equal(base, torch.cat([make(r, (4, 3), torch.float32, 5) for r in range(n)], dim=1)),
              "all_gather into column views")
    # torch 2.14's name for the tensor form (all_gather_into_tensor is deprecated there)
    if hasattr(dist, "all_gather_single"):
        out = torch.empty(n, 3)
        dist.all_gather_single(out, torch.full((3,), float(ctx.rank)))
        rep.check(torch.equal(out, torch.stack([torch.full((3,), float(r)) for r in range(n)])), "all_gather_single")
    # input and output in the middle of larger buffers (storage offset != 0)
    buf = torch.full((n * 4 + 6,), -1.0)
    x = torch.arange(10.0)[2:6] + 10 * ctx.rank
    dist.all_gather_into_tensor(buf[2:2 + n * 4], x)
    rep.check(torch.equal(buf[2:2 + n * 4], torch.cat([torch.arange(2.0, 6.0) + 10 * r for r in range(n)])) and
              bool((buf[:2] == -1).all()) and bool((buf[2 + n * 4:] == -1).all()),
              "all_gather_into_tensor at a storage offset")
    # output tensor non-contiguous
    out_t = torch.zeros(3, n * 2).t()  # (n*2, 3), non-contiguous
    dist.all_gather_into_tensor(out_t, make(ctx.rank, (2, 3), torch.float32, 6))
    rep.check(torch.equal(out_t, torch.cat([make(r, (2, 3), torch.float32, 6) for r in range(n)])),
              "all_gather_into_tensor non-contiguous output")
    # coalesced (deprecated list API) and the coalescing manager fast path
    ins = [make(ctx.rank, (3,), torch.float32, 8), make(ctx.rank, (2, 2), torch.float32, 9)]
    out_lists = [[torch.empty(3), torch.empty(2, 2)] for _ in range(n)]
    dist.all_gather_coalesced(out_lists, ins)
    rep.check(all(torch.equal(out_lists[r][0], make(r, (3,), torch.float32, 8)) and
                  torch.equal(out_lists[r][1], make(r, (2, 2), torch.float32, 9)) for r in range(n)),
              "all_gather_coalesced")
    outs = [torch.empty(n * 5), torch.empty(n * 2, dtype=torch.float64)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], make(ctx.rank, (5,), torch.float32, 12))
        dist.all_gather_into_tensor(outs[1], make(ctx.rank, (2,), torch.float64, 13))
    cm.wait()
    rep.check(torch.equal(outs[0], torch.cat([make(r, (5,), torch.float32, 12) for r in range(n)])) and
              torch.equal(outs[1], torch.cat([make(r, (2,), torch.float64, 13) for r in range(n)])),
              "all_gather_into_tensor coalesced")
    return rep.result()


def body_gather_scatter(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    n = ctx.size
    for root in range(n):
        for dtype, shape_name in _cases(shapes=["scalar", "small", "medium", "noncontig", "empty"]):
            xs = _inputs(ctx, shape_name, dtype, 21 + root)
            outs = [torch.empty_like(xs[r]) for r in range(n)] if ctx.rank == root else None
            dist.gather(xs[ctx.rank], gather_list=outs, dst=root)
            if ctx.rank == root:
                rep.check(all(torch.equal(outs[r], xs[r]) for r in range(n)), f"gather root={root} {dtype} {shape_name}")
            out = torch.empty_like(xs[ctx.rank])
            dist.scatter(out, scatter_list=[x.clone() for x in xs] if ctx.rank == root else None, src=root)
            rep.check(torch.equal(out, xs[ctx.rank]), f"scatter root={root} {dtype} {shape_name}")
    return rep.result()


def body_reduce_scatter(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    n = ctx.size
    seed = 300
    for dtype, shape_name in _cases(shapes=["scalar", "small", "medium", "large", "noncontig", "empty"]):
        for op in REDOPS:
            if not valid(op, dtype):
                continue
            seed += 1
            # list form: block r of every rank's input goes to rank r
            blocks = [[make(src * 100 + r, SHAPES[shape_name] if SHAPES[shape_name] != "T" else (3, 2), dtype, seed)
                       for r in range(n)] for src in range(n)]
            if SHAPES[shape_name] == "T":
                blocks = [[b.t() for b in row] for row in blocks]
            out = torch.empty_like(blocks[ctx.rank][ctx.rank])
            dist.reduce_scatter(out, [b.clone() for b in blocks[ctx.rank]], op=redop(op, ctx.rank))
            want = reduce_all([blocks[src][ctx.rank] for src in range(n)], op)
            rep.check(same(out, want, exact(op, dtype)), f"reduce_scatter {op} {dtype} {shape_name}")
            # tensor form
            if SHAPES[shape_name] not in ((), "T"):
                flat = torch.cat([b.reshape(-1) for b in blocks[ctx.rank]])
                out2 = torch.empty(blocks[ctx.rank][0].numel(), dtype=dtype)
                dist.reduce_scatter_tensor(out2, flat, op=redop(op, ctx.rank))
                rep.check(same(out2, want.reshape(-1), exact(op, dtype)), f"reduce_scatter_tensor {op} {dtype} {shape_name}")
    # torch 2.14's name for the tensor form (reduce_scatter_tensor is deprecated there)
    if hasattr(dist, "reduce_scatter_single"):
        out = torch.empty(2)
        dist.reduce_scatter_single(out, torch.arange(n * 2, dtype=torch.float32) + ctx.rank, op=dist.ReduceOp.MAX)
        rep.check(torch.equal(out, torch.arange(2.0 * ctx.rank, 2.0 * ctx.rank + 2) + n - 1), "reduce_scatter_single")
    # input and output in the middle of larger buffers (storage offset != 0)
    full = torch.arange(n * 3 + 4, dtype=torch.float32) * (ctx.rank + 1)
    buf = torch.full((7,), -1.0)
    dist.reduce_scatter_tensor(buf[2:5], full[4:])
    wsum = sum(r + 1 for r in range(n)) * torch.arange(4.0 + 3 * ctx.rank, 4.0 + 3 * ctx.rank + 3)
    rep.check(torch.equal(buf[2:5], wsum) and bool((buf[:2] == -1).all()) and bool((buf[5:] == -1).all()),
              "reduce_scatter_tensor at a storage offset")
    # coalescing manager fast path
    ins = [make(ctx.rank, (n * 4,), torch.float32, 31), make(ctx.rank, (n * 3,), torch.float32, 32)]
    outs = [torch.empty(4), torch.empty(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(outs[0], ins[0])
        dist.reduce_scatter_tensor(outs[1], ins[1])
    cm.wait()
    w0 = reduce_all([make(r, (n * 4,), torch.float32, 31) for r in range(n)], "SUM")[ctx.rank * 4:(ctx.rank + 1) * 4]
    w1 = reduce_all([make(r, (n * 3,), torch.float32, 32) for r in range(n)], "SUM")[ctx.rank * 3:(ctx.rank + 1) * 3]
    rep.check(torch.equal(outs[0], w0) and torch.equal(outs[1], w1), "reduce_scatter_tensor coalesced")
    return rep.result()


def body_all_to_all(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    n = ctx.size
    for dtype, shape_name in _cases(shapes=["small", "medium", "2d", "empty"]):
        shape = SHAPES[shape_name]
        rows = shape[0]
        # even: every rank sends rows blocks of `rows` rows
        xs = [make(r, (rows * n, *shape[1:]), dtype, 41) for r in range(n)]
        out = torch.empty_like(xs[ctx.rank])
        dist.all_to_all_single(out, xs[ctx.rank])
        want = torch.cat([xs[src][ctx.rank * rows:(ctx.rank + 1) * rows] for src in range(n)])
        rep.check(torch.equal(out, want), f"all_to_all_single {dtype} {shape_name}")
        # list form
        ins = list(xs[ctx.rank].split(rows)) if rows else [torch.empty(0, *shape[1:], dtype=dtype) for _ in range(n)]
        outs = [torch.empty_like(i) for i in ins]
        dist.all_to_all(outs, [i.clone() for i in ins])
        rep.check(torch.equal(torch.cat(outs), want), f"all_to_all {dtype} {shape_name}")
    # uneven splits: rank s sends (s + d + 1) rows to rank d
    def split(s, d):
        return s + d + 1
    xs = [make(s, (sum(split(s, d) for d in range(n)), 3), torch.float32, 43) for s in range(n)]
    in_splits = [split(ctx.rank, d) for d in range(n)]
    out_splits = [split(s, ctx.rank) for s in range(n)]
    out = torch.empty(sum(out_splits), 3)
    dist.all_to_all_single(out, xs[ctx.rank], out_splits, in_splits)
    want = []
    for s in range(n):
        off = sum(split(s, d) for d in range(ctx.rank))
        want.append(xs[s][off:off + split(s, ctx.rank)])
    rep.check(torch.equal(out, torch.cat(want)), "all_to_all_single uneven splits")
    # the same, with input and output in the middle of larger buffers (storage offset != 0):
    # the blocks must start where the tensors start, and nothing around them may change
    src = torch.full((xs[ctx.rank].shape[0] + 7, 3), -1.0)
    src[3:3 + xs[ctx.rank].shape[0]] = xs[ctx.rank]
    dst = torch.full((sum(out_splits) + 9, 3), -2.0)
    dist.all_to_all_single(dst[5:5 + sum(out_splits)], src[3:3 + xs[ctx.rank].shape[0]], out_splits, in_splits)
    rep.check(torch.equal(dst[5:5 + sum(out_splits)], torch.cat(want)) and bool((dst[:5] == -2).all()) and
              bool((dst[5 + sum(out_splits):] == -2).all()), "all_to_all_single at a storage offset")
    return rep.result()


def body_coalesced_and_barrier(ctx, transport):
    _init(ctx, transport)
    rep = Report(ctx)
    n = ctx.size
    ts = [make(ctx.rank, (5,), torch.float32, 51), make(ctx.rank, (3, 2), torch.float32, 52),
          make(ctx.rank, (0,), torch.float32, 53)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for i, shape in enumerate([(5,), (3, 2), (0,)]):
        rep.check(torch.equal(ts[i], reduce_all([make(r, shape, torch.float32, 51 + i) for r in range(n)], "SUM")),
                  f"coalesced all_reduce tensor {i}")
    ts = [make(ctx.rank, (4,), torch.int64, 61), make(ctx.rank, (2,), torch.int64, 62)]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX)
    rep.check(torch.equal(ts[0], reduce_all([make(r, (4,), torch.int64, 61) for r in range(n)], "MAX")) and
              torch.equal(ts[1], reduce_all([make(r, (2,), torch.int64, 62) for r in range(n)], "MAX")),
              "all_reduce_coalesced MAX int64")
    for _ in range(5):
        dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()
    rep.check(w.is_completed(), "async barrier")
    rep.check(dist.get_backend() == "myccl", "get_backend")
    seq = dist.group.WORLD._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
    rep.check(seq > 0, f"sequence number advanced ({seq})")
    return rep.result()


def body_log_rounds(ctx):
    """From 4 ranks over TCP, small all_reduces and all_gathers take Bruck's log2(n) rounds and
    integer all_reduces of 32 KiB-1 MiB recursive halving-doubling; both must give exactly the
    rank-order result, also when n is not a power of two (ranks sitting out, partial last round)."""
    import c10d_ext

    ctx.init(pg_options=c10d_ext.Options(transport="tcp"))
    rep = Report(ctx)
    n = ctx.size
    seed = 500
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for shape in ((), (7,), (1000,), (8191,)):
            for op in ("SUM", "AVG", "MAX", "PREMUL_SUM"):
                seed += 1
                xs = [make(r, shape, dtype, seed) for r in range(n)]
                t = xs[ctx.rank].clone()
                dist.all_reduce(t, op=redop(op, ctx.rank))
                rep.check(same(t, reduce_all(xs, op)), f"small all_reduce {op} {dtype} {shape}")
    for dtype, numel in ((torch.int64, 4097), (torch.int64, 5003), (torch.int32, 100_001), (torch.int8, 262_143),
                         (torch.bool, 40_000), (torch.int64, 131_072)):
        for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
            if not valid(op, dtype):
                continue
            seed += 1
            xs = [make(r, (numel,), dtype, seed) for r in range(n)]
            t = xs[ctx.rank].clone()
            dist.all_reduce(t, op=redop(op, ctx.rank))
            rep.check(same(t, reduce_all(xs, op)), f"all_reduce {op} {dtype} x{numel}")
    for numel in (1, 5, 1000, 20_000):  # the last is above the Bruck limit: direct
        xs = [make(r, (numel,), torch.float32, numel) for r in range(n)]
        outs = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(outs, xs[ctx.rank])
        rep.check(all(torch.equal(outs[r], xs[r]) for r in range(n)), f"all_gather x{numel}")
        cat = torch.empty(numel * n)
        dist.all_gather_into_tensor(cat, xs[ctx.rank])
        rep.check(torch.equal(cat, torch.cat(xs)), f"all_gather_into_tensor x{numel}")
    outs = [torch.empty(r + 1) for r in range(n)]  # uneven blocks
    dist.all_gather(outs, torch.full((ctx.rank + 1,), float(ctx.rank)))
    rep.check(all(torch.equal(outs[r], torch.full((r + 1,), float(r))) for r in range(n)), "all_gather uneven")
    st = c10d_ext.stats()
    for key in ("all_reduce/tcp-bruck-gather-reduce", "all_reduce/tcp-halving-doubling", "all_gather/tcp-bruck"):
        rep.check(key in st, f"{key} never ran: {sorted(st)}")
    return rep.result()


@pytest.mark.parametrize("size", [5, 6])
def test_log_round_algorithms(run, size):
    results = run(size, body_log_rounds, timeout=240)
    failures = [f for _, fails in results for f in fails]
    assert sum(c for c, _ in results) > 0
    assert not failures, "\n".join(failures[:40])


BODIES = [body_all_reduce, body_reduce, body_broadcast, body_all_gather, body_gather_scatter,
          body_reduce_scatter, body_all_to_all, body_coalesced_and_barrier]


@pytest.mark.parametrize("transport", ["auto", "tcp"], ids=["shm", "tcp"])
@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("body", BODIES, ids=[b.__name__[5:] for b in BODIES])
def test_collective_matrix(run, size, body, transport):
    if size == 1 and transport == "tcp":
        pytest.skip("a group of one rank uses no transport")
    results = run(size, body, transport, timeout=240)
    failures = [f for _, fails in results for f in fails]
    checks = sum(c for c, _ in results)
    assert checks > 0
    assert not failures, f"{len(failures)} of {checks} checks failed:\n" + "\n".join(failures[:40])
