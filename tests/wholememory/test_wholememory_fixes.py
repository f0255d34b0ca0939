"""c10d_ext.wholememory's guarantees that the kind tests do not reach (its modules' one-way imports:
tests/project/test_import_graph.py, for the whole package): the descriptor exchange at any number of local ranks, zero-filled memory, the
consistency of DISTRIBUTED gathers read in place, releases and registrations of CUDA memory, and
agreement at creation. CUDA paths run on the strict CUDA double (tests/cuda_double.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import DOUBLE, SHARED_GPU
def _swap_in_threads(n: int, timeout: float, silent: tuple = ()):
    """n mailboxes in this process, one thread each (the protocol is the processes' one: abstract
    sockets, SCM_RIGHTS); each sends a memfd holding its index. ``silent`` ones bind but never
    swap. Returns per index: the (content of each received descriptor, bytes) or the exception."""
    import secrets
    import threading

    from c10d_ext.wholememory.descriptors import Mailbox

    token = secrets.token_hex(8)
    names = [f"\0myccl-wm-test-{token}-{i}" for i in range(n)]
    boxes = [Mailbox(names, i) for i in range(n)]
    out = [None] * n

    def one(i):
        fd = os.memfd_create(f"wm-test-{i}")
        os.write(fd, bytes([i]))
        try:
            got = boxes[i].swap(fd, 1000 + i, timeout)
            seen = []
            for f, b in got:
                seen.append((None if f < 0 else os.pread(f, 1, 0)[0], b))
                if f >= 0:
                    os.close(f)
            out[i] = seen
        except Exception as e:  # noqa: BLE001
            out[i] = e
        finally:
            os.close(fd)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n) if i not in silent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    hung = [t for t in threads if t.is_alive()]
    for b in boxes:
        b.close()
    assert not hung, f"{len(hung)} of {n} mailboxes still exchanging"
    return out


@pytest.mark.parametrize("n", [2, 13, 40])
def test_descriptor_exchange_any_rank_count(n):
    """Every rank sends every other its descriptor: more ranks than a datagram queue holds
    (net.unix.max_dgram_qlen, 10 by default) must not block (a send-everything-first protocol
    deadlocks there: every queue full, every rank in a send)."""
    out = _swap_in_threads(n, timeout=60)
    for i, seen in enumerate(out):
        assert not isinstance(seen, Exception), (i, seen)
        want = [(None if j == i else j, 1000 + j) for j in range(n)]
        assert seen == want, (i, seen)
    assert not [f for f in os.listdir("/proc/self/fd") if "wm-test" in os.path.realpath(f"/proc/self/fd/{f}")]


def test_descriptor_exchange_names_the_missing():
    """A peer that never sends: the others give up at the timeout naming it, holding nothing."""
    from c10d_ext.wholememory.descriptors import MissingPeers

    out = _swap_in_threads(4, timeout=2, silent=(2,))
    for i in (0, 1, 3):
        assert isinstance(out[i], MissingPeers) and out[i].missing == [2], out[i]


def _double_start(ctx, timeout=60):
    """On the double: this rank's device (devices alternate), CPU tensors standing for CUDA ones."""
    import cuda_double

    ctx.init(timeout=timeout)
    cuda_double.set_device(ctx.rank % 2)
    return ctx.rank % 2


def body_many_ranks(ctx):
    import c10d_ext.wholememory as wm

    _double_start(ctx)
    r, n = ctx.rank, ctx.size
    out = []
    for kind in (wm.WmTensorType.DEVICE, wm.WmTensorType.CHUNKED):
        t = wm.create_wm_tensor(None, [n * 4, 3], [], torch.int64, kind)
        part, first = wm.local_partition(t)
        part.copy_(torch.arange(first, first + part.shape[0]).unsqueeze(1).expand(-1, 3))
        dist.barrier()
        out.append(torch.equal(wm.gather(t, torch.arange(n * 4)), torch.arange(n * 4).unsqueeze(1).expand(-1, 3)))
        dist.barrier()
        del t, part
    return out


@pytest.mark.slow
def test_cuda_kinds_at_13_ranks(run):
    """DEVICE and CUDA CHUNKED made by 13 local ranks (more than a datagram queue holds), values read back."""
    for out in run(13, body_many_ranks, world_env=DOUBLE, timeout=300):
        assert out == [True, True], out


def body_export_fails(ctx, kind_name):
    """Rank 1's export of its memory handle fails: every rank raises (rank 1 its own error, the
    others naming it), nothing stays allocated, and the next creation works."""
    import gc

    import cuda_double

    import c10d_ext.wholememory as wm
    from c10d_ext import _C

    _double_start(ctx, timeout=30)
    kind = getattr(wm.WmTensorType, kind_name)
    before = cuda_double.counters().get("mem_handles", 0)
    original = _C._SharedRegion.export_fd

    def broken(self):
        raise RuntimeError("cuMemExportToShareableHandle failed: out of file descriptors (injected)")

    if ctx.rank == 1:
        _C._SharedRegion.export_fd = broken
    try:
        wm.create_wm_tensor(None, [64, 4], [], torch.float32, kind)
        error = None
    except RuntimeError as e:
        error = str(e)
    finally:
        _C._SharedRegion.export_fd = original
    gc.collect()
    _C._cuda_memory_quiesce()
    left = cuda_double.counters().get("mem_handles", 0) - before
    t = wm.create_wm_tensor(None, [64, 4], [], torch.float32, kind)
    ok = torch.equal(wm.gather(t, torch.tensor([0, 63])), torch.zeros(2, 4))
    return error, left, ok


@pytest.mark.parametrize("kind", ["DEVICE", "CHUNKED"])
def test_failed_export_fails_every_rank(run, kind):
    res = run(3, body_export_fails, kind, world_env=DOUBLE, timeout=120)
    for rank, (error, left, ok) in enumerate(res):
        assert error is not None and f"(rank {rank})" in error, (rank, error)
        if rank == 1:
            assert "out of file descriptors (injected)" in error, error
        else:
            assert "rank 1 could not make or export its device memory" in error, error
        assert left == 0 and ok, (rank, left, ok)


def body_distributed_disagree(ctx):
    """A DISTRIBUTED tensor whose ranks differ in MYCCL_WM_DIRECT, then in where the parts go: each
    a clear error on every rank (not a gather that runs two protocols at once), and the group
    goes on."""
    import c10d_ext.wholememory as wm

    ctx.init(timeout=30)
    out = []
    saved = os.environ.get("MYCCL_WM_DIRECT")
    os.environ["MYCCL_WM_DIRECT"] = "0" if ctx.rank == 1 else "1"
    try:
        wm.create_wm_tensor(None, [8, 2], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    finally:
        if saved is None:
            os.environ.pop("MYCCL_WM_DIRECT", None)
        else:
            os.environ["MYCCL_WM_DIRECT"] = saved
    device = "cuda" if ctx.rank == 1 else "cpu"
    try:
        wm.create_wm_tensor(None, [8, 2], [], torch.float32, wm.WmTensorType.DISTRIBUTED, device=device)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    t = wm.create_wm_tensor(None, [8, 2], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
    out.append(tuple(wm.gather(t, torch.tensor([7, 0])).shape))
    return out


def test_distributed_creation_agrees_on_direct_and_device(run):
    res = run(3, body_distributed_disagree, timeout=90)
    for rank, (direct, device, shape) in enumerate(res):
        assert direct is not None and f"(rank {rank})" in direct, direct
        assert "ranks disagree on the MYCCL_WM_DIRECT setting" in direct, direct
        assert ("this rank asked for MYCCL_WM_DIRECT=0" in direct) == (rank == 1), direct
        assert device is not None and f"(rank {rank})" in device, device
        if torch.cuda.is_available():  # rank 1's parts on its GPU, the others' in host memory
            assert "ranks disagree on the memory (host or CUDA device)" in device, device
        elif rank == 1:
            assert "no CUDA device is available" in device, device
        else:
            assert "rank 1 cannot place this tensor" in device, device
        assert shape == (2, 2), shape


def body_direct_gather_then_write(ctx, wait_s):
    """DISTRIBUTED on one host, its parts read in place. Rank 0 gathers every row; the others
    gather none and, the moment their gather returns, overwrite their own part. Rank 0's row
    reads are held until another rank says it wrote (or ``wait_s`` passed): a gather that let
    ranks return while others still read would hand rank 0 the new values."""
    from datetime import timedelta

    import c10d_ext.wholememory as wm
    from c10d_ext import _C

    ctx.init(timeout=60)
    r, n = ctx.rank, ctx.size
    rows = 8 * n
    store = ctx.store("written")
    t = wm.create_wm_tensor(None, [rows, 3], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
    if t._peers is None:
        return "not the direct path"
    part, first = wm.local_partition(t)
    part.copy_(torch.arange(first, first + part.shape[0], dtype=torch.float32).unsqueeze(1).expand(-1, 3))
    original = _C._wm_gather_rows

    def held(*args):
        store.set_timeout(timedelta(seconds=wait_s))
        try:
            store.wait(["1"])
        except Exception:  # noqa: BLE001 (no rank wrote while this one reads: the consistent case)
            pass
        return original(*args)

    if r == 0:
        _C._wm_gather_rows = held
    try:
        got = wm.gather(t, torch.arange(rows) if r == 0 else torch.empty(0, dtype=torch.int64))
    finally:
        _C._wm_gather_rows = original
    if r != 0:
        wm.get_local_tensor(t).fill_(-1)
        store.set(str(r), "done")
    dist.barrier()
    if r == 0:
        want = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(-1, 3)
        return None if torch.equal(got, want) else f"rank 0 read rows written after its gather began: {got[:, 0].tolist()}"
    return None


def test_direct_gather_is_read_before_any_rank_returns(run):
    """The promise (docs/WHOLEMEMORY.md): a gather returns the rows as every rank's earlier writes
    left them, and a rank whose gather returned may write its own part at once."""
    for res in run(3, body_direct_gather_then_write, 2, timeout=120):
        assert res is None, res


def body_scratch_bounded(ctx, keep):
    """Exchange gathers and scatters far larger than the staging a tensor keeps: values right,
    and what stays with the tensor afterwards within the bound; a small call then reuses it."""
    import c10d_ext.wholememory as wm
    from c10d_ext.wholememory import access

    ctx.init(timeout=60)
    r, n = ctx.rank, ctx.size
    rows, dim = 64, 16
    saved = getattr(access, "SCRATCH_KEEP", None)
    access.SCRATCH_KEEP = keep
    try:
        t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
        ref = torch.arange(rows * dim, dtype=torch.float32).view(rows, dim)
        part, first = wm.local_partition(t)
        part.copy_(ref[first:first + part.shape[0]])
        bad = []
        idx = torch.arange(rows).repeat(8)  # 512 rows of 64 bytes each way: 32 KiB of staging
        if not torch.equal(wm.gather(t, idx), ref[idx]):
            bad.append("large gather")
        mine = torch.arange(r, rows, n)
        wm.scatter(t, -ref[mine].repeat(8, 1), mine.repeat(8))
        if not torch.equal(wm.gather(t, torch.arange(rows)), -ref):
            bad.append("large scatter")
        kept = {k: v.numel() * v.element_size() for k, v in t._scratch.items()}
        if sum(kept.values()) > 2 * keep:
            bad.append(f"staging kept after large calls: {kept}")
        if not torch.equal(wm.gather(t, torch.tensor([1, r])), -ref[[1, r]]):
            bad.append("small gather")
        small = {k: v.numel() * v.element_size() for k, v in t._scratch.items()}
        if not small or sum(small.values()) > 2 * keep:
            bad.append(f"staging after a small call: {small}")
        return bad
    finally:
        access.SCRATCH_KEEP = saved


def test_scratch_is_bounded(run):
    for bad in run(2, body_scratch_bounded, 2048, env={"MYCCL_WM_DIRECT": "0"}, timeout=90):
        assert not bad, bad


def body_zero_filled(ctx):
    """Every kind starts zero-filled, CUDA memory included (the double's fresh device memory
    holds 0xA5 bytes, as real fresh memory holds whatever was there)."""
    import c10d_ext.wholememory as wm

    _double_start(ctx)
    K = wm.WmTensorType
    not_zero = []
    for kind, shape, stride, device in ((K.DEVICE, [1000, 700], [], None), (K.CHUNKED, [37, 5], [8, 1], None),
                                        (K.HOST, [21, 3], [], None), (K.CHUNKED, [37, 5], [], "cpu"),
                                        (K.DISTRIBUTED, [37, 5], [], None)):
        t = wm.create_wm_tensor(None, shape, stride, torch.float32, kind, device=device)
        whole = t.get_all_chunked_tensor() if kind is K.CHUNKED else [wm.get_local_tensor(t)]
        if kind in (K.DEVICE, K.HOST):
            whole = [t]
        if any(x.count_nonzero().item() for x in whole):
            not_zero.append(f"{kind.name} on {device or 'the default device'}")
        dist.barrier()
        del t, whole
    return not_zero


def test_every_kind_is_zero_filled(run):
    for not_zero in run(3, body_zero_filled, world_env=DOUBLE, timeout=120):
        assert not not_zero, not_zero


def body_release_syncs_every_device(ctx):
    """A DEVICE tensor made on this rank's device and viewed from the other one: when it goes,
    both devices are synchronised before its memory is unmapped (kernels on either may still use
    it), not the making device alone."""
    import gc

    import cuda_double

    import c10d_ext.wholememory as wm
    from c10d_ext import _C

    device = _double_start(ctx)
    other = 1 - device
    t = wm.create_wm_tensor(None, [1000, 700], [], torch.float32, wm.WmTensorType.DEVICE)
    view = wm.get_tensor_view(t, f"cuda:{other}")
    before = cuda_double.counters()
    del t, view
    gc.collect()
    _C._cuda_memory_quiesce()
    after = cuda_double.counters()
    dist.barrier()
    return {d: after.get(f"mem_synchronize_cuda{d}", 0) - before.get(f"mem_synchronize_cuda{d}", 0)
            for d in (device, other)}, after.get("mem_mapped", 0)


def test_release_synchronises_every_device_given_access(run):
    for synced, mapped in run(2, body_release_syncs_every_device, world_env=DOUBLE, timeout=90):
        assert all(v >= 1 for v in synced.values()), synced
        assert mapped == 0, mapped


def body_host_view_again(ctx):
    """A HOST tensor's CUDA view goes, and a new one is made while the old registration's release
    still waits on the releaser (held there): the new view takes the registration back instead
    of registering the range a second time (CUDA: already registered). The release that then runs
    leaves the live view's registration alone; the last view's release unregisters it."""
    import gc

    import cuda_double

    import c10d_ext.wholememory as wm
    from c10d_ext import _C

    _double_start(ctx)
    cuda_double.clear_violations()
    before = cuda_double.counters().get("host_registered", 0)
    t = wm.create_wm_tensor(None, [21, 3], [], torch.float32, wm.WmTensorType.HOST)
    host = wm.get_tensor_view(t, "cpu")
    bad = []
    cuda_double.hold_memory_releases(True)
    try:
        del t
        gc.collect()
        try:
            again = wm.get_tensor_view(host, "cuda")
            again.fill_(ctx.rank + 1.0)
        except RuntimeError as e:
            bad.append(f"a new view while the old one's release waited: {e}")
            again = None
    finally:
        cuda_double.hold_memory_releases(False)
    _C._cuda_memory_quiesce()
    registered = cuda_double.counters().get("host_registered", 0) - before
    if again is not None and registered != 1:
        bad.append(f"{registered} registrations while a view lives")
    if again is not None and not torch.equal(again, host):
        bad.append("the new view and the host copy differ")
    del again
    gc.collect()
    _C._cuda_memory_quiesce()
    left = cuda_double.counters().get("host_registered", 0) - before
    dist.barrier()
    return bad, left, cuda_double.violations()


def test_host_view_made_again_during_its_release(run):
    for bad, left, violations in run(2, body_host_view_again, world_env=DOUBLE, timeout=90):
        assert not bad and not violations, (bad, violations)
        assert left == 0, left


def body_keeps_current_device(ctx, mode):
    """Tensors made, and views taken, on the other device leave this process's current device as
    it was (on a GPU, torch's; on the double, the simulated thread's)."""
    import gc

    import c10d_ext.wholememory as wm
    from c10d_ext import _C

    if mode == "gpu":
        torch.cuda.set_device(0)
        ctx.init(timeout=60)
        mine, other, current = 0, 1, torch.cuda.current_device
    else:
        import cuda_double

        mine = _double_start(ctx)
        other, current = 1 - mine, cuda_double.current_device
    K = wm.WmTensorType
    moved = []
    held = []
    for what, make in (("DEVICE", lambda: wm.create_wm_tensor(None, [64, 8], [], torch.float32, K.DEVICE,
                                                              device=f"cuda:{other}")),
                       ("CHUNKED", lambda: wm.create_wm_tensor(None, [64, 8], [], torch.float32, K.CHUNKED,
                                                               device=f"cuda:{other}")),
                       ("HOST view", lambda: wm.create_wm_tensor(None, [64, 8], [], torch.float32, K.HOST,
                                                                 device=f"cuda:{other}")),
                       ("DEVICE viewed from the other device",
                        lambda: wm.get_tensor_view(wm.create_wm_tensor(None, [64, 8], [], torch.float32, K.DEVICE),
                                                   f"cuda:{other}"))):
        held.append(make())
        if current() != mine:
            moved.append(f"{what}: current device {current()}, was {mine}")
    del held
    gc.collect()
    _C._cuda_memory_quiesce()
    dist.barrier()
    return moved


def test_creation_keeps_the_current_device(run):
    for moved in run(2, body_keeps_current_device, "double", world_env=DOUBLE, timeout=90):
        assert not moved, moved


@pytest.mark.cuda
def test_creation_keeps_the_current_device_on_gpus(run):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")

    for moved in run(1, body_keeps_current_device, "gpu", world_env=SHARED_GPU, timeout=90):
        assert not moved, moved
