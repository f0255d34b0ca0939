"""c10d_ext.wholememory: every kind at 1-4 ranks on one host, values against a local reference
(the table a single process would hold), every bad input, files, and nothing left behind."""

from __future__ import annotations

import glob
import os
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import WORLD
from harness import ROOT
from wm_helpers import _reference
KINDS = ["HOST", "CHUNKED", "DISTRIBUTED", "DISTRIBUTED-exchange"]
# DISTRIBUTED on one host reads rows where they lie (MYCCL_WM_DIRECT, the default); "-exchange"
# runs the same tests through the exchange over the group, the path across hosts and on CUDA.
EXCHANGE = {"MYCCL_WM_DIRECT": "0"}


def _kind_env(kind):
    return (kind.split("-")[0], EXCHANGE if kind.endswith("-exchange") else None)


def _fill_own_part(wm, t, rows, rest, dtype):
    """Each rank writes its own rows through local_partition; returns (first, count)."""
    part, first = wm.local_partition(t)
    part.copy_(_reference(rows, rest, dtype)[first:first + part.shape[0]])
    return first, part.shape[0]


def _sync(kind):
    if kind != "DISTRIBUTED":
        dist.barrier()  # mapped kinds: reads must wait for the others' writes


def body_kind(ctx, kind, rows, rest, stride, dtype_name):
    import c10d_ext.wholememory as wm

    ctx.init()
    r, n = ctx.rank, ctx.size
    dtype = getattr(torch, dtype_name)
    shape = [rows, *rest]
    t = wm.create_wm_tensor(None, shape, stride, dtype, getattr(wm.WmTensorType, kind))
    bad = []
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        bad.append(f"shape/dtype {tuple(t.shape)} {t.dtype}")
    first, count = _fill_own_part(wm, t, rows, tuple(rest), dtype)
    per = -(-rows // (n if kind == "DISTRIBUTED" else dist.get_world_size()))
    if (first, count) != (min(r * per, rows), min((r + 1) * per, rows) - min(r * per, rows)):
        bad.append(f"partition ({first}, {count}) for rank {r} of {n}, rows {rows}")
    _sync(kind)
    ref = _reference(rows, tuple(rest), dtype)
    g = torch.Generator().manual_seed(100 + r)
    # unsorted, with repeats; rank 1 asks for nothing (its own count may be zero)
    k = 0 if r == 1 else 3 * rows + r
    idx = torch.randint(0, rows, (k,), generator=g, dtype=torch.int64 if r % 2 == 0 else torch.int32)
    got = wm.gather(t, idx)
    if not torch.equal(got, ref[idx.long()]):
        bad.append(f"gather of {k} rows differs from the reference")
    _sync(kind)  # every rank read before any writes
    # scatter: rank r owns the rows i % n == r; writes them twice (the last value must win)
    mine = torch.arange(r, rows, n)
    mine = mine[torch.randperm(mine.numel(), generator=g)]
    new = -ref[mine] - 1
    twice = torch.cat([mine, mine])
    wm.scatter(t, torch.cat([torch.zeros_like(new), new]), twice)
    _sync(kind)
    want = ref.clone()
    every = torch.arange(rows)
    for q in range(n):
        sel = every[every % n == q]
        want[sel] = -ref[sel] - 1
    all_rows = wm.gather(t, every)
    if not torch.equal(all_rows, want):
        bad.append("table after scatter differs from the reference")
    _sync(kind)
    return bad


CASES = [
    # rows, rest, stride, dtype: a part per rank, trailing empty parts, padded rows, 1-D, int dtypes
    (37, [5], [], "float32"),
    (5, [3], [], "float64"),
    (9, [4], [6, 1], "float16"),
    (11, [], [], "int64"),
    (13, [2, 3], [8, 3, 1], "bfloat16"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_kinds(run, kind, size):
    cases = CASES if size in (2, 4) else CASES[:2]
    kind, env = _kind_env(kind)
    for case in cases:
        bad = [b for bs in run(size, body_kind, kind, *case, timeout=120, env=env) for b in bs]
        assert not bad, (case, bad)


def body_api(ctx):
    import c10d_ext.wholememory as wm

    ctx.init()
    r, n = ctx.rank, ctx.size
    bad = []
    wm.init_lib()
    if wm.WmTensorType.NCCL is not wm.WmTensorType.DISTRIBUTED:
        bad.append("NCCL is not an alias of DISTRIBUTED")
    h = wm.create_wm_tensor(None, [10, 4], [], torch.float32, wm.WmTensorType.HOST)
    if not isinstance(h, torch.Tensor) or h.device.type != "cpu" or not torch.equal(h, torch.zeros(10, 4)):
        bad.append("HOST is not a zero-filled CPU tensor")
    if wm.get_tensor_view(h, "cpu").data_ptr() != h.data_ptr():
        bad.append("the CPU view of a HOST tensor is not its memory")
    if wm.get_wm_tensor_type(h) is not wm.WmTensorType.HOST or not wm.is_wm_tensor(h):
        bad.append("HOST tensor not recognised")
    dist.barrier()  # every rank looked before rank 0 writes
    if r == 0:
        h.fill_(7)
    dist.barrier()
    if not torch.equal(h, torch.full((10, 4), 7.0)):
        bad.append("a write by rank 0 is not seen by the others")
    c = wm.create_wm_tensor(None, shape=[7, 3], dtype=torch.int32, kind=wm.WmTensorType.CHUNKED)
    chunks = c.get_all_chunked_tensor()
    per = -(-7 // n)
    if (c.shape != torch.Size([7, 3]) or c.dtype != torch.int32 or c.stride() != (3, 1) or c.dim() != 2
            or len(chunks) != n or [x.shape[0] for x in chunks] != [min(per, max(0, 7 - i * per)) for i in range(n)]):
        bad.append(f"ChunkedTensor surface: {c}, chunks {[tuple(x.shape) for x in chunks]}")
    chunks[r].fill_(r + 1)  # each rank writes its own chunk, every rank reads every chunk
    dist.barrier()
    for i, x in enumerate(c.chunks):
        if x.numel() and not bool((x == i + 1).all()):
            bad.append(f"chunk {i} as rank {r} sees it: {x.tolist()}")
    d = wm.create_wm_tensor(None, [6], [], torch.float64, wm.WmTensorType.NCCL)
    if not isinstance(d, wm.DistributedTensor) or wm.get_partition_plan(d)[3] != 6 or not isinstance(d.get_ptr(), int):
        bad.append("DISTRIBUTED tensor surface")
    for t in (c, d):
        try:
            wm.get_tensor_view(t, "cpu")
            bad.append(f"{type(t).__name__} gave a single view")
        except ValueError:
            pass
    dist.barrier()
    wm.finalize_lib()
    return bad


@pytest.mark.parametrize("size", [1, 3])
def test_api(run, size):
    bad = [b for bs in run(size, body_api) for b in bs]
    assert not bad, bad


def body_bad_input(ctx, kind):
    """One rank passes bad input: it gets an error naming what is wrong; for the collective kind
    every rank raises (none waits on the others); the tensor and the group work afterwards."""
    import c10d_ext.wholememory as wm

    ctx.init(timeout=30)
    r = ctx.rank
    t = wm.create_wm_tensor(None, [10, 2], [], torch.float32, getattr(wm.WmTensorType, kind))
    _fill_own_part(wm, t, 10, (2,), torch.float32)
    _sync(kind)
    errors = []
    row4 = _reference(10, (2,), torch.float32)[4:5]  # what row 4 holds already: a valid write changes nothing
    cases = [
        ("gather", lambda: wm.gather(t, torch.tensor([1, 10, 3]) if r == 0 else torch.tensor([2]))),
        ("gather", lambda: wm.gather(t, torch.tensor([-1]) if r == 0 else torch.tensor([2]))),
        ("gather", lambda: wm.gather(t, torch.tensor([1.0]) if r == 0 else torch.tensor([2]))),
        ("scatter", lambda: wm.scatter(t, torch.zeros(2, 3) if r == 0 else row4, torch.tensor([0, 1]) if r == 0 else torch.tensor([4]))),
        ("scatter", lambda: wm.scatter(t, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]))),
    ]
    for op, fn in cases:
        try:
            fn()
            errors.append(None)
        except (ValueError, TypeError, IndexError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    _sync(kind)
    ok = torch.equal(wm.gather(t, torch.arange(10)), _reference(10, (2,), torch.float32))
    return errors, ok


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input(run, kind):
    kind, env = _kind_env(kind)
    results = run(2, body_bad_input, kind, timeout=90, env=env)
    (e0, ok0), (e1, ok1) = results
    assert "index 10 (position 1) is out of range for a whole-memory tensor of 10 rows" in e0[0] and "rank 0" in e0[0]
    assert "index -1 (position 0)" in e0[1]
    assert "int32 or int64, got torch.float32" in e0[2]
    assert "values have shape [2, 3], expected [2, 2]" in e0[3]
    assert "values are torch.int32, the tensor is torch.float32" in e0[4] and "rank 0" in e0[4]
    assert "values are torch.int32" in e1[4] and "rank 1" in e1[4]
    if kind == "DISTRIBUTED":  # the peer of a bad rank raises too, naming it
        for msg in e1[:4]:
            assert msg is not None and "rank 0 passed bad input" in msg and "(rank 1)" in msg, e1
    else:  # mapped kinds: a local error, the peer's op went through
        assert e1[:4] == [None, None, None, None], e1
    assert ok0 and ok1


def body_create_errors(ctx):
    import c10d_ext.wholememory as wm

    ctx.init(timeout=30)
    out = []
    for args in ([None, [0, 3], [], torch.float32, wm.WmTensorType.HOST],
                 [None, [4, 3], [2, 1], torch.float32, wm.WmTensorType.HOST],
                 [None, [4, 3], [3, 2], torch.float32, wm.WmTensorType.HOST],
                 [None, [4, 3], [], torch.complex64, wm.WmTensorType.HOST],
                 [None, [4, 3], [], torch.float32, 9],
                 [None, [4, 3 + ctx.rank], [], torch.float32, wm.WmTensorType.DISTRIBUTED],
                 [None, [4, 3], [], torch.float32, wm.WmTensorType.DEVICE]):
        try:
            wm.create_wm_tensor(*args)
            out.append(None)
        except (ValueError, NotImplementedError) as e:
            out.append(str(e))
    t = wm.create_wm_tensor(None, [4, 3], [], torch.float32, wm.WmTensorType.DISTRIBUTED)  # still works
    out.append(tuple(wm.gather(t, torch.tensor([3])).shape))
    return out


def test_create_errors(run):
    res = run(2, body_create_errors, timeout=60)
    for rank, out in enumerate(res):
        assert f"(rank {rank}): dimension 0 of shape [0, 3] is 0" in out[0]
        assert "stride [2, 1] overlaps rows of shape [4, 3]" in out[1]
        assert "the last stride must be 1" in out[2]
        assert "dtype torch.complex64 is not supported" in out[3]
        assert out[4] == "Invalid wm_tensor_type"
        assert "ranks disagree on the shape" in out[5] and f"rank {1 - rank} for" in out[5]
        assert "a DEVICE tensor lives in CUDA memory and " in out[6], out[6]  # no CUDA device here
        assert out[7] == (1, 3)


def body_files(ctx, save_kind, load_kind, tmp):
    import c10d_ext.wholememory as wm

    ctx.init(timeout=60)
    prefix = os.path.join(tmp, "emb")
    rows, rest = 23, (3,)
    src = wm.create_wm_tensor(None, [rows, 3], [5, 1], torch.float32, getattr(wm.WmTensorType, save_kind))
    _fill_own_part(wm, src, rows, rest, torch.float32)
    _sync(save_kind)
    wm.save_to_files(src, prefix)
    files = sorted(glob.glob(prefix + "_part_*"))
    dst = wm.create_wm_tensor(None, [rows, 3], [], torch.float32, getattr(wm.WmTensorType, load_kind))
    wm.load_from_files(dst, prefix)
    _sync(load_kind)
    got = wm.gather(dst, torch.arange(rows))
    err = None
    try:
        wm.load_from_files(dst, os.path.join(tmp, "missing"))
    except FileNotFoundError as e:
        err = str(e)
    return [os.path.basename(f) for f in files], torch.equal(got, _reference(rows, rest, torch.float32)), err


@pytest.mark.parametrize("save_kind,load_kind", [("DISTRIBUTED", "HOST"), ("HOST", "CHUNKED"), ("CHUNKED", "DISTRIBUTED")])
def test_files(run, save_kind, load_kind):
    with tempfile.TemporaryDirectory() as tmp:
        res = run(3, body_files, save_kind, load_kind, tmp, timeout=90)
        sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in res[0][0]}
    assert res[0][0] == [f"emb_part_{i}_of_3" for i in range(3)]
    assert sum(sizes.values()) == 23 * 3 * 4  # padding is not written
    for files, equal, err in res:
        assert equal
        assert err is not None and "no single complete file set" in err


def body_kill(ctx, kind):
    """Rank 1 dies by SIGKILL holding whole-memory tensors; with DISTRIBUTED, during a gather."""
    import c10d_ext.wholememory as wm

    ctx.init(timeout=10)
    t = wm.create_wm_tensor(None, [64, 8], [], torch.float32, getattr(wm.WmTensorType, kind))
    pids = [None] * ctx.size
    dist.all_gather_object(pids, os.getpid())
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "DISTRIBUTED":
        try:
            wm.gather(t, torch.arange(64))
            return pids, "no error"
        except Exception as e:  # noqa: BLE001
            return pids, f"{type(e).__name__}: {e}"
    return pids, None


@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_leaves_nothing(run, kind):
    kind, env = _kind_env(kind)
    res = run(2, body_kill, kind, timeout=90, expect_dead=(1,), env=env)
    pids, err = res[0]
    if kind == "DISTRIBUTED":
        assert err and err != "no error", err
    assert not [p for p in glob.glob("/dev/shm/myccl-*") if p.split("-")[1] in {str(x) for x in pids}]


@pytest.mark.parametrize("nproc,kind", [(2, "DISTRIBUTED"), (4, "DISTRIBUTED"), (2, "HOST"), (4, "CHUNKED")])
def test_embedding_example_matches_one_process(nproc, kind):
    """examples/embedding_train.py: the table trained through gather / scatter over the ranks ends
    equal to the same training in one process (the example checks and exits 1 otherwise)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "examples", "embedding_train.py"), "--kind", kind, "--steps", "25"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "-> EQUAL" in p.stdout, p.stdout


def body_distributed_cuda(ctx, mode):
    """DISTRIBUTED parts on CUDA: the exchanges go over myccl's NCCL engine (on a GPU, or on the
    strict double, where CPU tensors stand for CUDA tensors and every myccl op runs the engine)."""
    import c10d_ext.wholememory as wm

    if mode == "gpu":
        torch.cuda.set_device(0)
    ctx.init(timeout=60)
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % 2)
        before = cuda_double.counters().get("sends", 0)
    r, n = ctx.rank, ctx.size
    rows, dim = 29, 4
    dev = torch.device("cuda", 0) if mode == "gpu" else torch.device("cpu")
    t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED,
                            device="cuda" if mode == "gpu" else None)
    bad = [] if t.device == dev else [f"parts on {t.device}"]
    ref = _reference(rows, (dim,), torch.float32).to(dev)
    part, first = wm.local_partition(t)
    part.copy_(ref[first:first + part.shape[0]])
    idx = torch.randint(0, rows, (40 + 7 * r,), generator=torch.Generator().manual_seed(r)).to(dev)
    if not torch.equal(wm.gather(t, idx), ref[idx]):
        bad.append("gather")
    mine = torch.arange(r, rows, n, device=dev)
    wm.scatter(t, -ref[mine], mine)
    if not torch.equal(wm.gather(t, torch.arange(rows, device=dev)), -ref):
        bad.append("scatter")
    try:
        wm.gather(t, torch.tensor([rows + r], device=dev))
        bad.append("an out-of-range index on a CUDA table was not refused")
    except IndexError:
        pass
    ran = violations = None
    if mode == "double":
        ran = cuda_double.counters().get("sends", 0) - before
        violations = cuda_double.violations()
    return bad, ran, violations


@pytest.mark.parametrize("mode", [pytest.param("double", id="double"),
                                  pytest.param("gpu", id="gpu", marks=pytest.mark.cuda)])
def test_distributed_on_cuda(run, mode):

    res = run(2, body_distributed_cuda, mode, world_env=WORLD[mode], timeout=120,
              env=EXCHANGE)  # on the double, CPU tensors stand for CUDA ones: no direct path there
    for bad, ran, violations in res:
        assert not bad, bad
        if mode == "double":
            assert ran >= 9 and not violations, (ran, violations)  # all_to_all: NCCL sends on the engine


def body_large_gather(ctx, kind):
    """Gathers large enough that the exchange moves its rows in pieces (access.PIECES_FROM) and
    that the result goes in huge-page memory (access.HUGE_FROM)."""
    import c10d_ext.wholememory as wm
    from c10d_ext.wholememory import access

    ctx.init()
    r = ctx.rank
    rows, dim = 3001, 64
    t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, getattr(wm.WmTensorType, kind))
    ref = _reference(rows, (dim,), torch.float32)
    part, first = wm.local_partition(t)
    part.copy_(ref[first:first + part.shape[0]])
    _sync(kind)
    n_idx = max(access.PIECES_FROM, access.HUGE_FROM) // (dim * 4) * 2 + 7 * r + 1  # uneven per peer
    idx = torch.randint(0, rows, (n_idx,), generator=torch.Generator().manual_seed(r))
    got = wm.gather(t, idx)
    _sync(kind)
    return torch.equal(got, ref[idx]) and got.is_contiguous()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [2, 3])
def test_large_gather(run, size, kind):
    kind, env = _kind_env(kind)
    assert all(run(size, body_large_gather, kind, env=env, timeout=120))
