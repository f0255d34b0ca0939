"""Groups made from a group: split_group (CPU, and NCCL communicators split by NCCL on the CUDA
double), merge, shrink_group and survivors, with a local expectation for every result."""

from __future__ import annotations

import functools
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import DOUBLE
from expect import make
from harness import Report, assert_reports, open_sockets


def _check_group(rep, group, ranks, what, seed=1):
    """all_reduce, broadcast from the last member and all_gather on `group`, whose global ranks in
    group order are `ranks`, against sums of the members' inputs computed here."""
    me = dist.get_rank()
    x = make(me, (17,), torch.float64, seed)
    t = x.clone()
    dist.all_reduce(t, group=group)
    want = sum(make(q, (17,), torch.float64, seed) for q in ranks)
    rep.check(torch.equal(t, want), f"{what}: all_reduce")
    b = x.clone()
    dist.broadcast(b, group_src=len(ranks) - 1, group=group)
    rep.check(torch.equal(b, make(ranks[-1], (17,), torch.float64, seed)), f"{what}: broadcast")
    outs = [torch.empty(17, dtype=torch.float64) for _ in ranks]
    dist.all_gather(outs, x, group=group)
    rep.check(all(torch.equal(o, make(q, (17,), torch.float64, seed)) for o, q in zip(outs, ranks)),
              f"{what}: all_gather in group order")


# ---- split ------------------------------------------------------------------------------------

NO_CPU_SPLIT = "No device associated with the default pg"  # torch < 2.14 splits only device-bound groups


class _NoCpuSplit(Exception):
    pass


def _split(**kw):
    try:
        return dist.split_group(**kw)
    except RuntimeError as e:
        if NO_CPU_SPLIT in str(e):
            raise _NoCpuSplit(str(e)) from None
        raise


def _run_split(run, *args, **kw):
    """run() for a body that splits; skips where torch itself refuses to split a group that is not
    bound to a device (torch 2.11-2.13), before myccl is asked."""
    res = run(*args, **kw)
    if any(isinstance(r, str) and r.startswith("skip:") for r in res):
        pytest.skip(f"torch {torch.__version__}: {next(r for r in res if isinstance(r, str))[5:]}")
    return res


def _skippable(body):
    @functools.wraps(body)  # the same qualified name: the harness sends bodies by reference
    def wrapped(ctx, *args):
        try:
            return body(ctx, *args)
        except _NoCpuSplit as e:
            return "skip:" + str(e)
    return wrapped

@_skippable
def body_split(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    rep.check(be.supports_splitting, "myccl says it supports splitting")
    # pairs, the second in reversed order: group rank 0 of [3, 2] is global rank 3
    halves = [[0, 1], [3, 2]] if n == 4 else [[0, 2], [1]]
    sub = _split(split_ranks=halves)
    mine = next(h for h in halves if r in h)
    rep.check(dist.get_rank(sub) == mine.index(r) and dist.get_world_size(sub) == len(mine),
              f"rank {dist.get_rank(sub)} / size {dist.get_world_size(sub)} in {mine}")
    rep.check(dist.get_backend(sub) == "myccl", f"split backend {dist.get_backend(sub)}")
    rep.check(dist.get_process_group_ranks(sub) == mine, f"ranks {dist.get_process_group_ranks(sub)}")
    if len(mine) > 1:
        _check_group(rep, sub, mine, f"split {mine}")
    # ranks in no new group get none and take no part
    only = [[0, n - 1]]
    g = _split(split_ranks=only)
    if r in (0, n - 1):
        _check_group(rep, g, [0, n - 1], "split [0, last]", seed=2)
    else:
        rep.check(g == dist.GroupMember.NON_GROUP_MEMBER, f"a rank outside every split gets no group: {g}")
    # a split of a split (on its own ranks)
    if n == 4 and len(mine) == 2:
        solo = _split(parent_pg=sub, split_ranks=[[0], [1]])
        t = torch.arange(4.0) + r
        dist.all_reduce(t, group=solo)
        rep.check(torch.equal(t, torch.arange(4.0) + r), "split of a split, one rank each")
    # the parent is unaffected and the children work interleaved with it
    for it in range(3):
        _check_group(rep, None, list(range(n)), f"world after splits #{it}", seed=10 + it)
        if len(mine) > 1:
            _check_group(rep, sub, mine, f"split {mine} #{it}", seed=20 + it)
    return rep.result()


@pytest.mark.parametrize("size", [3, 4])
def test_split_group(run, size):
    assert_reports(_run_split(run, size, body_split, timeout=120))


@_skippable
def body_split_times(ctx, reps):
    """split_group next to new_group for the same ranks: what each adds per group and process
    (sockets, threads), and how long each takes to be ready for its first op."""
    ctx.init(timeout=30)
    halves = [[0, 1], [2, 3]]
    out = {}
    for kind in ("new_group", "split_group"):
        ts = []
        for _ in range(reps):
            dist.barrier()
            socks, threads = open_sockets(), len(os.listdir("/proc/self/task"))
            t0 = time.perf_counter()
            if kind == "new_group":
                g = [dist.new_group(h) for h in halves][ctx.rank // 2]
            else:
                g = _split(split_ranks=halves)
            dist.all_reduce(torch.ones(1), group=g)  # ready to use
            ts.append(time.perf_counter() - t0)
            out[kind + " sockets"] = open_sockets() - socks
            out[kind + " threads"] = len(os.listdir("/proc/self/task")) - threads
        out[kind] = sorted(ts)[len(ts) // 2]
    return out


def test_split_rides_its_parents_links(run):
    # What holds on every run: a split opens no socket and starts no more threads than a new group
    # of the same ranks, which opens sockets of its own. The creation times are a benchmark's
    # (benchmarks/split_bench.py), not a test's.
    res = _run_split(run, 4, body_split_times, 3, timeout=120)
    for r, out in enumerate(res):
        assert out["split_group sockets"] == 0, (r, out)
        assert out["new_group sockets"] >= 1, (r, out)
        assert out["split_group threads"] <= out["new_group threads"], (r, out)


@_skippable
def body_split_shares_links(ctx):
    """A split group travels on its parent's connections, on a channel of its own: no new socket,
    and ops of the parent and of the split with the same sequence numbers and tags in flight at once
    between the same pair never take each other's messages."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    halves = [[0, 1], [3, 2]]
    mine = next(h for h in halves if r in h)
    peer_in_sub = mine[1 - mine.index(r)]
    dist.barrier()
    before = open_sockets()
    sub = _split(split_ranks=halves)
    rep.check(open_sockets() == before, f"the split opened no socket: {before} -> {open_sockets()}")
    links = sub._get_backend(torch.device("cpu")).describe_links()
    rep.check("links shared with" in links, f"the split's links are its parent's: {links!r}")
    for it in range(4):
        # the parent's op and the split's op, each the it-th of its group, both in flight
        big = 3000 + it  # several TCP chunks and stripes, besides eager messages
        wp, ws = torch.full((big,), float(r + it)), torch.full((big,), float(10 * r + it))
        a = dist.all_reduce(wp, async_op=True)
        b = dist.all_reduce(ws, group=sub, async_op=True)
        # point-to-point with one user tag on both groups, in opposite orders
        got_p, got_s = torch.empty(7), torch.empty(7)
        reqs = [dist.isend(torch.full((7,), 100.0 * r + it), peer_in_sub, tag=5, group=sub),
                dist.irecv(got_s, peer_in_sub, tag=5, group=sub),
                dist.isend(torch.full((7,), -100.0 * r - it), (r + 1) % n, tag=5),
                dist.irecv(got_p, (r - 1) % n, tag=5)]
        for q in reqs + [a, b]:
            q.wait()
        rep.check(torch.equal(wp, torch.full((big,), float(sum(q + it for q in range(n))))), f"parent all_reduce #{it}")
        rep.check(torch.equal(ws, torch.full((big,), float(sum(10 * q + it for q in mine)))), f"split all_reduce #{it}")
        rep.check(torch.equal(got_s, torch.full((7,), 100.0 * peer_in_sub + it)), f"split recv #{it}: {got_s[0]}")
        rep.check(torch.equal(got_p, torch.full((7,), -100.0 * ((r - 1) % n) - it)), f"parent recv #{it}: {got_p[0]}")
    _check_group(rep, sub, mine, "split after the mixed traffic")
    dist.monitored_barrier(group=sub, timeout=timedelta(seconds=20), wait_all_ranks=True)  # its own tags
    # the split goes away orderly; the links stay for the parent, and lend again
    dist.destroy_process_group(sub)
    _check_group(rep, None, list(range(n)), "parent after the split was destroyed")
    again = _split(split_ranks=halves)
    _check_group(rep, again, mine, "a second split on the same links", seed=3)
    # one side sends, then leaves it. What it sent before leaving is still received after its
    # notice has arrived; a receive that finds nothing is told at once that it left.
    left = ctx.store("left")
    if mine.index(r) == 0:
        dist.send(torch.full((3,), 7.0 + r), dst=peer_in_sub, group=again)
        dist.destroy_process_group(again)
        left.set(str(r), "1")
    else:
        left.wait([str(peer_in_sub)])
        time.sleep(0.3)  # its notice is here before the receive is posted
        early = torch.empty(3)
        dist.recv(early, src=peer_in_sub, group=again)
        rep.check(torch.equal(early, torch.full((3,), 7.0 + peer_in_sub)),
                  f"a message sent before the peer left, received after its notice: {early}")
        try:
            dist.recv(torch.empty(3), src=peer_in_sub, group=again)
            rep.fail("a receive from a rank that left the split completed")
        except RuntimeError as e:
            rep.check(f"rank {mine.index(peer_in_sub)} of group" in str(e) and "left it" in str(e),
                      f"told that the peer left: {e}")
        dist.destroy_process_group(again)
    _check_group(rep, None, list(range(n)), "parent after the second split was destroyed", seed=4)
    return rep.result()


def test_split_shares_links(run):
    assert_reports(_run_split(run, 4, body_split_shares_links, timeout=120,
                              env={"MYCCL_TRANSPORT": "tcp"}))


@_skippable
def body_split_failure_stays_in_its_channel(ctx, numel):
    """A split group that fails (rank 0's op times out: rank 1 never joins it) fails alone: rank 1
    learns it from rank 0's notice, not from a timeout of its own, and the parent group and the other
    split go on over the same connections. With a large op, rank 0's sends were announced and never
    taken when it failed: they are withdrawn, not left to close the links."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    halves = [[0, 1], [2, 3]]
    mine = halves[r // 2]
    sub = _split(split_ranks=halves, timeout=timedelta(seconds=2))
    _check_group(rep, sub, mine, "split before the failure")
    if r == 0:
        try:
            dist.all_reduce(torch.ones(numel), group=sub)
            rep.fail("the all_reduce without rank 1 completed")
        except RuntimeError as e:
            rep.check("Timed out" in str(e), f"rank 0 times out: {e}")
    dist.barrier()  # the parent, on the same connections, after rank 0's split failed
    if r == 1:
        try:
            dist.all_reduce(torch.ones(5), group=sub)
            rep.fail("an all_reduce with the failed rank 0 completed")
        except RuntimeError as e:
            # told by rank 0's notice: its own timeout would say "Timed out ... waiting for rank 0"
            rep.check("failed and left it" in str(e) and "waiting for rank 0" not in str(e),
                      f"rank 1 is told that rank 0's split failed: {e}")
    if r >= 2:
        _check_group(rep, sub, mine, "the other split, unaffected")
    for it in range(2):
        _check_group(rep, None, list(range(n)), f"parent after the split failed #{it}", seed=30 + it)
    return rep.result()


@pytest.mark.parametrize("numel", [5, 1 << 20], ids=["eager", "announced"])
def test_split_failure_stays_in_its_channel(run, numel):
    assert_reports(_run_split(run, 4, body_split_failure_stays_in_its_channel, numel, timeout=120,
                              env={"MYCCL_TRANSPORT": "tcp"}))


@_skippable
def body_split_cuda_double(ctx):
    """A parent with NCCL communicators: split_group splits them with ncclCommSplit (no new
    communicator made from an id) and the new groups' CUDA ops run on them."""
    import cuda_double

    cuda_double.set_device(ctx.rank % 2)
    cuda_double.clear_violations()
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    t = torch.full((5,), float(r + 1))
    dist.all_reduce(t)  # the world's NCCL communicator
    rep.check(torch.equal(t, torch.full((5,), float(n * (n + 1) // 2))), "world all_reduce (CUDA)")
    before = cuda_double.counters()
    halves = [[0, 2], [1, 3]]
    sub = _split(split_ranks=halves)
    mine = halves[r % 2]
    after_split = cuda_double.counters()
    rep.check(after_split.get("splits", 0) - before.get("splits", 0) == 1, f"one ncclCommSplit: {after_split}")
    t = torch.full((6,), float(r + 1))
    dist.all_reduce(t, group=sub)
    rep.check(torch.equal(t, torch.full((6,), float(sum(q + 1 for q in mine)))), f"all_reduce on split {mine}")
    outs = [torch.empty(3) for _ in mine]
    dist.all_gather(outs, torch.full((3,), float(r)), group=sub)
    rep.check(all(torch.equal(o, torch.full((3,), float(q))) for o, q in zip(outs, mine)), "all_gather on split")
    after = cuda_double.counters()
    rep.check(after["comms_created"] == after_split["comms_created"],
              f"the split group made no communicator of its own: {before} -> {after}")
    cuda_double.synchronize()
    for v in cuda_double.violations():
        rep.fail(f"strict double: {v}")
    return rep.result()


def test_split_splits_nccl_communicators_on_the_double(run):
    assert_reports(_run_split(run, 4, body_split_cuda_double, timeout=120, world_env=DOUBLE))


# ---- merge ------------------------------------------------------------------------------------

@_skippable
def body_merge(ctx):
    """Two split halves merge back into one group through a store (torch's merge_remote_group)."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    halves = [[0, 1], [2, 3]]
    sub = _split(split_ranks=halves)
    merged = sub.merge_remote_group(ctx.store("merge"), n, timedelta(seconds=30), "merged")
    mr = merged.rank()
    rep.check(merged.size() == n, f"merged size {merged.size()}")
    x = torch.full((4,), float(r + 1))
    merged.allreduce([x]).wait()
    rep.check(torch.equal(x, torch.full((4,), float(n * (n + 1) // 2))), "all_reduce on the merged group")
    ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    merged.allgather([ranks], [torch.tensor([r])]).wait()
    got = sorted(int(t) for t in ranks)
    rep.check(got == list(range(n)), f"every rank once in the merged group: {got} (this rank is {mr})")
    return rep.result()


def test_merge_remote_group(run):
    assert_reports(_run_split(run, 4, body_merge, timeout=120))


# ---- shrink and survivors ---------------------------------------------------------------------

def body_shrink(ctx, excluded, flags):
    """The excluded ranks do not call shrink (here they stay alive and idle); the others make the
    smaller group and use it; repeated shrinks go on down to one rank."""
    import c10d_ext

    ctx.init(timeout=20)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    rep.check(be._supports_shrinking, "myccl supports shrinking")
    if hasattr(be, "supports_shrinking"):  # torch's own binding, where torch has shrink
        rep.check(be.supports_shrinking, "torch sees supports_shrinking")
    _check_group(rep, None, list(range(n)), "before")
    if r in excluded:
        time.sleep(3)
        return rep.result()
    alive = c10d_ext.survivors(timeout=timedelta(seconds=2))
    rep.check(alive == [q for q in range(n) if q not in excluded], f"survivors {alive}")
    dist.shrink_group(list(excluded), shrink_flags=flags)
    stay = [q for q in range(n) if q not in excluded]
    rep.check(dist.get_world_size() == len(stay) and dist.get_rank() == stay.index(r),
              f"new default group: rank {dist.get_rank()} of {dist.get_world_size()}")
    rep.check(dist.get_backend() == "myccl", f"backend after shrink {dist.get_backend()}")
    _check_group(rep, None, list(range(len(stay))), "after shrink")  # inputs by the new group's ranks
    # again, down to one rank fewer each time
    while dist.get_world_size() > 1:
        last = dist.get_world_size() - 1
        if dist.get_rank() == last:
            break
        dist.shrink_group([last])
        _check_group(rep, None, list(range(dist.get_world_size())), f"after shrink to {dist.get_world_size()}")
    return rep.result()


@pytest.mark.parametrize("size,excluded,flags", [(2, (1,), 0), (3, (1,), 0), (4, (0, 2), 1)],
                         ids=["2-exclude1", "3-exclude1", "4-exclude0and2-abort"])
def test_shrink_group(run, size, excluded, flags):
    if not hasattr(dist, "shrink_group"):
        pytest.skip(f"torch {torch.__version__} has no shrink_group")
    assert_reports(run(size, body_shrink, excluded, flags, timeout=120))


def body_shrink_errors(ctx):
    ctx.init(timeout=20)
    rep = Report(ctx)
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    for bad, words in (([], "no rank to exclude"), ([ctx.size], "is not in [0, "), ([ctx.rank], "is this rank"),
                       ([1 - ctx.rank, 1 - ctx.rank], "excluded twice")):
        try:
            be.shrink(bad, 0, None)
            rep.fail(f"shrink({bad}) did not raise")
        except (ValueError, RuntimeError) as e:
            rep.check("myccl: shrink (rank" in str(e) and words in str(e), f"shrink({bad}): {e}")
    _check_group(rep, None, list(range(ctx.size)), "the group after refused shrinks")
    return rep.result()


def test_shrink_refuses_bad_arguments(run):
    if not hasattr(torch._C._distributed_c10d.Backend, "shrink"):
        pytest.skip(f"torch {torch.__version__} binds no Backend.shrink")
    assert_reports(run(2, body_shrink_errors, timeout=60))


def body_survivors_late(ctx):
    """A rank that comes after the others settled is told so, and they went on without it."""
    import c10d_ext

    ctx.init(timeout=20)
    if ctx.rank == 2:
        time.sleep(3)
    try:
        return ("ok", c10d_ext.survivors(timeout=timedelta(seconds=1)))
    except Exception as e:  # noqa: BLE001
        return ("err", str(e))


def test_survivors_without_a_late_rank(run):
    res = run(3, body_survivors_late, timeout=60)
    assert res[0] == ("ok", [0, 1]) and res[1] == ("ok", [0, 1]), res
    assert res[2][0] == "err" and "settled on survivors [0,1] before this rank arrived" in res[2][1], res[2]


# ---- reconfigure ------------------------------------------------------------------------------

def _reconfigure(pg, uuid, handles, timeout=20):
    from torch._C._distributed_c10d import ReconfigureOptions

    opts = ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = handles
    opts.timeout = timedelta(seconds=timeout)
    return pg.reconfigure(opts)


def _exchange(ctx, key, ranks, handle):
    """The out-of-band rendezvous a job brings (torchft's lighthouse, here the test's store):
    every process in `ranks` publishes its handle; returns them in that order."""
    store = ctx.store(key)
    store.set(str(ctx.rank), handle)
    return [store.get(str(q)).decode() for q in ranks]


def _check_backend(rep, ctx, be, members, what, seed):
    """all_reduce, all_gather and broadcast (from the last member) straight on the backend, whose
    members in rank order are the processes `members` (inputs made from those process ids; after a
    reconfigure torch's rank of the group is the backend's new one, so the process id is ctx.rank)."""
    me = members.index(ctx.rank)
    rep.check(be.rank() == me and be.size() == len(members), f"{what}: rank {be.rank()} of {be.size()}")
    t = make(ctx.rank, (9,), torch.float64, seed)
    be.allreduce([t]).wait()
    rep.check(torch.equal(t, sum(make(q, (9,), torch.float64, seed) for q in members)), f"{what}: all_reduce")
    outs = [torch.empty(9, dtype=torch.float64) for _ in members]
    be.allgather([outs], [make(ctx.rank, (9,), torch.float64, seed)]).wait()
    rep.check(all(torch.equal(o, make(q, (9,), torch.float64, seed)) for o, q in zip(outs, members)),
              f"{what}: all_gather in the new rank order")
    from torch.distributed import BroadcastOptions

    b = make(ctx.rank, (9,), torch.float64, seed)
    opts = BroadcastOptions()
    opts.rootRank = len(members) - 1
    be.broadcast([b], opts).wait()
    rep.check(torch.equal(b, make(members[-1], (9,), torch.float64, seed)), f"{what}: broadcast")


def body_reconfigure(ctx):
    """The regime torch documents for gloo: no links until reconfigure(); then memberships that
    lose a process and take it back in another order, each named by the members' handles."""
    ctx.init(timeout=20, enable_reconfigure=True)
    rep = Report(ctx)
    r = ctx.rank
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    rep.check(pg.supports_reconfigure and be.supports_reconfigure, "supports_reconfigure")
    try:
        be.allreduce([torch.ones(2)]).wait()
        rep.fail("an op before reconfigure() did not raise")
    except Exception as e:  # noqa: BLE001
        rep.check("enable_reconfigure=True" in str(e) and "reconfigure()" in str(e), f"before reconfigure: {e}")
    h = pg.get_reconfigure_handle()
    rep.check(h.startswith(f"myccl:{r}:-1:"), f"handle {h}")
    all3 = _exchange(ctx, "q1", [0, 1, 2], h)
    rep.check(_reconfigure(pg, 1, all3).wait(), "reconfigure 1 completed")
    _check_backend(rep, ctx, be, [0, 1, 2], "uuid 1", 1)
    # process 2 leaves; 0 and 1 go on as a group of two (2 does not call)
    if r in (0, 1):
        pair = _exchange(ctx, "q2", [0, 1], pg.get_reconfigure_handle())
        _reconfigure(pg, 2, pair).wait()
        _check_backend(rep, ctx, be, [0, 1], "uuid 2", 2)
        # a reused uuid is refused, and the group keeps working
        if r == 0:
            try:
                _reconfigure(pg, 2, [pg.get_reconfigure_handle()], timeout=5).wait()
                rep.fail("reusing uuid 2 did not raise")
            except Exception as e:  # noqa: BLE001
                rep.check("uuid 2 was already used" in str(e), f"reused uuid: {e}")
        dist.barrier()
    # 2 comes back, as the first rank; the others follow in reverse order (a list sets the ranks)
    order = [2, 1, 0]
    hs = _exchange(ctx, "q3", order, pg.get_reconfigure_handle())
    _reconfigure(pg, 3, hs).wait()
    _check_backend(rep, ctx, be, order, "uuid 3", 3)
    # a set: the backend picks the order (sorted handles), the same on every member
    hs = _exchange(ctx, "q4", [0, 1, 2], pg.get_reconfigure_handle())
    _reconfigure(pg, 4, set(hs)).wait()
    members = [int(x.split(":")[1]) for x in sorted(hs)]
    _check_backend(rep, ctx, be, members, "uuid 4 (set)", 4)
    # bad handle lists raise before any peer is involved
    for bad, words in (([pg.get_reconfigure_handle(), "gloo:0:1:x"], "is not a myccl reconfigure handle"),
                       (["myccl:9:4:00"], "is not among the 1 handles")):
        try:
            _reconfigure(pg, 50 + r, bad).wait()
            rep.fail(f"{bad} did not raise")
        except Exception as e:  # noqa: BLE001
            rep.check(words in str(e), f"{bad}: {e}")
    # a member that never comes: named within the timeout, and the group keeps its members
    if r in (0, 1):
        hs = _exchange(ctx, "q5", [0, 1], pg.get_reconfigure_handle())
        ghost = "myccl:7:-1:0123456789abcdef"
        try:
            _reconfigure(pg, 5, hs + [ghost], timeout=3).wait()
            rep.fail("a reconfigure with a member that never comes completed")
        except Exception as e:  # noqa: BLE001
            # (the reconfigure's own 3 s timeout ended it: its words say so)
            rep.check("Timed out after 3000 ms" in str(e) and "rank(s) 2" in str(e), f"ghost member: {e}")
    dist.barrier()  # the default group is still the 3 of uuid 4
    _check_backend(rep, ctx, be, members, "after the failed reconfigure", 6)
    return rep.result()


def test_reconfigure(run):
    if not getattr(torch._C._distributed_c10d.Backend, "supports_reconfigure", None):
        pytest.skip(f"torch {torch.__version__} has no reconfigure API")
    assert_reports(run(3, body_reconfigure, timeout=120))


def body_reconfigure_races_ops(ctx):
    """reconfigure() while another thread of the same process keeps issuing ops on the group: the
    engines are never replaced under a running op. Every op either completes with the right sum or
    raises a myccl error, reconfigure either completes or raises (ops in flight, or a member that
    stayed behind them), nothing crashes or hangs beyond the timeouts, and the group works after."""
    import threading

    ctx.init(timeout=4)
    rep = Report(ctx)
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    n = ctx.size
    outcomes = {"ok": 0, "err": 0, "bad": []}

    def ops(stop):
        k = 0
        while not stop.is_set() and k < 400:
            k += 1
            t = torch.full((64,), float(ctx.rank + 1))
            try:
                if k % 2:
                    be.allreduce([t]).wait()  # asynchronous: queued on the engine
                else:
                    dist.all_reduce(t)  # synchronous: may run inline, holding the engines
                if torch.equal(t, torch.full((64,), float(n * (n + 1) / 2))):
                    outcomes["ok"] += 1
                else:
                    outcomes["bad"].append(f"op {k}: wrong sum {t[0].item()}")
            except Exception as e:  # noqa: BLE001
                outcomes["err"] += 1
                if "myccl" not in str(e):
                    outcomes["bad"].append(f"op {k}: an error that does not name myccl: {str(e)[:200]}")

    errors = []
    for round_ in range(3):
        stop = threading.Event()
        worker = threading.Thread(target=ops, args=(stop,))
        worker.start()
        time.sleep(0.05 * (round_ + 1))
        hs = _exchange(ctx, f"race{round_}", list(range(n)), pg.get_reconfigure_handle())
        try:
            _reconfigure(pg, 100 + round_, hs, timeout=4).wait()
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
            rep.check("in flight" in str(e) or "Timed out" in str(e) or "myccl" in str(e),
                      f"round {round_}: an unclear reconfigure error: {str(e)[:300]}")
        stop.set()
        worker.join(timeout=60)
        rep.check(not worker.is_alive(), f"round {round_}: the op thread is stuck")
    rep.check(not outcomes["bad"], f"ops that went wrong: {outcomes['bad'][:5]}")
    rep.check(outcomes["ok"] + outcomes["err"] > 0, "no op ran")
    # Quiet now: a reconfigure with a fresh uuid makes a working group whatever the races left.
    hs = _exchange(ctx, "race-final", list(range(n)), pg.get_reconfigure_handle())
    _reconfigure(pg, 200, hs, timeout=20).wait()
    _check_backend(rep, ctx, be, list(range(n)), "after the races", 7)
    return rep.result() + (outcomes["ok"], outcomes["err"], len(errors))


def test_reconfigure_races_ops(run):
    if not getattr(torch._C._distributed_c10d.Backend, "supports_reconfigure", None):
        pytest.skip(f"torch {torch.__version__} has no reconfigure API")
    res = run(2, body_reconfigure_races_ops, timeout=240)
    assert_reports([r[:2] for r in res])
    print("ops ok / failed, reconfigure errors, per rank:", [r[2:] for r in res])


def body_reconfigure_refuses_ops_in_flight(ctx):
    """A reconfigure with an op of the group still queued raises at once, naming it, and changes
    nothing; once the op is done the same reconfigure goes through."""
    ctx.init(timeout=20)
    rep = Report(ctx)
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    hs = _exchange(ctx, "inflight", [0, 1], pg.get_reconfigure_handle())
    t = torch.ones(8)
    if ctx.rank == 0:
        w = be.allreduce([t])  # rank 1 joins only after rank 0's refusal: the op stays in flight
        try:
            _reconfigure(pg, 300, hs, timeout=5).wait()
            rep.fail("reconfigure with an op in flight went through")
        except Exception as e:  # noqa: BLE001
            rep.check("1 op(s) of this group are still in flight" in str(e), f"refusal: {str(e)[:300]}")
        ctx.store("inflight").set("refused", "1")
        w.wait()
    else:
        ctx.store("inflight").wait(["refused"])
        be.allreduce([t]).wait()
    rep.check(torch.equal(t, torch.full((8,), 2.0)), f"the op in flight completed: {t[0].item()}")
    _reconfigure(pg, 301, hs, timeout=20).wait()
    _check_backend(rep, ctx, be, [0, 1], "after the refusal", 8)
    return rep.result()


def test_reconfigure_refuses_ops_in_flight(run):
    if not getattr(torch._C._distributed_c10d.Backend, "supports_reconfigure", None):
        pytest.skip(f"torch {torch.__version__} has no reconfigure API")
    assert_reports(run(2, body_reconfigure_refuses_ops_in_flight, timeout=120))
