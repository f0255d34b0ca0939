"""The agreed all_reduce (c10d_ext.horovod's one-step path on one host): it reduces only when every
rank offered the same key, size and op, and ranks that disagree all learn it in the same step with
nothing written and the group usable. Then c10d_ext.horovod on it: a synchronous hvd.allreduce is
one collective, not a negotiation and a collective, and every case the negotiation handles still
comes out as it did."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def _backend():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def _agreed(t, key, op=dist.ReduceOp.SUM):
    flag = torch.zeros(1, dtype=torch.uint8)
    _backend()._agreed_all_reduce(t, flag, key, op).wait()
    return int(flag[0])


def body_agreed_op(ctx):
    import c10d_ext

    ctx.init(timeout=30, pg_options=c10d_ext.Options(shm_buffer_bytes=4096))
    r, n = ctx.rank, ctx.size
    out = {"available": bool(_backend()._agreed_available)}

    def mine(k=4, dtype=torch.float32):
        return torch.full((k,), float(r + 1), dtype=dtype)

    t = mine()
    out["same"] = (_agreed(t, 7), t.tolist())
    t = mine()
    out["other key"] = (_agreed(t, 7 if r else 8), t.tolist())
    t = mine(4 if r else 5)
    out["other size"] = (_agreed(t, 7), t.tolist())
    t = mine(dtype=torch.float64 if r else torch.float32)
    out["other dtype"] = (_agreed(t, 7), t.tolist())
    t = mine()
    out["no offer"] = (_agreed(t, 0 if r == n - 1 else 7), t.tolist())
    t = mine()
    out["other op"] = (_agreed(t, 7, dist.ReduceOp.MAX if r else dist.ReduceOp.MIN), t.tolist())
    t = mine()
    out["min"] = (_agreed(t, 9, dist.ReduceOp.MIN), t.tolist())
    t = mine(2048)  # 8 KiB: more than a staging buffer holds, on every rank
    out["too large"] = (_agreed(t, 7), t[:2].tolist())
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3) * (r + 1)
    out["2d int64"] = (_agreed(t, -5), t.tolist())
    x = torch.ones(3)
    dist.all_reduce(x)  # the group is still usable after every disagreement
    out["after"] = x.tolist()
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_agreed_all_reduce(run, size):
    res = run(size, body_agreed_op, timeout=90)
    total = float(sum(range(1, size + 1)))
    for r, out in enumerate(res):
        own = float(r + 1)
        assert out["available"], out
        assert out["same"] == (1, [total] * 4), (r, out)
        for case in ("other key", "other size", "other dtype", "no offer", "other op"):
            flag, values = out[case]
            assert flag == 0 and all(v == own for v in values), (r, case, out[case])
        assert out["min"] == (1, [1.0] * 4), (r, out)
        assert out["too large"] == (0, [own, own]), (r, out)
        s = size * (size + 1) // 2
        assert out["2d int64"] == (1, [[0, s, 2 * s], [3 * s, 4 * s, 5 * s]]), (r, out)
        assert out["after"] == [float(size)] * 3, (r, out)


def body_agreed_detail_and_tcp(ctx, transport):
    """Under MYCCL_DEBUG=DETAIL ranks that disagree still just disagree (the op skips the
    fingerprint check, whose point it is to fail); on a group without shared memory the op is
    not available and moves nothing, alike on every rank."""
    import c10d_ext

    ctx.init(timeout=30, pg_options=c10d_ext.Options(debug=True, transport=transport))
    r = ctx.rank
    t = torch.full((4 if r else 5,), float(r + 1))
    flag = _agreed(t, 7)
    same = torch.full((4,), float(r + 1))
    flag_same = _agreed(same, 7)
    x = torch.ones(2)
    dist.all_reduce(x)
    return {"available": bool(_backend()._agreed_available), "flag": flag, "t": t.tolist(),
            "same": (flag_same, same.tolist()), "after": x.tolist()}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_agreed_under_detail_and_without_shared_memory(run, transport):
    res = run(2, body_agreed_detail_and_tcp, transport, timeout=90)
    for r, out in enumerate(res):
        own = float(r + 1)
        assert out["available"] == (transport == "auto"), out
        assert out["flag"] == 0 and all(v == own for v in out["t"]), (r, out)
        want = (1, [3.0] * 4) if transport == "auto" else (0, [own] * 4)
        assert out["same"] == want, (r, out)
        assert out["after"] == [2.0, 2.0], (r, out)


# ---- c10d_ext.horovod on it ---------------------------------------------------------------------
def _set_stats(hvd):
    from c10d_ext.horovod.basics import STATE

    stats = STATE.group._get_backend(torch.device("cpu")).stats()
    return {(op, algo): count for op, algo, count, _, _ in stats}


def _warm_start(ctx):
    """Horovod started, its set's first cycle done (it negotiates: it makes the group's engine and
    turns the agreed path on), and the set's op counts then."""
    from hvd_helpers import quiet_heartbeat, start

    quiet_heartbeat()  # these tests count the set's cycles and ops
    hvd = start(ctx)
    hvd.allreduce(torch.ones(1), name="warm", op=hvd.Sum)
    return hvd, _set_stats(hvd)


def body_hvd_agreed(ctx):
    import time

    from hvd_helpers import stop, value

    hvd, before = _warm_start(ctx)
    r = hvd.rank()
    out = {}
    steps = 20
    got = []
    for k in range(steps):
        got.append(hvd.allreduce(value(r, torch.float32, salt=k), name=f"g{k % 3}", op=hvd.Average).tolist())
    inplace = value(r, torch.int64)
    hvd.allreduce_(inplace, name="inplace", op=hvd.Sum)
    scaled = hvd.allreduce(value(r, torch.float64), name="scaled", op=hvd.Sum, postscale_factor=0.5)
    maxed = hvd.allreduce(value(r, torch.bfloat16), name="max", op=hvd.Max)
    after = _set_stats(hvd)
    out["ops"] = {f"{k[0]}/{k[1]}": after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    out["got"] = got
    out["inplace"] = inplace.tolist()
    out["scaled"] = scaled.tolist()
    out["max"] = maxed.float().tolist()
    # submitted in different orders: the agreed op disagrees and the negotiation sorts it out
    names = ["a", "b"] if r == 0 else ["b", "a"]
    hs = {nm: hvd.allreduce_async(value(r, torch.float32, salt=ord(nm)), name=nm, op=hvd.Sum) for nm in names}
    out["crossed"] = {nm: hvd.synchronize(h).tolist() for nm, h in hs.items()}
    # a shape mismatch is still Horovod's error on every rank, and the next op works
    try:
        hvd.allreduce(torch.ones(3 if r else 4), name="bad")
        out["bad"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["bad"] = f"{type(e).__name__}: {e}"
    out["next"] = hvd.allreduce(torch.ones(2), name="next", op=hvd.Sum).tolist()
    time.sleep(0.05)
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_hvd_allreduce_is_one_collective(run, size):
    from hvd_helpers import value

    res = run(size, body_hvd_agreed, timeout=120)
    for r, out in enumerate(res):
        ops = out["ops"]
        # 20 + 3 synchronous allreduces: 23 agreed ops that reduced, no negotiation
        assert ops.get("agreed_all_reduce/shm-agreed") == 23, (r, ops)
        assert not any(k.startswith(("all_gather", "all_reduce/")) or k.endswith("declined") for k in ops), (r, ops)
        for k, g in enumerate(out["got"]):
            want = sum(value(q, torch.float32, salt=k) for q in range(size)) * (1.0 / size)  # as Horovod scales
            assert g == want.tolist(), (r, k, g)
        assert out["inplace"] == sum(value(q, torch.int64) for q in range(size)).tolist(), (r, out)
        assert out["scaled"] == (sum(value(q, torch.float64) for q in range(size)) * 0.5).tolist(), (r, out)
        assert out["max"] == value(size - 1, torch.bfloat16).float().tolist(), (r, out)
        for nm in ("a", "b"):
            want = sum(value(q, torch.float32, salt=ord(nm)) for q in range(size)).tolist()
            assert out["crossed"][nm] == want, (r, nm, out["crossed"])
        assert "Mismatched ALLREDUCE tensor shapes" in out["bad"] and "bad" in out["bad"], (r, out["bad"])
        assert out["next"] == [float(size)] * 2, (r, out)


# ---- the synchronous path on the caller's thread (agreed.allreduce_now) -------------------------
def body_hvd_now(ctx):
    import time

    from hvd_helpers import stop, value

    hvd, before = _warm_start(ctx)
    r = hvd.rank()
    out = {}
    # One rank's synchronous op meets the other ranks' queued one: the same key on both paths.
    t = value(r, torch.float32, salt=3)
    if r == 0:
        out["mixed"] = hvd.allreduce(t, name="mixed", op=hvd.Sum).tolist()
    else:
        out["mixed"] = hvd.synchronize(hvd.allreduce_async(t, name="mixed", op=hvd.Sum)).tolist()
    # Grouped: one fused buffer of several shapes; int64 Average truncates as Horovod does.
    shapes = [(2, 3), (4,), (1,), (0,)]
    ints = [value(r, torch.int64, shape=s, salt=i) for i, s in enumerate(shapes)]
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce(ints, name="gi", op=hvd.Average)]
    floats = [value(r, torch.float64, shape=s, salt=i) for i, s in enumerate(shapes)]
    got = hvd.grouped_allreduce_(floats, name="gf", op=hvd.Sum, postscale_factor=0.5)
    out["grouped_"] = [x.tolist() for x in floats]
    out["grouped_ returns its tensors"] = all(a is b for a, b in zip(got, floats))
    after = _set_stats(hvd)
    out["ops"] = {f"{k[0]}/{k[1]}": after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # The same grouped op with each rank's shapes in another order (same names, same element
    # count): the shapes are in the key, so the negotiation reports them, nothing is summed.
    mine = [(2, 3), (3, 2)] if r == 0 else [(3, 2), (2, 3)]
    try:
        hvd.grouped_allreduce([torch.ones(s) for s in mine], name="shapes", op=hvd.Sum)
        out["shapes"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["shapes"] = f"{type(e).__name__}: {e}"
    # One rank's grouped op meets the others' queued grouped op: they disagree in one step and
    # the negotiation does it.
    xs = [value(r, torch.float32, shape=(3,), salt=k) for k in range(3)]
    if r == 0:
        res = hvd.grouped_allreduce(xs, name="gq", op=hvd.Sum)
    else:
        res = hvd.synchronize(hvd.grouped_allreduce_async(xs, name="gq", op=hvd.Sum))
    out["grouped queued"] = [x.tolist() for x in res]
    # What the path cannot take still meets Horovod's errors, and the next op works.
    try:
        hvd.grouped_allreduce([torch.ones(4), torch.ones(4, 2).t()], name="nc", op=hvd.Sum)
        out["non-contiguous"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["non-contiguous"] = f"{type(e).__name__}: {e}"
    out["next"] = [x.tolist() for x in hvd.grouped_allreduce([torch.ones(2), torch.ones(1)], name="nx", op=hvd.Sum)]
    # autograd through the fused path: the gradient of a Sum is the Sum of the gradients (given
    # contiguous, as Horovod needs every tensor it reduces to be)
    w = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    ys = hvd.grouped_allreduce(w, name="ag", op=hvd.Sum)
    torch.autograd.backward(ys, [torch.full((2,), float(r + 1)), torch.ones(3)])
    out["grads"] = [x.grad.tolist() for x in w]
    time.sleep(0.05)
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_hvd_synchronous_ops_on_the_callers_thread(run, size):
    from hvd_helpers import value

    res = run(size, body_hvd_now, timeout=120)
    shapes = [(2, 3), (4,), (1,), (0,)]
    for r, out in enumerate(res):
        assert out["mixed"] == sum(value(q, torch.float32, salt=3) for q in range(size)).tolist(), (r, out)
        for i, s in enumerate(shapes):
            total = sum(value(q, torch.int64, shape=s, salt=i) for q in range(size))
            want = (total.to(torch.float64) * (1.0 / size)).trunc().to(torch.int64)
            assert out["grouped"][i] == want.tolist(), (r, i, out["grouped"])
            want = sum(value(q, torch.float64, shape=s, salt=i) for q in range(size)) * 0.5
            assert out["grouped_"][i] == want.tolist(), (r, i, out["grouped_"])
        assert out["grouped_ returns its tensors"], (r, out)
        if size > 1:
            # the mixed op and the two grouped ops: three agreed ops that reduced, no negotiation
            assert out["ops"].get("agreed_all_reduce/shm-agreed") == 3, (r, out["ops"])
            assert not any(k.startswith(("all_gather", "all_reduce/")) for k in out["ops"]), (r, out["ops"])
            assert "Mismatched ALLREDUCE tensor shapes" in out["shapes"] and "shapes" in out["shapes"], (r, out)
        else:
            assert out["shapes"] == "no error", (r, out)
        for k in range(3):
            want = sum(value(q, torch.float32, shape=(3,), salt=k) for q in range(size)).tolist()
            assert out["grouped queued"][k] == want, (r, k, out["grouped queued"])
        assert out["non-contiguous"] == "ValueError: Tensor is required to be contiguous.", (r, out)
        assert out["next"] == [[float(size)] * 2, [float(size)]], (r, out)
        g0 = float(sum(q + 1 for q in range(size)))
        assert out["grads"] == [[g0] * 2, [float(size)] * 3], (r, out)


# ---- asynchronous allreduces: one pending list, one agreed step (agreed.defer / flush) ---------
def body_hvd_deferred(ctx):
    import time

    from hvd_helpers import stop, value

    from c10d_ext.horovod import controller as C

    hvd, _ = _warm_start(ctx)
    ctrl = C._CONTROLLERS[0]
    r = hvd.rank()
    out = {}
    before, c0 = _set_stats(hvd), ctrl.cycles
    # Small tensors fused (three to a buffer under this test's fusion threshold), two of more
    # than a megabyte reduced alone (one in place), in-place ones, a grouped op; waited for in
    # another order than they were submitted.
    small = [value(r, torch.float32, shape=(7,), salt=i) for i in range(40)]
    big = value(r, torch.float32, shape=(300_000,), salt=1)
    big_copy = value(r, torch.float32, shape=(300_000,), salt=2)
    inplace = [value(r, torch.float32, shape=(3,), salt=50 + i) for i in range(5)]
    grouped = [value(r, torch.float32, shape=s, salt=60 + i) for i, s in enumerate([(2, 2), (5,), (0,)])]
    hs = [hvd.allreduce_async(t, name=f"s{i}", op=hvd.Sum) for i, t in enumerate(small)]
    hb = hvd.allreduce_async_(big, name="big", op=hvd.Sum)
    hc = hvd.allreduce_async(big_copy, name="bigc", op=hvd.Sum)
    hi = [hvd.allreduce_async_(t, name=f"i{i}", op=hvd.Sum) for i, t in enumerate(inplace)]
    hg = hvd.grouped_allreduce_async(grouped, name="grp", op=hvd.Sum)
    out["grouped"] = [x.tolist() for x in hvd.synchronize(hg)]
    out["big is itself"] = hvd.synchronize(hb) is big
    out["big"] = big[:4].tolist() + big[-2:].tolist()
    copy = hvd.synchronize(hc)
    out["big copy"] = [copy[:4].tolist(), big_copy[:2].tolist()]
    out["inplace"] = [hvd.synchronize(h) is t for h, t in zip(hi, inplace)]
    out["inplace values"] = [t.tolist() for t in inplace]
    out["small"] = [hvd.synchronize(h).tolist() for h in hs]
    out["cycles"] = ctrl.cycles - c0
    after = _set_stats(hvd)
    out["ops"] = {f"{k[0]}/{k[1]}": after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # Another op than the list's goes to the queue, after the list; int64 Average truncates.
    a = hvd.allreduce_async(value(r, torch.float32, salt=7), name="a", op=hvd.Sum)
    b = hvd.allreduce_async(value(r, torch.int64, salt=8), name="b", op=hvd.Average)
    out["queued after"] = [hvd.synchronize(b).tolist(), hvd.synchronize(a).tolist()]
    # The lists differ: rank 0 waits after two ops, the others after three. The negotiation
    # sorts it out, and the third op (queued on rank 0 behind what others announced) too.
    hs = [hvd.allreduce_async(value(r, torch.float64, salt=20 + k), name=f"u{k}", op=hvd.Sum)
          for k in range(2 if r == 0 else 3)]
    got = [hvd.synchronize(hs[0]).tolist()]
    if r == 0:
        hs.append(hvd.allreduce_async(value(r, torch.float64, salt=22), name="u2", op=hvd.Sum))
    got += [hvd.synchronize(h).tolist() for h in hs[1:]]
    out["uneven"] = got
    out["next"] = hvd.allreduce(torch.ones(2), name="next", op=hvd.Sum).tolist()
    time.sleep(0.05)
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_hvd_async_allreduces_run_as_one_agreed_step(run, size):
    from hvd_helpers import value

    # No list runs on the thread's timer here (a cycle time of 10 s): callers run them, and the
    # thread runs each list that fills a fusion buffer (100 B here), cut at the same op everywhere.
    env = {"HOROVOD_CYCLE_TIME": "10000", "HOROVOD_FUSION_THRESHOLD": "100"}
    res = run(size, body_hvd_deferred, env=env, timeout=120)

    def total(dtype, shape=(5,), salt=0):
        return sum(value(q, dtype, shape=shape, salt=salt) for q in range(size))

    for r, out in enumerate(res):
        want = [total(torch.float32, s, 60 + i).tolist() for i, s in enumerate([(2, 2), (5,), (0,)])]
        assert out["grouped"] == want, (r, out["grouped"])
        assert out["big is itself"], (r, out)
        b = total(torch.float32, (300_000,), 1)
        assert out["big"] == b[:4].tolist() + b[-2:].tolist(), (r, out["big"])
        c = total(torch.float32, (300_000,), 2)
        assert out["big copy"] == [c[:4].tolist(), value(r, torch.float32, (300_000,), 2)[:2].tolist()], (r, out)
        assert out["inplace"] == [True] * 5, (r, out)
        assert out["inplace values"] == [total(torch.float32, (3,), 50 + i).tolist() for i in range(5)], (r, out)
        assert out["small"] == [total(torch.float32, (7,), i).tolist() for i in range(40)], (r, out["small"])
        assert out["cycles"] > 10, (r, out["cycles"])  # 1.4 kB of small tensors: sealed lists
        if size > 1:
            # each list's first fusion buffer carried the agreement, its other buffers and the big
            # tensors followed as plain all_reduces: nothing was negotiated
            assert out["ops"].get("agreed_all_reduce/shm-agreed") == out["cycles"], (r, out["ops"])
            assert not any(k.startswith("all_gather") or k.endswith("declined") for k in out["ops"]), (r, out["ops"])
            assert any(k.startswith("all_reduce/") for k in out["ops"]), (r, out["ops"])
        else:
            assert out["ops"] == {}, (r, out["ops"])
        avg = (total(torch.int64, salt=8).to(torch.float64) * (1.0 / size)).trunc().to(torch.int64)
        assert out["queued after"] == [avg.tolist(), total(torch.float32, salt=7).tolist()], (r, out)
        assert out["uneven"] == [total(torch.float64, salt=20 + k).tolist() for k in range(3)], (r, out["uneven"])
        assert out["next"] == [float(size)] * 2, (r, out)


def body_hvd_held(ctx):
    from hvd_helpers import stop, value

    from c10d_ext import _C
    from c10d_ext.horovod import controller as C

    hvd, before = _warm_start(ctx)
    ctrl = C._CONTROLLERS[0]
    r = hvd.rank()
    out = {}
    c0 = ctrl.cycles
    ts = [value(r, torch.float32, shape=(3,), salt=k) for k in range(10)]
    hs = [hvd.allreduce_async(t, name=f"h{k}", op=hvd.Average) for k, t in enumerate(ts)]
    out["held"] = ctrl.held.held_ops
    try:
        hvd.allreduce_async(torch.ones(1), name="h3", op=hvd.Average)
        out["dup"] = "no error"
    except ValueError as e:
        out["dup"] = str(e)
    out["values"] = [hvd.synchronize(h).tolist() for h in reversed(hs)][::-1]
    out["cycles"] = ctrl.cycles - c0
    after = _set_stats(hvd)
    out["ops"] = {f"{k[0]}/{k[1]}": after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # Held when Horovod shuts down: the op fails with Horovod's shut-down error.
    held = _C._hvd_result(hvd.allreduce_async(torch.ones(2), name="held", op=hvd.Sum))  # its list
    stop(hvd)
    out["held at shutdown"] = [held.state, held.error]
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_hvd_async_allreduces_held_until_waited_for(run, size):
    """Under the default fusion threshold and a cycle time of 10 s, ten async ops stay in the
    pending list until one is waited for, then go as one agreed step."""
    from hvd_helpers import value

    from c10d_ext.horovod.exceptions import DUPLICATE_NAME, SHUT_DOWN

    res = run(size, body_hvd_held, env={"HOROVOD_CYCLE_TIME": "10000"}, timeout=120)
    for r, out in enumerate(res):
        assert out["held"] == 10, (r, out["held"])
        assert out["dup"] == DUPLICATE_NAME, (r, out["dup"])
        for k, got in enumerate(out["values"]):
            want = sum(value(q, torch.float32, shape=(3,), salt=k) for q in range(size)) * (1.0 / size)
            assert got == want.tolist(), (r, k, got)
        assert out["cycles"] == 1, (r, out["cycles"])
        if size > 1:
            assert out["ops"] == {"agreed_all_reduce/shm-agreed": 1}, (r, out["ops"])
        assert out["held at shutdown"] == [3, SHUT_DOWN], (r, out["held at shutdown"])  # failed


def body_hvd_deferred_timer(ctx):
    import time

    from hvd_helpers import stop, value

    hvd, _ = _warm_start(ctx)
    r = hvd.rank()
    # Nobody waits: the set's thread runs the list once no op joined it for a while.
    h = hvd.allreduce_async(value(r, torch.float32, salt=4), name="t", op=hvd.Sum)
    deadline = time.monotonic() + 30
    while not hvd.poll(h) and time.monotonic() < deadline:
        time.sleep(0.001)
    out = {"polled": hvd.poll(h), "value": hvd.synchronize(h).tolist()}
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_hvd_async_allreduce_completes_without_synchronize(run, size):
    from hvd_helpers import value

    res = run(size, body_hvd_deferred_timer, timeout=90)
    for r, out in enumerate(res):
        assert out["polled"], (r, out)
        assert out["value"] == sum(value(q, torch.float32, salt=4) for q in range(size)).tolist(), (r, out)


def body_hvd_untimed_list_while_idle(ctx):
    import time

    from hvd_helpers import stop, value

    from c10d_ext.horovod import agreed, mpi_ops

    hvd, _ = _warm_start(ctx)
    r = hvd.rank()
    # The set's thread runs one list itself (it is awake, its last cycle just now) ...
    h = hvd.allreduce_async(value(r, torch.float32, salt=1), name="timed", op=hvd.Sum)
    while not hvd.poll(h):
        time.sleep(0.001)
    out = {"timed": hvd.synchronize(h).tolist()}
    # ... then a list of untimed ops (DistributedOptimizer's) stays open past the thread's awake
    # time: the thread must go to sleep, not loop holding the set's lock, or this synchronize hangs.
    h = mpi_ops._allreduce_async(value(r, torch.float32, salt=2), None, "untimed", hvd.Sum, 1.0, 1.0,
                                 hvd.global_process_set, timed=False)
    time.sleep(agreed.AWAKE_SECONDS + 0.5)
    out["untimed"] = hvd.synchronize(h).tolist()
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_hvd_untimed_list_open_while_the_sets_thread_idles(run, size):
    from hvd_helpers import value

    res = run(size, body_hvd_untimed_list_while_idle, timeout=60)
    for r, out in enumerate(res):
        for key, salt in (("timed", 1), ("untimed", 2)):
            assert out[key] == sum(value(q, torch.float32, salt=salt) for q in range(size)).tolist(), (r, key, out)


def _opt_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def _opt_data(q: int, step: int):
    g = torch.Generator().manual_seed(100 * q + step)
    return torch.randn(5, 4, generator=g).double(), torch.randn(5, 2, generator=g).double()


def body_hvd_optimizer_untimed(ctx):
    from hvd_helpers import stop

    from c10d_ext.horovod import controller as C

    hvd, before = _warm_start(ctx)
    ctrl = C._CONTROLLERS[0]
    model = _opt_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    c0 = ctrl.cycles
    for step in range(3):
        x, y = _opt_data(hvd.rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    after = _set_stats(hvd)
    out = {"cycles": ctrl.cycles - c0,
           "ops": {f"{k[0]}/{k[1]}": after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
           "params": [p.detach().flatten().tolist() for p in model.parameters()]}
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2, 3])
def test_distributed_optimizer_step_is_one_agreed_step_whatever_the_timer(run, size):
    """With a cycle time of 1 µs every timed list would run on the set's thread as soon as its
    first gradient came; the optimizer's are untimed, so each step's gradients go as one list,
    cut at step() on every rank alike: one agreed step per training step, no negotiation."""
    res = run(size, body_hvd_optimizer_untimed, env={"HOROVOD_CYCLE_TIME": "0.001"}, timeout=120)
    model = _opt_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):  # the average of the ranks' gradients, locally
        grads = []
        for q in range(size):
            model.zero_grad()
            x, y = _opt_data(q, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / size
        opt.step()
    want = [p.detach().flatten() for p in model.parameters()]
    for r, out in enumerate(res):
        if size > 1:
            assert out["cycles"] == 3, (r, out["cycles"])
            assert out["ops"] == {"agreed_all_reduce/shm-agreed": 3}, (r, out["ops"])
        else:  # as Horovod's: one process registers no hooks and reduces nothing
            assert (out["cycles"], out["ops"]) == (0, {}), (r, out)
        got = [torch.tensor(p, dtype=torch.float64) for p in out["params"]]
        assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want)), (r, got, want)


# ---- held ops in C++: names, the queued path's duplicate check, threads ------------------------
def body_hvd_held_names(ctx):
    from hvd_helpers import stop, value

    from c10d_ext.horovod import controller as C

    hvd, _ = _warm_start(ctx)
    ctrl = C._CONTROLLERS[0]
    r = hvd.rank()
    out = {}
    t = value(r, torch.float32, salt=1)
    h = hvd.allreduce_async(t, op=hvd.Sum)  # held, unnamed: "allreduce.noname.<its handle>"
    out["held"] = ctrl.held.held_ops
    errors = []
    # the same name through the held path, then through the queued path (prescale is never held)
    for kwargs in ({}, {"prescale_factor": 2.0}):
        try:
            hvd.allreduce_async(torch.ones(2), name=f"noname.{h}", op=hvd.Sum, **kwargs)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out["duplicates"] = errors
    out["value"] = hvd.synchronize(h).tolist()
    # once it is done, the name is free again, on both paths
    out["again"] = [hvd.synchronize(hvd.allreduce_async(torch.ones(2), name=f"noname.{h}", op=hvd.Sum,
                                                        prescale_factor=p)).tolist() for p in (1.0, 2.0)]
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [1, 2])
def test_hvd_held_op_names_are_horovods_and_refused_while_held(run, size):
    from hvd_helpers import value

    from c10d_ext.horovod.exceptions import DUPLICATE_NAME

    res = run(size, body_hvd_held_names, timeout=90)
    for r, out in enumerate(res):
        assert out["held"] == 1, (r, out)
        assert out["duplicates"] == [DUPLICATE_NAME, DUPLICATE_NAME], (r, out["duplicates"])
        assert out["value"] == sum(value(q, torch.float32, salt=1) for q in range(size)).tolist(), (r, out)
        assert out["again"] == [[float(size)] * 2, [2.0 * size] * 2], (r, out["again"])


def body_hvd_held_threads(ctx, threads, rounds):
    import gc
    import threading

    from hvd_helpers import stop, value

    hvd, _ = _warm_start(ctx)
    r = hvd.rank()
    got, errors = {}, []

    def work(k):
        try:
            for it in range(rounds):
                names = [f"th{k}.{it}.{j}" for j in range(5)]
                hs = [hvd.allreduce_async(value(r, torch.float32, salt=k + j), name=nm, op=hvd.Sum)
                      for j, nm in enumerate(names)]
                if it % 7 == 0:
                    gc.collect()  # finalizers switch threads at any allocation: none may deadlock
                for nm, h in reversed(list(zip(names, hs))):
                    got[nm] = hvd.synchronize(h).tolist()
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop(hvd)
    return {"got": got, "errors": errors}


@pytest.mark.parametrize("size", [1, 2, 3])
def test_hvd_held_ops_from_many_threads(run, size):
    """Threads interleave differently on every rank, so the ranks' pending lists differ and go on
    into the negotiation (each op handed from the list to a request) while other threads hold
    and wait: every value right, no hang."""
    from hvd_helpers import value

    threads, rounds = 3, 30
    res = run(size, body_hvd_held_threads, threads, rounds, timeout=180)
    for r, out in enumerate(res):
        assert out["errors"] == [], (r, out["errors"][:3])
        assert len(out["got"]) == threads * rounds * 5, (r, len(out["got"]))
        for k in range(threads):
            for j in range(5):
                want = sum(value(q, torch.float32, salt=k + j) for q in range(size)).tolist()
                for it in range(rounds):
                    assert out["got"][f"th{k}.{it}.{j}"] == want, (r, k, it, j)


# ---- held ops across hosts: the list's key rides on the negotiation's message -------------------
def body_hvd_held_tcp(ctx):
    import c10d_ext.horovod as hvd
    from hvd_helpers import quiet_heartbeat, stop, value

    from c10d_ext.horovod import controller as C

    quiet_heartbeat()  # the test counts the set's cycles
    ctx.init(timeout=60)
    hvd.init()
    ctrl = C._CONTROLLERS[0]
    r = hvd.rank()
    hvd.allreduce(torch.ones(1), name="warm", op=hvd.Sum)
    out = {"agreed_ok": ctrl.agreed_ok, "lists": []}
    for step in range(3):  # the same list on every rank: one cycle each, whatever its length
        c0 = ctrl.cycles
        ts = [value(r, torch.float32, shape=(k % 7 + 1,), salt=step + k) for k in range(100)]
        hs = [hvd.allreduce_async(t, name=f"s{step}.{k}", op=hvd.Sum) for k, t in enumerate(ts)]
        hs.append(hvd.grouped_allreduce_async_([value(r, torch.int64, salt=step), value(r, torch.float64, salt=step)],
                                               name=f"g{step}", op=hvd.Sum))
        got = [hvd.synchronize(h) for h in hs]
        out["lists"].append({"cycles": ctrl.cycles - c0, "values": [g.tolist() for g in got[:-1]],
                             "grouped": [g.tolist() for g in got[-1]]})
    # lists that differ between the ranks (rank 0 holds one op more): the negotiation sorts them out
    hs = [hvd.allreduce_async(torch.full((2,), float(r + 1)), name=f"d{k}", op=hvd.Sum) for k in range(3 + (r == 0))]
    if r != 0:
        hs.append(hvd.allreduce_async(torch.full((2,), float(r + 1)), name="d3", op=hvd.Sum))
    out["differ"] = [hvd.synchronize(h).tolist() for h in hs]
    stop(hvd)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_hvd_held_lists_across_hosts_agree_in_the_negotiation(run, size):
    from hvd_helpers import value

    # MYCCL_TRANSPORT=tcp: every group as if its ranks were on different hosts (no agreed op)
    res = run(size, body_hvd_held_tcp, env={"MYCCL_TRANSPORT": "tcp"}, timeout=120)
    for r, out in enumerate(res):
        assert out["agreed_ok"] is False, (r, out["agreed_ok"])
        for step, lst in enumerate(out["lists"]):
            assert lst["cycles"] == 1, (r, step, lst["cycles"])  # 101 ops (a cycle announces 64): one
            for k, got in enumerate(lst["values"]):
                want = sum(value(q, torch.float32, shape=(k % 7 + 1,), salt=step + k) for q in range(size))
                assert got == want.tolist(), (r, step, k, got)
            assert lst["grouped"] == [sum(value(q, d, salt=step) for q in range(size)).tolist()
                                      for d in (torch.int64, torch.float64)], (r, step, lst["grouped"])
        want = float(sum(q + 1 for q in range(size)))
        assert out["differ"] == [[want] * 2] * 4, (r, out["differ"])
