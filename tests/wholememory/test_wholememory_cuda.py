"""c10d_ext.wholememory in CUDA memory: DEVICE, CHUNKED on CUDA devices and a HOST tensor's CUDA
view, at 1-4 ranks, values against a local reference. Each test runs on the strict CUDA double
(CPU tensors standing for CUDA ones, "device memory" in memfd files passed between the processes
as CUDA's exported handles are) and, marked gpu, on a real GPU shared by the ranks (make gpu-check)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import MODES, WORLD, counters
from wm_helpers import _reference


def _start(ctx, mode):
    """Selects this rank's device (the double: devices alternate; a GPU: the one all ranks share)."""
    if mode == "gpu":
        torch.cuda.set_device(0)
    ctx.init(timeout=60)
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % 2)
        return ctx.rank % 2, torch.device("cpu")  # the double's CUDA tensors are CPU tensors
    return 0, torch.device("cuda", 0)


def _quiesce() -> None:
    """Waits until memory given up so far is released (it is, off the dropping thread, after a
    device synchronisation)."""
    from c10d_ext import _C

    _C._cuda_memory_quiesce()


def _memory_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "myccl-double-cuda" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def _fence(dev):
    """Every rank's writes are done and visible before any rank reads on: on a GPU the kernels
    must have finished (a barrier orders the hosts, not the streams)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _exercise(wm, t, rows, dim, r, n, dev, bad, what):
    """Fill by partitions, gather, scatter (repeats: the last wins), gather all; each against the reference."""
    ref = _reference(rows, (dim,), torch.float32).to(dev)
    part, first = wm.local_partition(t)
    part.copy_(ref[first:first + part.shape[0]])
    _fence(dev)
    idx = torch.randint(0, rows, (3 * rows + r,), generator=torch.Generator().manual_seed(r)).to(dev)
    if not torch.equal(wm.gather(t, idx), ref[idx]):
        bad.append(f"{what}: gather")
    _fence(dev)
    mine = torch.arange(r, rows, n, device=dev)
    wm.scatter(t, torch.cat([torch.zeros_like(ref[mine]), -ref[mine]]), torch.cat([mine, mine]))
    _fence(dev)
    if not torch.equal(wm.gather(t, torch.arange(rows, device=dev)), -ref):
        bad.append(f"{what}: scatter")
    try:
        wm.gather(t, torch.tensor([rows + r], device=dev))
        bad.append(f"{what}: an out-of-range index was not refused")
    except IndexError as e:
        if f"(rank {r})" not in str(e) or f"index {rows + r}" not in str(e):
            bad.append(f"{what}: {e}")
    _fence(dev)


def body_device(ctx, mode, rows, dim):
    import gc

    import c10d_ext.wholememory as wm

    device, dev = _start(ctx, mode)
    r, n = ctx.rank, ctx.size
    fds = _memory_fds()
    before = counters(mode)
    t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DEVICE)
    bad = []
    if not isinstance(t, torch.Tensor) or t.device != dev or not t.is_contiguous() or tuple(t.shape) != (rows, dim):
        bad.append(f"not one contiguous tensor on {dev}: {type(t).__name__} {getattr(t, 'device', None)}")
    if wm.get_wm_tensor_type(t) is not wm.WmTensorType.DEVICE or not wm.is_wm_tensor(t):
        bad.append("type")
    _exercise(wm, t, rows, dim, r, n, dev, bad, "DEVICE")
    # another local device's view of the same memory (the double: the other device; a GPU: its own)
    other = (device + 1) % 2 if mode == "double" else 0
    view = wm.get_tensor_view(t, f"cuda:{other}")
    if not torch.equal(view.cpu(), t.cpu()):
        bad.append("the view from another device differs")
    del view
    if not wm.is_wm_tensor(t):  # a view at the same address went: the tensor is still known
        bad.append("the tensor was forgotten when a view of it went")
    try:
        wm.get_tensor_view(t, "cpu")
        bad.append("a CPU view of DEVICE memory was given")
    except ValueError:
        pass
    mapped = counters(mode).get("mem_mapped", 0) - before.get("mem_mapped", 0)
    del t
    gc.collect()
    _quiesce()
    dist.barrier()
    after = counters(mode)
    left = {k: after.get(k, 0) - before.get(k, 0) for k in ("mem_mapped", "mem_handles")}
    return bad, mapped, left, _memory_fds() - fds, (counters(mode).get("violations", 0) if mode == "double" else 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_device_on_double(run, n):
    # 1000 x 700 floats: 2.8 MB, two granules of the double's 2 MiB, so at 3-4 ranks some hold none
    res = run(n, body_device, "double", 1000, 700, world_env=WORLD["double"], timeout=120)
    for bad, mapped, left, fds, violations in res:
        assert not bad, bad
        assert mapped == min(n, 2), mapped  # every rank maps every rank's pages (and ranks with none add none)
        assert left == {"mem_mapped": 0, "mem_handles": 0}, left  # freed once dropped everywhere
        assert fds == 0 and violations == 0, (fds, violations)


@pytest.mark.cuda
def test_device_on_gpu(run):
    res = run(2, body_device, "gpu", 1000, 700, world_env=WORLD["gpu"], timeout=120)
    for bad, *_ in res:
        assert not bad, bad


def body_chunked(ctx, mode):
    import c10d_ext.wholememory as wm

    _, dev = _start(ctx, mode)
    r, n = ctx.rank, ctx.size
    rows, dim = 37, 5
    t = wm.create_wm_tensor(None, [rows, dim], [8, 1], torch.float32, wm.WmTensorType.CHUNKED)
    bad = []
    chunks = t.get_all_chunked_tensor()
    if len(chunks) != n or any(c.device != dev for c in chunks) or t.device != dev:
        bad.append(f"chunks: {len(chunks)} on {[str(c.device) for c in chunks]}")
    _exercise(wm, t, rows, dim, r, n, dev, bad, "CHUNKED")
    # every rank sees every chunk: the last chunk as the last rank wrote it
    first, count = t._meta.parts[-1]
    if count and not torch.equal(chunks[-1], -_reference(rows, (dim,), torch.float32)[first:].to(dev)):
        bad.append("the last chunk read directly differs")
    return bad, counters(mode).get("mem_mapped", 0), counters(mode).get("violations", 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [2, 3])
def test_chunked_on_cuda(run, mode, n):
    if mode == "gpu" and n != 2:
        pytest.skip("one GPU: two ranks share it")
    res = run(n, body_chunked, mode, world_env=WORLD[mode], timeout=120)
    for bad, mapped, violations in res:
        assert not bad, bad
        if mode == "double":
            assert mapped == n and violations == 0, (mapped, violations)  # one mapping per chunk


def body_host_view(ctx, mode):
    import gc

    import c10d_ext.wholememory as wm

    device, dev = _start(ctx, mode)
    r, n = ctx.rank, ctx.size
    rows, dim = 21, 3
    before = counters(mode).get("host_registered", 0)
    t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.HOST)
    bad = []
    if t.device != dev:
        bad.append(f"HOST tensor on {t.device}, expected the device's view on {dev}")
    registered = counters(mode).get("host_registered", 0) - before
    host = wm.get_tensor_view(t, "cpu")
    if host.device.type != "cpu" or not wm.is_wm_tensor(host) or wm.get_tensor_view(t, "cuda") is not t:
        bad.append("views")
    _exercise(wm, t, rows, dim, r, n, dev, bad, "HOST view")
    _fence(dev)
    if not torch.equal(host, -_reference(rows, (dim,), torch.float32)):
        bad.append("the host copy does not hold what the device view wrote")
    explicit = wm.create_wm_tensor(None, [4, 2], [], torch.int64, wm.WmTensorType.HOST, device="cpu")
    if explicit.device.type != "cpu" or counters(mode).get("host_registered", 0) - before != registered:
        bad.append("device='cpu' still made a device view")
    del t, host, explicit
    gc.collect()
    _quiesce()
    left = counters(mode).get("host_registered", 0) - before
    return bad, registered, left


@pytest.mark.parametrize("mode", MODES)
def test_host_cuda_view(run, mode):
    res = run(2, body_host_view, mode, world_env=WORLD[mode], timeout=120)
    for bad, registered, left in res:
        assert not bad, bad
        if mode == "double":
            assert (registered, left) == (1, 0), (registered, left)


def body_device_errors(ctx, double):
    import c10d_ext.wholememory as wm

    ctx.init(timeout=30)
    out = []
    for kind in ("DEVICE", "CHUNKED"):
        # on the double, rank 1 asks for host memory, rank 0 for its device's
        device = "cpu" if double and ctx.rank == 1 else None
        try:
            wm.create_wm_tensor(None, [8, 2], [], torch.float32, getattr(wm.WmTensorType, kind), device=device)
            out.append(None)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            out.append(str(e))
    t = wm.create_wm_tensor(None, [4, 3], [], torch.float32, wm.WmTensorType.DISTRIBUTED)  # still works
    out.append(tuple(wm.gather(t, torch.tensor([3])).shape))
    return out


def test_device_placement_errors_on_every_rank(run):
    """A rank that cannot place a DEVICE tensor on a CUDA device fails it on every rank (the
    others name it); CHUNKED, where the ranks disagree on host or CUDA memory, too; the group
    goes on."""
    res = run(2, body_device_errors, True, world_env=WORLD["double"], timeout=90)
    assert "a DEVICE tensor lives in CUDA memory; device='cpu' is not a CUDA device" in res[1][0], res[1]
    assert "rank 1 cannot place this tensor" in res[0][0] and "(rank 0)" in res[0][0], res[0]
    for out in res:
        assert "ranks disagree on the memory (host or CUDA device)" in out[1], out
        assert out[2] == (1, 3)


def test_device_without_cuda(run):
    res = run(2, body_device_errors, False, timeout=90)
    for rank, out in enumerate(res):
        assert f"(rank {rank})" in out[0] and "CUDA" in out[0], out
        assert out[1] is None and out[2] == (1, 3), out  # CHUNKED in host memory, as before


def body_kill(ctx):
    """Rank 1 dies by SIGKILL holding DEVICE, CHUNKED and HOST-view tensors; the others drop their
    own and nothing is left: no mapping, no handle, no descriptor, nothing in /dev/shm. (A dead
    peer during a later collective is the CUDA engine's watchdog's: tests/cuda/test_cuda.py.)"""
    import gc
    import glob
    import signal

    import c10d_ext.wholememory as wm

    _start(ctx, "double")
    kinds = (wm.WmTensorType.DEVICE, wm.WmTensorType.CHUNKED, wm.WmTensorType.HOST)
    held = [wm.create_wm_tensor(None, [600, 1000], [], torch.float32, k) for k in kinds]
    mapped = (counters("double").get("mem_mapped", 0), _memory_fds())
    pids = [None] * ctx.size
    dist.all_gather_object(pids, str(os.getpid()))
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    del held
    gc.collect()
    _quiesce()
    c = counters("double")
    left = (c.get("mem_mapped", 0), c.get("mem_handles", 0), c.get("host_registered", 0), _memory_fds())
    return mapped, left, [p for p in glob.glob("/dev/shm/myccl-*") if p.split("-")[1] in pids]


def test_sigkill_leaves_nothing_mapped(run):
    res = run(3, body_kill, world_env=WORLD["double"], timeout=120, expect_dead=(1,))
    for rank in (0, 2):
        mapped, left, shm = res[rank]
        assert mapped[0] >= 4 and mapped[1] >= 2, mapped  # DEVICE's two granules + CHUNKED's three chunks
        assert left == (0, 0, 0, 0), left
    assert not res[0][2] and not res[2][2], (res[0][2], res[2][2])
