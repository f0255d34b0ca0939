"""pylibwholegraph.torch's names in c10d_ext.wholememory: start-up, communicators and
WholeMemoryTensor at 1-4 ranks on one host, every result against a local reference (the table one
process would hold), every bad input an error on every rank with the job going on, CUDA locations
on the strict double (and a GPU), and distributed memory across two namespace hosts. The files
are test_wholegraph_files.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
import uuid

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import WORLD
from harness import ROOT, TESTS, Report, assert_reports, free_port, one_thread
from wm_helpers import TYPES, _reference, expect, on_one_rank, parts, start, uneven

ROWS = 13

_expect, _on_one_rank, _parts, _start, _uneven = expect, on_one_rank, parts, start, uneven


# -- start-up and communicators ---------------------------------------------------------------------


def _ranks_of(comm):
    """The world ranks of a communicator's members, in its rank order (an all_gather over it)."""
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(comm.get_size())]
    dist.all_gather(got, torch.tensor([dist.get_rank()]), group=comm.wmb_comm)
    return [int(x) for x in got]


@one_thread
def body_start_up(ctx):
    import c10d_ext.wholememory as wgth

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    local_size = 2 if n == 4 else n  # at 4 ranks: two "nodes" of two consecutive ranks
    wgth.finalize()  # (what an earlier call in this process may have left)
    _expect(rep, "init with a bad log level", lambda: wgth.init(r, n, r % local_size, local_size, "loud"), ValueError,
            "loud")
    _expect(rep, "create_group_communicator before init", wgth.create_group_communicator, RuntimeError, "init")
    g, local = wgth.init_torch_env_and_create_wm_comm(r, n, r % local_size, local_size)
    rep.check(dist.is_initialized() and dist.get_backend() == "myccl", "the default group runs myccl")
    rep.check(torch.get_num_threads() == 1, "one intra-op thread, as pylibwholegraph sets")
    rep.check((g.get_rank(), g.get_size()) == (r, n), f"global rank/size {g.get_rank()}/{g.get_size()}")
    rep.check((local.get_rank(), local.get_size()) == (r % local_size, local_size), "local node rank/size")
    rep.check((local is g) == (local_size == n), "the global communicator is the local one when one node")
    rep.check(isinstance(g.wmb_comm, wgth.Communicator), "wmb_comm is a communicator")
    rep.check(wgth.get_global_communicator() is g and wgth.get_local_node_communicator() is local, "cached")
    rep.check(_ranks_of(g) == list(range(n)), "the global communicator's members")
    base = r // local_size * local_size
    rep.check(_ranks_of(local) == list(range(base, base + local_size)), f"local node members {_ranks_of(local)}")
    dev = wgth.get_local_device_communicator()
    rep.check((dev.get_rank(), dev.get_size()) == (0, 1), "the local device communicator is this rank alone")
    rep.check((dev is g) == (n == 1) and wgth.get_local_device_communicator() is dev, "device communicator cached")
    g.barrier()
    local.barrier()
    rep.check(g.distributed_backend == "nccl", "distributed_backend")
    g.distributed_backend = "nccl"
    _expect(rep, "nvshmem", lambda: setattr(g, "distributed_backend", "nvshmem"), NotImplementedError, "nvshmem")
    _expect(rep, "an unknown backend", lambda: setattr(g, "distributed_backend", "mpi"), ValueError, "'mpi'")
    _expect(rep, "global nvshmem", lambda: wgth.get_global_communicator("nvshmem"), NotImplementedError, "nvshmem")
    rep.check(g.get_clique_info() == (False, -1, -1, 0, 0, 0), f"clique info {g.get_clique_info()}")
    _expect(rep, "mnnvl", wgth.get_local_mnnvl_communicator, RuntimeError, "mnnvl")
    for mt in TYPES:
        rep.check(g.support_type_location(mt, "cpu"), f"{mt} on cpu")
        rep.check(g.support_type_location(mt, "cuda") == torch.cuda.is_available(), f"{mt} on cuda")
    rep.check(not g.support_type_location("hierarchy", "cpu"), "hierarchy is not offered")
    _expect(rep, "an unknown type", lambda: g.support_type_location("striped", "cpu"), ValueError, "striped")
    _expect(rep, "an unknown location", lambda: g.support_type_location("chunked", "tpu"), ValueError, "tpu")

    # groups of the world: every size and stride that divides it
    for size, stride in [(-1, 1), (1, 1)] + ([(2, 1), (2, 2)] if n == 4 else []) + ([(1, n)] if n > 1 else []):
        c = wgth.create_group_communicator(size, stride)
        width = n if size == -1 else size
        block = width * stride
        first = r // block * block + r % block % stride
        rep.check(_ranks_of(c) == [first + i * stride for i in range(width)], f"group {size}x{stride}: {_ranks_of(c)}")
        wgth.destroy_communicator(c)
        rep.check(c.wmb_comm is None, "destroyed")
    _expect(rep, "a group size that does not divide", lambda: wgth.create_group_communicator(n + 1), ValueError,
            f"{n + 1}", f"{n}")
    if n > 1:
        _on_one_rank(rep, "ranks disagree on group_size",
                     lambda: wgth.create_group_communicator(-1 if r else 1), 0, ValueError, ["disagree"], True)
    # splits: by parity, ordered by descending world rank; rank 0 stays out
    color = -1 if (r == 0 and n > 1) else r % 2
    s = wgth.split_communicator(g, color, key=-r)
    if color < 0:
        rep.check(s is None, "a negative color gets None")
    else:
        want = sorted((q for q in range(n) if q % 2 == color and not (q == 0 and n > 1)), reverse=True)
        rep.check(_ranks_of(s) == want, f"split {color}: {_ranks_of(s)}, expected {want}")
        s.destroy()
        _expect(rep, "a destroyed communicator", s.get_rank, RuntimeError, "destroyed")
        wgth.destroy_communicator(s)  # again: nothing
    wgth.destroy_communicator(None)
    _on_one_rank(rep, "a split with a bad color", lambda: wgth.split_communicator(g, "red" if r == n - 1 else 0),
                 n - 1, TypeError, ["'red'"], n > 1)
    g.barrier()  # the job goes on

    # finalize: communicators and the default group go, tensors stay readable
    t = wgth.create_wholememory_tensor(g, "continuous", "cpu", [ROWS, 3], torch.float32, None)
    part, first = t.get_local_tensor()
    ref = _reference(ROWS, (3,), torch.float32)
    part.copy_(ref[first:first + part.shape[0]])
    g.barrier()
    wgth.finalize()
    rep.check(not dist.is_initialized(), "finalize destroys the default group")
    _expect(rep, "a communicator after finalize", g.get_rank, RuntimeError, "destroyed")
    rep.check(torch.equal(t.get_global_tensor(), ref), "a continuous tensor stays readable after finalize")
    _expect(rep, "create_group_communicator after finalize", wgth.create_group_communicator, RuntimeError, "init")
    return rep.result()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_start_up_and_communicators(run, size):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "", "WORLD_SIZE": ""}
    assert_reports(run(size, body_start_up, timeout=120, env=env))


# -- tensors -----------------------------------------------------------------------------------------

CASES = [  # sizes, strides, dtype, uneven partition
    ([ROWS, 5], [8, 1], "float32", False),
    ([ROWS, 5], None, "bfloat16", True),
    ([ROWS], None, "int64", False),
    ([ROWS], [1], "int32", True),
]


def _gathered(t, rows):
    return t.gather(torch.arange(rows))


def body_tensors(ctx, mt):
    wgth, g = _start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    gen = torch.Generator().manual_seed(10 + r)
    for sizes, strides, dtype_name, uneven in CASES:
        dtype = getattr(torch, dtype_name)
        partition = _uneven(ROWS, n) if uneven else None
        what = f"{mt} {sizes} {dtype_name} partition {partition}"
        t = wgth.create_wholememory_tensor(g, mt, "cpu", sizes, dtype, strides, partition)
        rest = tuple(sizes[1:])
        want_strides = tuple(strides) if strides else ((sizes[1], 1) if rest else (1,))
        rep.check((t.shape, t.dtype, t.dim(), t.stride(), t.storage_offset()) ==
                  (tuple(sizes), dtype, len(sizes), want_strides, 0), f"{what}: description")
        rep.check(t.get_comm() is g, f"{what}: get_comm")
        ref = _reference(ROWS, rest, dtype)
        parts = _parts(ROWS, n, partition)
        local, first = t.get_local_tensor()
        rep.check((first, local.shape[0], tuple(local.shape[1:])) == (*parts[r], rest), f"{what}: local part")
        rep.check(torch.equal(local, torch.zeros_like(local)), f"{what}: zero-filled")
        local.copy_(ref[first:first + local.shape[0]])
        g.barrier()
        k = 0 if r == 1 else 3 * ROWS + r  # repeats, any order; rank 1 asks for nothing
        idx = torch.randint(0, ROWS, (k,), generator=gen, dtype=torch.int32 if r % 2 else torch.int64)
        rep.check(torch.equal(t.gather(idx), ref[idx.long()]), f"{what}: gather")
        got = t.gather(idx, force_dtype=torch.float64)
        rep.check(got.dtype == torch.float64 and torch.equal(got, ref[idx.long()].double()), f"{what}: force_dtype")
        g.barrier()
        mine = torch.arange(r, ROWS, n)  # written twice: the last value wins
        new = -ref[mine] - 1
        t.scatter(torch.cat([torch.zeros_like(new), new]), torch.cat([mine, mine]))
        g.barrier()
        want = -ref - 1
        rep.check(torch.equal(_gathered(t, ROWS), want), f"{what}: scatter")
        _views(rep, wgth, t, mt, want, parts, what)
        _sub_tensors(rep, g, t, want, parts, r, n, what)
        g.barrier()
    _wrapped(rep, wgth, mt, r, n)
    wgth.finalize()
    return rep.result()


def _views(rep, wgth, t, mt, want, parts, what):
    if mt == "continuous":
        rep.check(torch.equal(t.get_global_tensor(), want), f"{what}: get_global_tensor")
        rep.check(torch.equal(t.get_global_tensor(host_view=True), want), f"{what}: its host view")
    else:
        _expect(rep, f"{what}: get_global_tensor", t.get_global_tensor, ValueError, "global")
    if mt == "distributed":
        _expect(rep, f"{what}: get_all_chunked_tensor", t.get_all_chunked_tensor, ValueError, "other ranks")
    else:
        chunks = t.get_all_chunked_tensor()
        rep.check(len(chunks) == len(parts) and all(torch.equal(c, want[f:f + k]) for c, (f, k) in zip(chunks, parts)),
                  f"{what}: get_all_chunked_tensor")
    local, first = t.get_local_tensor(host_view=True)
    rep.check(torch.equal(local, want[first:first + local.shape[0]]), f"{what}: host view of the local part")


def _sub_tensors(rep, g, t, want, parts, r, n, what):
    """A window (rows 3.., and columns 1:4 of a matrix): description, gather, local part, a
    scatter that leaves the other columns alone, and a window of the window."""
    two = t.dim() == 2
    s = t.get_sub_tensor([3, 1], [-1, 4]) if two else t.get_sub_tensor([3], [-1])
    win = want[3:, 1:4] if two else want[3:]
    rep.check(s.shape == tuple(win.shape) and s.stride() == t.stride() and
              s.storage_offset() == 3 * t.stride()[0] + (1 if two else 0), f"{what}: sub tensor description")
    rep.check(torch.equal(_gathered(s, ROWS - 3), win), f"{what}: sub tensor gather")
    local, off = s.get_local_tensor()
    f, k = parts[r]
    lo = max(f, 3)
    hi = max(lo, min(f + k, ROWS))
    rep.check(off == lo - 3 and torch.equal(local, want[lo:hi, 1:4] if two else want[lo:hi]),
              f"{what}: sub tensor local part (offset {off})")
    g.barrier()
    mine = torch.arange(r, ROWS - 3, n)
    vals = torch.full((mine.numel(),) + tuple(win.shape[1:]), 7 + r, dtype=want.dtype)
    s.scatter(vals, mine)
    g.barrier()
    after = want.clone()
    for q in range(n):
        rows = torch.arange(q, ROWS - 3, n) + 3
        if two:
            after[rows, 1:4] = 7 + q
        else:
            after[rows] = 7 + q
    rep.check(torch.equal(_gathered(t, ROWS), after), f"{what}: sub tensor scatter (other columns kept)")
    ss = s.get_sub_tensor([1, -1], [4, 2]) if two else s.get_sub_tensor([1], [4])
    rep.check(torch.equal(_gathered(ss, 3), after[4:7, 1:3] if two else after[4:7]), f"{what}: window of a window")
    g.barrier()
    t.scatter(want[:0], torch.arange(0))  # nothing to write: still fine
    t.scatter(want[torch.arange(r, ROWS, n)], torch.arange(r, ROWS, n))  # back as before
    g.barrier()


def _wrapped(rep, wgth, mt, r, n):
    """What the embeddings build on: a communicator from any process group, a tensor around a
    seed-layer tensor."""
    c = wgth.WholeMemoryCommunicator(dist.group.WORLD)
    rep.check((c.get_rank(), c.get_size(), c.wmb_comm) == (r, n, dist.group.WORLD), "a wrapped group")
    kind = {"continuous": wgth.WmTensorType.HOST, "chunked": wgth.WmTensorType.CHUNKED,
            "distributed": wgth.WmTensorType.DISTRIBUTED}[mt]
    seed = wgth.create_wm_tensor(c.wmb_comm, [ROWS, 4], [], torch.float32, kind)
    t = wgth.WholeMemoryTensor(seed)
    ref = _reference(ROWS, (4,), torch.float32)
    rep.check(t.wmb_tensor is seed and t.shape == (ROWS, 4) and t.dtype == torch.float32, "a wrapped tensor")
    local, first = t.get_local_tensor()
    local.copy_(ref[first:first + local.shape[0]])
    c.barrier()
    rep.check(torch.equal(wgth.gather(seed, torch.arange(ROWS)), ref), "a wrapped tensor's rows in the seed tensor")
    rep.check(torch.equal(t.gather(torch.arange(ROWS)), ref), "a wrapped tensor's gather")
    wgth.destroy_wholememory_tensor(t)
    _expect(rep, "a destroyed tensor", lambda: t.get_local_tensor(), RuntimeError, "destroyed")
    c.destroy()  # a wrapped torch group is only let go
    c2 = wgth.WholeMemoryCommunicator(dist.group.WORLD)
    c2.barrier()


@pytest.mark.parametrize("mt", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_tensors(run, size, mt):
    assert_reports(run(size, body_tensors, mt, timeout=150))


# -- bad input: an error on every rank, and the job goes on --------------------------------------------


def body_bad_input(ctx, mt):
    wgth, g = _start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    last = n - 1
    make = wgth.create_wholememory_tensor
    f32 = torch.float32
    every = [
        ("an unknown memory type", lambda: make(g, "striped", "cpu", [8, 2], f32, None), ValueError, ["'striped'"]),
        ("an unknown location", lambda: make(g, mt, "tpu", [8, 2], f32, None), ValueError, ["'tpu'"]),
        ("3 dimensions", lambda: make(g, mt, "cpu", [8, 2, 2], f32, None), ValueError, ["dim 1 or 2", "[8, 2, 2]"]),
        ("a zero size", lambda: make(g, mt, "cpu", [0, 2], f32, None), ValueError, ["[0, 2]"]),
        ("overlapping strides", lambda: make(g, mt, "cpu", [8, 4], f32, [3, 1]), ValueError, ["[3, 1]"]),
        ("a last stride of 2", lambda: make(g, mt, "cpu", [8, 4], f32, [8, 2]), ValueError, ["[8, 2]"]),
        ("a dtype", lambda: make(g, mt, "cpu", [8, 4], torch.bool, None), TypeError, ["torch.bool"]),
        ("a partition that does not add up", lambda: make(g, mt, "cpu", [8, 4], f32, None, [1] * n), ValueError,
         [str([1] * n), "8 entries"]),
        ("a partition of another length", lambda: make(g, mt, "cpu", [8, 4], f32, None, [8] + [0] * n), ValueError,
         [f"{n} ranks"]),
        ("hierarchy", lambda: make(g, "hierarchy", "cpu", [8, 4], f32, None), ValueError, ["not offered"]),
    ]
    if not torch.cuda.is_available():
        every.append(("cuda without a device", lambda: make(g, mt, "cuda", [8, 4], f32, None), ValueError,
                      ["no CUDA device"]))
    for what, fn, exc, texts in every:
        _expect(rep, what, fn, exc, f"(rank {r})", *texts)
    if n > 1:  # one rank alone wrong: it says what, the others name it
        _on_one_rank(rep, "one rank's unknown type",
                     lambda: make(g, "striped" if r == last else mt, "cpu", [8, 2], f32, None), last, ValueError,
                     ["'striped'"], True)
        _expect(rep, "ranks disagree on sizes", lambda: make(g, mt, "cpu", [8 + r, 2], f32, None), ValueError,
                f"(rank {r})", "disagree on sizes")
    t = make(g, mt, "cpu", [ROWS, 3], f32, None, _uneven(ROWS, n))
    ref = _reference(ROWS, (3,), f32)
    local, first = t.get_local_tensor()
    local.copy_(ref[first:first + local.shape[0]])
    g.barrier()
    sub = t.get_sub_tensor([4, 1], [-1, -1])
    collective = mt == "distributed"
    ok = torch.arange(ROWS)
    for name, view, rows, whole in (("tensor", t, ROWS, ref), ("sub tensor", sub, ROWS - 4, ref[4:, 1:])):
        cases = [
            ("an index past the end", lambda: view.gather(torch.tensor([1, rows + r])), IndexError, [f"{rows + r}"]),
            ("a negative index", lambda: view.gather(torch.tensor([-1 - r])), IndexError, [f"{-1 - r}"]),
            ("float indices", lambda: view.gather(torch.tensor([1.0])), TypeError, ["torch.float32"]),
            ("2-D indices", lambda: view.gather(torch.zeros(2, 2, dtype=torch.int64)), ValueError, ["[2, 2]"]),
            ("no tensor", lambda: view.gather([1, 2]), TypeError, ["list"]),
            ("a force_dtype", lambda: view.gather(ok[:rows], force_dtype=torch.bool), TypeError, ["torch.bool"]),
            ("scatter past the end", lambda: view.scatter(torch.zeros(1, view.shape[1]), torch.tensor([rows + r])),
             IndexError, [f"{rows + r}"]),
            ("scatter rows of another shape", lambda: view.scatter(torch.zeros(2, 5), torch.tensor([0, 1])),
             ValueError, ["[2, 5]"]),
            ("scatter by 2-D indices", lambda: view.scatter(torch.zeros(2, view.shape[1]),
                                                            torch.zeros(2, 1, dtype=torch.int64)), ValueError,
             ["indice", "[2, 1]"]),
            ("scatter ints into floats", lambda: view.scatter(torch.zeros(1, view.shape[1], dtype=torch.int64),
                                                              torch.tensor([0])), TypeError, ["torch.int64"]),
        ]
        for what, fn, exc, texts in cases:
            _on_one_rank(rep, f"{name}: {what} on rank {last}",
                         fn if r == last else (lambda: view.gather(ok[:rows]) if "scatter" not in what
                                               else view.scatter(ref[:0, :view.shape[1]], ok[:0])),
                         last, exc, texts, collective)
            got = view.gather(ok[:rows])  # the job goes on
            rep.check(torch.equal(got, whole), f"{name}: after {what}")
    for what, starts, ends, exc in (("a start past the end", [ROWS, 0], [-1, -1], IndexError),
                                    ("an empty range", [3, 0], [3, -1], IndexError),
                                    ("an end past the end", [0, 0], [ROWS + 1, -1], IndexError),
                                    ("columns past the end", [0, 1], [-1, 4], IndexError),
                                    ("one dimension of two", [0], [-1], ValueError)):
        _expect(rep, f"get_sub_tensor: {what}", lambda: t.get_sub_tensor(starts, ends), exc, f"(rank {r})")
    _expect(rep, "a sub tensor's sub tensor past its end", lambda: sub.get_sub_tensor([ROWS - 4, 0], [-1, -1]),
            IndexError, f"[{ROWS - 4}, -1)")
    if mt == "distributed":
        _expect(rep, "get_global_tensor", t.get_global_tensor, ValueError, f"(rank {r})", "no global view")
    rep.check(torch.equal(t.gather(ok), ref), "the tensor is intact")
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("mt", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_input_on_every_rank(run, size, mt):
    assert_reports(run(size, body_bad_input, mt, timeout=150))


def body_gloo(ctx):
    """A default group on gloo: communicators made from it run myccl; a wrapped gloo group holds
    distributed memory and says no to the kinds that need myccl's shared memory."""
    import c10d_ext.wholememory as wgth

    wgth.finalize()
    ctx.init(backend="gloo")
    r, n = ctx.rank, ctx.size
    wgth.init(r, n, r, n)
    rep = Report(ctx)
    ref = _reference(ROWS, (2,), torch.float32)
    wrapped = wgth.WholeMemoryCommunicator(dist.group.WORLD)
    for comm, mt in ((wgth.get_global_communicator(), "chunked"), (wrapped, "distributed")):
        t = wgth.create_wholememory_tensor(comm, mt, "cpu", [ROWS, 2], torch.float32, None, _uneven(ROWS, n))
        part, first = t.get_local_tensor()
        part.copy_(ref[first:first + part.shape[0]])
        comm.barrier()
        rep.check(torch.equal(t.gather(torch.arange(ROWS).flip(0)), ref.flip(0)), f"{mt} on {comm}")
        comm.barrier()
    rep.check(not wrapped.support_type_location("continuous", "cpu"), "continuous needs myccl")
    _expect(rep, "continuous on gloo", lambda: wgth.create_wholememory_tensor(
        wrapped, "continuous", "cpu", [ROWS, 2], torch.float32, None), ValueError, f"(rank {r})", "myccl")
    wgth.finalize()
    return rep.result()


def test_on_a_gloo_default_group(run):
    assert_reports(run(2, body_gloo, timeout=120))


# -- cuda locations: the strict double, and a GPU ----------------------------------------------------------


def body_cuda(ctx, mode, tmp):
    import c10d_ext.wholememory as wgth

    if mode == "gpu":
        torch.cuda.set_device(0)
    ctx.init(timeout=60)
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % 2)
    dev = torch.device("cuda", 0) if mode == "gpu" else torch.device("cpu")  # the double's CUDA tensors are CPU ones
    r, n = ctx.rank, ctx.size
    wgth.init(r, n, r, n)
    g = wgth.get_global_communicator()
    rep = Report(ctx)
    rep.check(g.support_type_location("continuous", "cuda") and g.support_type_location("chunked", "cuda"),
              "continuous and chunked on cuda")
    rep.check(g.support_type_location("distributed", "cuda") == (mode == "gpu"), "distributed on cuda: a GPU only")

    def fence():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        g.barrier()

    ref = _reference(ROWS, (5,), torch.float32).to(dev)
    every = torch.arange(ROWS, device=dev)
    for mt in ["continuous", "chunked"] + (["distributed"] if mode == "gpu" else []):
        for partition in (None, _uneven(ROWS, n)):
            what = f"{mt} on cuda, partition {partition}"
            t = wgth.create_wholememory_tensor(g, mt, "cuda", [ROWS, 5], torch.float32, [8, 1], partition)
            local, first = t.get_local_tensor()
            rep.check(local.device == dev and (first, local.shape[0]) == _parts(ROWS, n, partition)[r],
                      f"{what}: local part on {local.device}")
            local.copy_(ref[first:first + local.shape[0]])
            fence()
            idx = torch.randint(0, ROWS, (2 * ROWS + r,), generator=torch.Generator().manual_seed(r)).to(dev)
            got = t.gather(idx, force_dtype=torch.float16)
            rep.check(got.device == dev and torch.equal(got, ref[idx].half()), f"{what}: gather")
            fence()
            mine = torch.arange(r, ROWS, n, device=dev)
            t.scatter(-ref[mine], mine)
            fence()
            rep.check(torch.equal(t.gather(every), -ref), f"{what}: scatter")
            fence()
            sub = t.get_sub_tensor([2, 1], [-1, 3])
            rows = torch.arange(r, ROWS - 2, n, device=dev)
            sub.scatter(torch.zeros(rows.numel(), 2, device=dev), rows)
            fence()
            want = -ref
            for q in range(n):
                want[torch.arange(q, ROWS - 2, n) + 2, 1:3] = 0
            rep.check(torch.equal(t.gather(every), want), f"{what}: a sub tensor's scatter")
            _expect(rep, f"{what}: host_view", lambda: t.get_local_tensor(host_view=True), ValueError,
                    f"(rank {r})", "host_view")
            if mt == "continuous":
                rep.check(torch.equal(t.get_global_tensor(), want), f"{what}: get_global_tensor")
            prefix = os.path.join(tmp, f"{mt}-{partition is None}")
            t.to_file_prefix(prefix)
            back = wgth.create_wholememory_tensor(g, mt, "cuda", [ROWS, 5], torch.float32, None)
            back.from_file_prefix(prefix)
            rep.check(torch.equal(back.gather(every), want), f"{what}: files")
            fence()
    # cpu memory, seen from the device: writes through the view land in the host copy
    h = wgth.create_wholememory_tensor(g, "continuous", "cpu", [ROWS, 5], torch.float32, None)
    local, first = h.get_local_tensor()
    rep.check(local.device == dev, f"cpu memory's local part seen from {local.device}")
    local.copy_(ref[first:first + local.shape[0]])
    fence()
    rep.check(torch.equal(h.get_global_tensor(host_view=True), ref.cpu()), "cpu memory's device view")
    wgth.finalize()
    violations = None
    if mode == "double":
        import cuda_double

        violations = cuda_double.violations()
    return rep.result(), violations


@pytest.mark.parametrize("mode", [pytest.param("double", id="double"),
                                  pytest.param("gpu", id="gpu", marks=pytest.mark.cuda)])
def test_cuda_locations(run, mode):

    with tempfile.TemporaryDirectory() as tmp:
        res = run(2, body_cuda, mode, tmp, world_env=WORLD[mode], timeout=180)
    assert_reports([rep for rep, _ in res])
    assert all(not v for _, v in res), [v for _, v in res]


# -- across hosts: two namespace hosts of two ranks, under torchrun ------------------------------------


def multihost_worker(out_dir: str) -> None:
    """Runs under torchrun on each namespace host (this file as the script)."""
    import c10d_ext.wholememory as wgth

    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lr, ls = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])

    class Ctx:
        rank = r

    rep = Report(Ctx)
    try:
        g, local = wgth.init_torch_env_and_create_wm_comm(r, n, lr, ls)
        rep.check(g.host_count() == n // ls and local.host_count() == 1, "hosts of the communicators")
        for mt in TYPES:
            rep.check(g.support_type_location(mt, "cpu") == (mt == "distributed"), f"{mt} across hosts")
            rep.check(local.support_type_location(mt, "cpu"), f"{mt} within a host")
        _expect(rep, "chunked across hosts", lambda: wgth.create_wholememory_tensor(
            g, "chunked", "cpu", [ROWS, 3], torch.float32, None), ValueError, f"(rank {r})", "spans 2 hosts")
        ref = _reference(ROWS, (3,), torch.float32)
        every = torch.arange(ROWS)
        for comm, mt in ((g, "distributed"), (local, "continuous"), (local, "chunked")):
            for partition in (None, _uneven(ROWS, comm.get_size())):
                what = f"{mt} on {comm.get_size()} ranks, partition {partition}"
                t = wgth.create_wholememory_tensor(comm, mt, "cpu", [ROWS, 3], torch.float32, [4, 1], partition)
                part, first = t.get_local_tensor()
                part.copy_(ref[first:first + part.shape[0]])
                comm.barrier()
                idx = torch.randint(0, ROWS, (3 * ROWS + r,), generator=torch.Generator().manual_seed(r))
                rep.check(torch.equal(t.gather(idx), ref[idx]), f"{what}: gather")
                comm.barrier()
                me, size = comm.get_rank(), comm.get_size()
                sub = t.get_sub_tensor([1, 1], [-1, -1])
                rows = torch.arange(me, ROWS - 1, size)
                sub.scatter(-ref[rows + 1, 1:], rows)
                comm.barrier()
                want = ref.clone()
                want[1:, 1:] *= -1
                rep.check(torch.equal(t.gather(every), want), f"{what}: a sub tensor's scatter")
                prefix = os.path.join(out_dir, f"{mt}-{partition is None}-{r // ls if comm is local else 'all'}")
                t.to_file_prefix(prefix)
                back = wgth.create_wholememory_tensor(comm, "distributed", "cpu", [ROWS, 3], torch.float32, None)
                back.from_file_prefix(prefix)
                rep.check(torch.equal(back.gather(every), want), f"{what}: files")
                comm.barrier()
        across = wgth.split_communicator(g, lr, key=r)  # one rank per host
        rep.check((across.get_size(), across.get_rank(), across.host_count()) == (n // ls, r // ls, n // ls),
                  "a split across hosts")
        t = wgth.create_wholememory_tensor(across, "distributed", "cpu", [ROWS], torch.int64, None)
        part, first = t.get_local_tensor()
        part.copy_(torch.arange(first, first + part.shape[0]) * 7)
        rep.check(torch.equal(t.gather(every.flip(0)), every.flip(0) * 7), "a 1-D gather on the split")
        wgth.finalize()
    except Exception:  # noqa: BLE001
        rep.fail(f"exception\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump({"checks": rep.checks, "fails": rep.failures}, f)


def test_across_hosts():
    import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    # this file runs as the script: the shared helpers at the top of tests/ must be importable
    path = os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    env.pop("MYCCL_SOCKET_IFNAME", None)
    with tempfile.TemporaryDirectory() as out, netns.Hosts(2) as hosts:
        procs, run_id = [], uuid.uuid4().hex[:8]
        for i in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:29500", "--rdzv-id", run_id,
                   "--max-restarts", "0",
                   "--local-addr", hosts.addrs[i]] + (["--rdzv-conf", "is_host=1"] if i == 0 else []) + \
                  [os.path.abspath(__file__), out]
            p = hosts.popen(i, cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
            procs.append(p)
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=240)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        results = []
        for r in range(4):
            path = os.path.join(out, f"rank{r}.json")
            assert os.path.exists(path), f"rank {r} wrote nothing:\n" + "\n----\n".join(x[-3000:] for x in logs)
            with open(path) as f:
                results.append(json.load(f))
    fails = [f for res in results for f in res["fails"]]
    assert not fails, "\n".join(fails[:30])
    assert all(res["checks"] > 0 for res in results)


if __name__ == "__main__":  # (torchrun runs this file on the namespace hosts; tests/ is on PYTHONPATH)
    multihost_worker(sys.argv[1])
