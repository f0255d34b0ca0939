"""Bad arguments: every locally checkable mistake raises at once on the calling rank with a
message naming myccl, the op, the rank and the offending value, and leaves the group usable.

Each bad call is made by ONE rank only (rotating) while the others skip it; then every rank
runs a good collective and checks its value. If a rejected call had sent a byte or consumed a
sequence number, that next collective would hang or come back wrong. Calls that torch's own
Python layer rejects before the backend sees them are also made straight on the ProcessGroup /
Backend objects, so myccl's own check is exercised too; `layer` says who answers a user.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import SHARED_GPU, Report, assert_reports, seq_number

def _be():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _cases(ctx):
    """(name, fn, must-contain strings, layer). Strings are checked case-sensitively; the
    rank is added by the caller. `layer` is "myccl" (message must start with "myccl:") or
    "torch" (torch's Python layer answers; only the type and the value are checked)."""
    n, r = ctx.size, ctx.rank
    pg = dist.group.WORLD
    t = torch.ones(4)
    x6 = torch.arange(float(2 * n))
    rows = 2 * n
    ar = dist.AllreduceOptions
    cases = [
        # roots out of range
        ("broadcast src=n", lambda: dist.broadcast(t, src=n), ["broadcast", f"root {n}"], "myccl"),
        ("broadcast src=-1", lambda: dist.broadcast(t, src=-1), ["broadcast", "root -1"], "myccl"),
        ("reduce dst=n", lambda: dist.reduce(t, dst=n + 5), ["reduce", f"root {n + 5}"], "myccl"),
        ("gather dst=n", lambda: dist.gather(t, None, dst=n), ["gather", f"root {n}"], "myccl"),
        ("scatter src=n", lambda: dist.scatter(t, None, src=n), ["scatter", f"root {n}"], "myccl"),
        # all_to_all_single splits
        ("a2a splits sum", lambda: dist.all_to_all_single(torch.empty(rows), x6, [2] * n, [1] * n),
         ["all_to_all_single", f"sum to {n}", f"{rows} rows"], "myccl"),
        ("a2a out splits sum", lambda: dist.all_to_all_single(torch.empty(rows), x6, [1] * n, [2] * n),
         ["all_to_all_single", "output split sizes sum to", f"{n}"], "myccl"),
        ("a2a wrong count", lambda: dist.all_to_all_single(torch.empty(rows), x6, [rows], [rows]),
         ["all_to_all_single", "1 entries", f"{n} ranks"], "myccl"),
        ("a2a negative split", lambda: dist.all_to_all_single(
            torch.empty(rows), x6, [2] * n, [rows + 1, -1] + [0] * (n - 2)),
         ["all_to_all_single", "negative (-1)"], "myccl"),
        ("a2a uneven rows, no splits", lambda: dist.all_to_all_single(torch.empty(rows + 1), torch.ones(rows + 1)),
         ["all_to_all_single", f"{rows + 1} rows", "divisible"], "myccl"),
        # output sizes
        ("all_gather list too short", lambda: dist.all_gather([torch.empty(4) for _ in range(n - 1)], t),
         ["all_gather", f"{n - 1} tensors", f"{n} ranks"], "myccl"),
        ("all_gather list too long", lambda: dist.all_gather([torch.empty(4) for _ in range(n + 1)], t),
         ["all_gather", f"{n + 1} tensors"], "myccl"),
        ("all_gather own block size", lambda: dist.all_gather([torch.empty(3) for _ in range(n)], t),
         ["all_gather", "3 elements", "4"], "myccl"),
        ("all_gather_into_tensor numel", lambda: dist.all_gather_into_tensor(torch.empty(4 * n + 1), t),
         ["all_gather_into_tensor", f"{4 * n + 1} elements"], "myccl"),
        ("reduce_scatter_tensor numel", lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.empty(4 * n + 1)),
         ["reduce_scatter_tensor", f"{4 * n + 1} elements"], "myccl"),
        ("reduce_scatter list length", lambda: dist.reduce_scatter(torch.empty(4), [torch.ones(4)] * (n - 1)),
         ["reduce_scatter", f"{n - 1} tensors"], "myccl"),
        ("scatter input numel (root)", lambda: dist.scatter(torch.empty(4), [torch.ones(5)] * n if r == 0 else None, src=0),
         ["scatter", "5 elements"], "myccl") if r == 0 else None,
        # mixed dtypes
        ("all_gather mixed dtype", lambda: dist.all_gather([torch.empty(4, dtype=torch.float64) for _ in range(n)], t),
         ["float64"], "torch"),
        ("all_gather mixed dtype (pg)", lambda: pg.allgather([[torch.empty(4, dtype=torch.float64) for _ in range(n)]], [t]).wait(),
         ["all_gather", "dtype"], "myccl"),
        ("all_gather_into_tensor mixed dtype", lambda: dist.all_gather_into_tensor(torch.empty(4 * n, dtype=torch.float64), t),
         ["all_gather_into_tensor", "dtype"], "myccl"),
        ("reduce_scatter_tensor mixed dtype", lambda: dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.int32), torch.ones(4 * n)),
         ["reduce_scatter_tensor", "dtype"], "myccl"),
        ("all_to_all_single mixed dtype", lambda: dist.all_to_all_single(torch.empty(rows, dtype=torch.half), x6),
         ["float16"], "torch"),
        ("all_to_all_single mixed dtype (pg)", lambda: pg.alltoall_base(
            torch.empty(rows, dtype=torch.half), x6, [], [], dist.AllToAllOptions()).wait(),
         ["all_to_all_single", "dtype"], "myccl"),
        # reduce op x dtype
        ("BAND on float", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND), ["all_reduce", "BAND"], "myccl"),
        ("BXOR on float reduce", lambda: dist.reduce(torch.ones(3, dtype=torch.float64), dst=0, op=dist.ReduceOp.BXOR),
         ["reduce", "BXOR"], "myccl"),
        ("AVG on bool", lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG),
         ["all_reduce", "AVG", "bool"], "myccl"),
        ("MAX on complex (reduce_scatter_tensor)", lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.complex64), torch.ones(2 * n, dtype=torch.complex64), op=dist.ReduceOp.MAX),
         ["reduce_scatter_tensor", "MAX"], "myccl"),
        # dtypes without reduction kernels
        ("uint16 all_reduce", lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint16)), ["all_reduce", "uint16"], "myccl"),
        ("uint32 reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.uint32), torch.ones(2 * n, dtype=torch.uint32)), ["reduce_scatter_tensor", "uint32", "CUDA tensors only"], "myccl"),
        ("float8 all_reduce", lambda: dist.all_reduce(torch.zeros(3).to(torch.float8_e4m3fn)),
         ["all_reduce", "float8_e4m3fn", "CUDA tensors only"], "myccl"),
        # peers
        ("send to self", lambda: dist.send(t, dst=r), ["destination rank"], "torch"),
        ("send to self (pg)", lambda: pg.send([t], r, 0).wait(), ["send", f"peer rank {r}", "itself"], "myccl"),
        ("recv from self (pg)", lambda: pg.recv([t], r, 0).wait(), ["recv", f"peer rank {r}"], "myccl"),
        ("send to n", lambda: dist.send(t, dst=n), ["send", f"peer rank {n}"], "myccl"),
        ("recv from n+3", lambda: dist.recv(t, src=n + 3), ["recv", f"peer rank {n + 3}"], "myccl"),
        ("isend to -2", lambda: dist.isend(t, dst=-2).wait(), ["-2"], "either"),
        # overlapping outputs
        ("all_reduce expanded", lambda: dist.all_reduce(torch.ones(1).expand(4)), ["all_reduce", "share memory"], "myccl"),
        ("broadcast expanded", lambda: dist.broadcast(torch.ones(2, 1).expand(2, 3), src=0), ["broadcast", "share memory"], "myccl"),
        ("all_gather expanded output", lambda: dist.all_gather([torch.zeros(1).expand(4) for _ in range(n)], t),
         ["all_gather", "share memory"], "myccl"),
        ("recv expanded", lambda: dist.recv(torch.zeros(1).expand(4), src=(r + 1) % n), ["recv", "share memory"], "myccl"),
        ("all_to_all_single expanded", lambda: dist.all_to_all_single(torch.zeros(1).expand(rows), x6),
         ["all_to_all_single", "share memory"], "myccl"),
        ("all_gather_into_tensor expanded output", lambda: dist.all_gather_into_tensor(torch.zeros(1).expand(4 * n), t),
         ["all_gather_into_tensor", "share memory"], "myccl"),
        ("reduce_scatter_tensor expanded output", lambda: dist.reduce_scatter_tensor(torch.zeros(1).expand(4), torch.ones(4 * n)),
         ["reduce_scatter_tensor", "share memory"], "myccl"),
        ("scatter expanded output", lambda: dist.scatter(torch.zeros(1).expand(4), None, src=(r + 1) % n),
         ["scatter", "share memory"], "myccl"),
        # devices myccl cannot serve. dist.all_reduce on a meta tensor never reaches a backend
        # (torch's Meta kernel for c10d ops is a no-op), so ask the backend directly.
        ("meta tensor (backend)", lambda: _be().allreduce([torch.empty(4, device="meta")], ar()).wait(),
         ["all_reduce", "meta"], "myccl"),
        ("cpu+meta mix (backend)", lambda: _be().allgather([[torch.empty(4, device="meta") for _ in range(n)]], [t]).wait(),
         ["all_gather", "meta"], "myccl"),
        ("sparse all_reduce MAX", lambda: dist.all_reduce(torch.eye(3).to_sparse(), op=dist.ReduceOp.MAX),
         ["all_reduce", "MAX"], "myccl"),
        # Last: a per-op timeout is checked after the sequence number is taken (see report).
        ("negative op timeout", lambda: _be().allreduce([t], _ar_opts(timeout_ms=-5)).wait(),
         ["all_reduce", "timeout", "-5"], "myccl"),
    ]
    return [c for c in cases if c is not None]


def _ar_opts(timeout_ms):
    o = dist.AllreduceOptions()
    o.timeout = timedelta(milliseconds=timeout_ms)
    return o


def _expect_error(rep: Report, ctx, name, fn, must, layer):
    """A local check raises before any peer is involved. In body_bad_arguments the other ranks
    wait on the store until the culprit has raised: a check that waited for a peer would end in
    the group's timeout, whose error ("Timed out", a DistBackendError) fails the checks below."""
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        msg = str(e).split("\nException raised from")[0]
        rep.check("Timed out" not in msg, f"{name}: waited for a peer instead of checking locally: {msg!r}")
        is_myccl = msg.startswith("myccl:")
        if layer == "myccl":
            rep.check(is_myccl, f"{name}: message does not start with 'myccl:': {msg!r}")
            rep.check(f"(rank {ctx.rank})" in msg, f"{name}: message does not name the rank: {msg!r}")
        if layer == "myccl" or (layer == "either" and is_myccl):
            rep.check(type(e) is ValueError, f"{name}: argument error should be a ValueError, got "
                      f"{type(e).__name__}: {msg!r}")
        for s in must:
            rep.check(s in msg, f"{name}: message lacks {s!r}: {msg!r}")
        return layer, msg
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{name}: expected ValueError/RuntimeError, got {type(e).__name__}: {e}")
        return layer, None
    rep.fail(f"{name}: nothing raised")
    return layer, None


def body_bad_arguments(ctx):
    ctx.init(timeout=20)
    rep = Report(ctx)
    n = ctx.size
    seen = {}
    cases = _cases(ctx)
    store = ctx.store("errors")
    # Every rank builds the same list, except root-only cases: agree on the count.
    for k, case in enumerate(_cases_for_all(ctx)):
        name, fn, must, layer = case
        culprit = k % n
        if ctx.rank == culprit:
            seq0 = seq_number()
            _, msg = _expect_error(rep, ctx, name, fn, must, layer)
            seen[name] = msg
            seq1 = seq_number()
            in_step = rep.check(seq1 == seq0, f"{name}: the rejected call advanced the sequence number {seq0} -> {seq1}")
            store.set(f"case{k}", "ok" if in_step else "desync")
        # The culprit tells everybody (over the store, not the group) whether to go on.
        if store.get(f"case{k}") != b"ok":
            rep.fail(f"stopped after {name!r}: rank {culprit}'s group is out of step with the others")
            return rep.result(), None, seen
        # The group must still work and agree on sequence numbers, on every rank.
        y = torch.full((3,), float(ctx.rank + k))
        dist.all_reduce(y)
        rep.check(torch.equal(y, torch.full((3,), float(sum(range(n)) + n * k))), f"all_reduce after {name!r}: {y.tolist()}")
    # Everybody makes the same bad calls at once: nobody waits for anybody.
    for name, fn, must, layer in cases:
        _expect_error(rep, ctx, name + " (all ranks)", fn, must, layer)
    z = torch.arange(5.0) * (ctx.rank + 1)
    dist.broadcast(z, src=n - 1)
    rep.check(torch.equal(z, torch.arange(5.0) * n), "broadcast after all bad calls")
    seq = seq_number()
    return rep.result(), seq, seen


def _cases_for_all(ctx):
    # Cases every rank can make (drop the root-only one so k lines up on every rank).
    return [c for c in _cases(ctx) if not c[0].endswith("(root)")]


def test_bad_arguments_raise_locally_and_leave_group_usable(run):
    results = run(3, body_bad_arguments, timeout=120)
    assert_reports([r[0] for r in results])
    seqs = [r[1] for r in results]
    assert len(set(seqs)) == 1, f"sequence numbers diverged after rejected calls: {seqs}"


def body_uint16_moves_without_reduction(ctx):
    """Dtypes without reduction kernels still travel in data-movement ops."""
    ctx.init(timeout=20)
    rep = Report(ctx)
    n = ctx.size
    for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e5m2):
        base = (torch.arange(6) + 10 * ctx.rank).to(dtype)
        t = base.clone()
        dist.broadcast(t, src=1)
        rep.check(torch.equal(t.view(torch.uint8), (torch.arange(6) + 10).to(dtype).view(torch.uint8)), f"broadcast {dtype}")
        out = torch.empty(6 * n, dtype=dtype)
        dist.all_gather_into_tensor(out, base)
        want = torch.cat([(torch.arange(6) + 10 * q).to(dtype) for q in range(n)])
        rep.check(torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"all_gather_into_tensor {dtype}")
    return rep.result()


def body_expanded_inputs_are_fine(ctx):
    """Overlapping memory is only a problem where data is written: expanded inputs work."""
    ctx.init(timeout=20)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank

    def e(q, k=4):
        return torch.tensor([float(q + 1)]).expand(k)

    outs = [torch.empty(4) for _ in range(n)]
    dist.all_gather(outs, e(r))
    rep.check(all(torch.equal(outs[q], e(q)) for q in range(n)), "all_gather of an expanded input")
    o = torch.empty(4 * n)
    dist.all_gather_into_tensor(o, e(r))
    rep.check(torch.equal(o, torch.cat([e(q) for q in range(n)])), "all_gather_into_tensor of an expanded input")
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, e(r, 2 * n))
    rep.check(torch.equal(o, torch.full((2,), float(sum(range(1, n + 1))))), "reduce_scatter_tensor of an expanded input")
    o = torch.empty(2 * n)
    dist.all_to_all_single(o, e(r, 2 * n))
    rep.check(torch.equal(o, torch.cat([e(q, 2) for q in range(n)])), "all_to_all_single of an expanded input")
    x = torch.zeros(4) if r == 0 else e(r)  # only the root's tensor is written
    dist.reduce(x, dst=0)
    rep.check(torch.equal(x, torch.full((4,), float(sum(range(2, n + 1))))) if r == 0 else torch.equal(x, e(r)),
              "reduce with expanded non-root inputs")
    o = torch.empty(4)
    dist.scatter(o, [e(q) for q in range(n)] if r == 0 else None, src=0)
    rep.check(torch.equal(o, e(r)), "scatter of expanded inputs")
    if r == 0:
        dist.send(e(7), dst=1)
    elif r == 1:
        got = torch.empty(4)
        dist.recv(got, src=0)
        rep.check(torch.equal(got, e(7)), "send of an expanded tensor")
    return rep.result()


def test_expanded_inputs_are_accepted(run):
    assert_reports(run(3, body_expanded_inputs_are_fine, timeout=60))


def test_reductionless_dtypes_still_move(run):
    assert_reports(run(2, body_uint16_moves_without_reduction, timeout=60))


def body_recv_size_mismatch(ctx, smaller: bool):
    """rank 1 sends 1000 floats; rank 0 receives into 500 (or 2000) inside a guarded buffer."""
    ctx.init(timeout=8)
    rep = Report(ctx)
    msg = None
    if ctx.rank == 1:
        try:
            w = dist.isend(torch.arange(1000.0), dst=0)
            w.wait()
        except Exception as e:  # noqa: BLE001 - the sender may or may not learn about it
            msg = f"{type(e).__name__}: {e}"
    else:
        m = 500 if smaller else 2000
        guard = torch.full((m + 20,), -7.0)
        buf = guard[10:10 + m]
        try:
            dist.recv(buf, src=1)
            rep.fail(f"recv of 1000 floats into {m} raised nothing; got {buf[:5].tolist()}...")
        except (RuntimeError, ValueError) as e:
            text = str(e).split("\nException raised from")[0]
            msg = text
            # the mismatch is seen on the message that arrived, not by running into the 8 s timeout
            rep.check("Timed out" not in text, f"size mismatch ended in a timeout: {text!r}")
            rep.check("myccl" in text and "recv" in text, f"error does not name myccl/recv: {text!r}")
            rep.check("4000" in text or "1000" in text, f"error does not give the sent size: {text!r}")
            rep.check(str(m * 4) in text or str(m) in text, f"error does not give the receive size: {text!r}")
        rep.check(torch.equal(guard[:10], torch.full((10,), -7.0)) and torch.equal(guard[10 + m:], torch.full((10,), -7.0)),
                  "memory around the receive buffer was overwritten")
    # The link is still framed correctly: the next message arrives whole, and collectives work.
    try:
        if ctx.rank == 1:
            dist.send(torch.arange(300.0) + 1, dst=0)
        else:
            got = torch.zeros(300)
            dist.recv(got, src=1)
            rep.check(torch.equal(got, torch.arange(300.0) + 1), f"send/recv after the mismatch: {got[:4].tolist()}")
        y = torch.ones(3)
        dist.all_reduce(y)
        rep.check(torch.equal(y, torch.full((3,), 2.0)), "all_reduce after the mismatch")
    except Exception as e:  # noqa: BLE001
        rep.fail(f"group unusable after a receive-size mismatch: {type(e).__name__}: {str(e)[:300]}")
    return rep.result(), msg


@pytest.mark.parametrize("smaller", [True, False], ids=["recv-smaller", "recv-larger"])
def test_send_recv_size_mismatch(run, smaller):
    results = run(2, body_recv_size_mismatch, smaller, timeout=60)
    assert_reports([r[0] for r in results])


def body_cuda_without_nccl(ctx):
    import c10d_ext

    ctx.init(timeout=20)
    rep = Report(ctx)
    t = torch.ones(4, device="cuda")
    try:
        dist.all_reduce(t)
        ok = c10d_ext.build_info()["with_nccl"]
        rep.check(ok, "a CUDA all_reduce succeeded in a build without NCCL")
        rep.check(torch.equal(t.cpu(), torch.full((4,), float(ctx.size))), "CUDA all_reduce value")
    except (ValueError, RuntimeError) as e:
        rep.check(not c10d_ext.build_info()["with_nccl"], f"CUDA all_reduce failed with NCCL built: {e}")
        rep.check("myccl" in str(e) and "NCCL" in str(e), f"error does not say NCCL is missing: {e}")
    y = torch.ones(2)
    dist.all_reduce(y)
    rep.check(torch.equal(y, torch.full((2,), float(ctx.size))), "CPU all_reduce after the CUDA attempt")
    return rep.result()


@pytest.mark.cuda
def test_cuda_tensor_with_or_without_nccl(run):
    # two ranks may share one GPU: NCCL needs them on distinct "hosts"
    assert_reports(run(2, body_cuda_without_nccl, timeout=120, world_env=SHARED_GPU))


def body_missing_rank_at_init(ctx):
    """init_process_group(store=S, timeout=T) with a rank that never comes gives up after T (the
    group's timeout), not after the store's own (60 s in this harness), naming that rank."""
    store = ctx.store("missing_at_init")
    if ctx.rank == 2:
        store.wait(["gave_up"], timedelta(seconds=60))  # comes only after the others gave up
        return "absent"
    try:
        ctx.init(timeout=2.0)
        return "no error"
    except Exception as e:  # noqa: BLE001
        return str(e)
    finally:
        store.add("gave_up_count", 1)
        if store.add("gave_up_count", 0) == 2:
            store.set("gave_up", "1")


def test_a_rank_missing_at_init_is_named_within_the_group_timeout(run):
    # The store's own timeout is 60 s here: an error that says 2000 ms is the group's.
    out = run(3, body_missing_rank_at_init, timeout=60)
    for msg in out[:2]:
        assert "Timed out after 2000 ms waiting for rank(s) 2 to publish their host identity" in msg, msg
