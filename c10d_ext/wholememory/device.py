"""Whole-memory tensors in CUDA memory: DEVICE, CHUNKED on CUDA devices, and a HOST tensor's CUDA view.

DEVICE and CUDA CHUNKED memory is made with CUDA's virtual memory management (myccl's C++
``SharedRegion`` on the CUDA seam): each local rank makes its own pages on its device, exports
them as a file descriptor, and every local rank maps every rank's pages. The descriptors travel
between the processes as Unix file descriptors do, over an abstract Unix socket per rank
(SCM_RIGHTS); they are closed as soon as the pages are mapped, so nothing is left behind by any
exit, a SIGKILL included: the memory goes with the last process that maps it.

- DEVICE: the pages are split evenly over the local ranks (whole granules; a row may straddle
  two ranks' pages) and mapped back to back into one reserved range: one contiguous CUDA tensor,
  the same addresses in every process.
- CHUNKED: local rank i's pages hold rows ``parts[i]``; each part is mapped into a range of its
  own, and the ``ChunkedTensor`` has one CUDA tensor per chunk.
- HOST on a process with a CUDA device: the host copy is registered with CUDA (portable, mapped)
  and the tensor returned is the device's zero-copy view of it.

Without a GPU the same code runs on the strict CUDA double (tests/cuda_double.py), whose "device
memory" is memfd files mapped into host memory, and whose tensors are CPU tensors standing for
CUDA ones.
"""

from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist

from .. import _C
from .descriptors import Mailbox, MissingPeers
from .errors import agree_on_error, fail


def memory_kind() -> str:
    """"cuda", "double" (the test double installed) or "" (no CUDA memory in this build)."""
    return _C._cuda_memory_kind()


def current_device() -> int | None:
    """This process's CUDA device, None when it has none (no CUDA, or none selected yet)."""
    kind = memory_kind()
    if kind == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return None
    if kind == "double":
        d = _C._cuda_memory_device()
        return d if d >= 0 else None
    return None


def resolve_device(op, group, device, required: bool, what: str = "this tensor") -> int | None:
    """The CUDA device a tensor goes on: ``device`` ("cuda", "cuda:1", 1, or "cpu" for none), else
    this process's current one. required: no device is an error."""
    if device is not None:
        d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if d.type == "cpu":
            if required:
                fail(op, group, f"{what} lives in CUDA memory; device={device!r} is not a CUDA device")
            return None
        if d.type != "cuda":
            fail(op, group, f"device must be a CPU or CUDA device, got {d}")
        if not memory_kind():
            fail(op, group, f"no CUDA memory in this build (device={device!r})", NotImplementedError)
        return d.index if d.index is not None else current_device()
    dev = current_device()
    if dev is None and required:
        kind = memory_kind()
        if not kind:
            why = "this build has no CUDA"
        elif kind == "cuda" and not torch.cuda.is_available():
            why = "no CUDA device is available to this process"
        else:
            why = "this process has no CUDA device: call torch.cuda.set_device(local_rank) first"
        fail(op, group, f"{what} lives in CUDA memory and {why}")
    return dev


def _exchange(op, group, members, index, fd: int, nbytes: int) -> list[tuple[int, int]]:
    """Every local rank's (descriptor, bytes), in local-rank order; this rank's own is (-1, nbytes).
    Collective over the group (whose ranks are all on this host)."""
    n = len(members)
    if n == 1:
        return [(-1, nbytes)]
    token = [secrets.token_hex(8) if index == 0 else None]
    dist.broadcast_object_list(token, group=group, group_src=members[0])  # (a communicator has no global ranks)
    names = [f"\0myccl-wm-{token[0]}-{i}" for i in range(n)]  # abstract: no file, gone with the socket
    timeout = _timeout(group)
    box, error = None, None
    try:
        box = Mailbox(names, index)
    except OSError as e:
        error = RuntimeError(f"myccl: {op} (rank {group.rank()}): cannot open a socket for the memory handles: {e}")
    agree_on_error(op, group, error, "rank {rank} cannot take memory handles (its error says why)", RuntimeError)
    with box:  # every rank's socket exists: the agreement was a barrier
        try:
            return box.swap(fd, nbytes, timeout)
        except MissingPeers as e:
            missing = [members[i] for i in e.missing]
            fail(op, group, f"no memory handle came from rank(s) {missing} within {timeout:.0f} s", RuntimeError)
        except OSError as e:
            fail(op, group, f"passing the memory handles failed: {e}", RuntimeError)


def _timeout(group) -> float:
    from .. import _myccl_backend

    try:
        return _myccl_backend(group).timeout.total_seconds()
    except Exception:  # noqa: BLE001 (another backend: torch's default)
        return 600.0


def map_region(op, group, members, index, device: int, sizes: list[int], contiguous: bool):
    """Makes this rank's ``sizes[index]`` bytes on ``device`` and maps every local rank's pages
    (``sizes`` in whole granules, the same list on every rank). Collective; a failure on any
    rank fails every rank. Returns the region (_C._SharedRegion)."""
    region, fd, error = None, -1, None
    try:  # made and exported before the first agreement: a rank failing either fails every rank there
        region = _C._SharedRegion(device, sizes[index])
        fd = region.export_fd()
    except RuntimeError as e:
        error = RuntimeError(f"myccl: {op} (rank {group.rank()}): {e}")
    got = []
    try:
        agree_on_error(op, group, error, "rank {rank} could not make or export its device memory (its error "
                       "says why)", RuntimeError)
        try:
            got = _exchange(op, group, members, index, fd, sizes[index])
        except RuntimeError as e:  # (the exchange's failure is this rank's: the next agreement tells the others)
            error = e
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        if error is None:
            for i, (_, b) in enumerate(got):
                if b != sizes[i]:
                    fail(op, group, f"local rank {i} made {b} bytes, this rank expected {sizes[i]}", RuntimeError)
            region.map([f for f, _ in got], sizes, index, contiguous)
    except RuntimeError as e:
        error = e
    finally:
        for f, _ in got:
            if f >= 0:
                os.close(f)
    agree_on_error(op, group, error, "rank {rank} could not map the device memory (its error says why)", RuntimeError)
    return region


def granularity(device: int) -> int:
    return _C._SharedRegion(device, 0).granularity


def device_pages(total_bytes: int, gran: int, n: int) -> list[int]:
    """DEVICE's split: ceil(total / granule) granules, local rank i holding
    [floor(i P / n), floor((i + 1) P / n)); bytes per rank."""
    pages = -(-max(total_bytes, 1) // gran)
    return [((i + 1) * pages // n - i * pages // n) * gran for i in range(n)]


def chunk_bytes(meta, gran: int) -> list[int]:
    """CHUNKED's split: rank i's chunk holds rows parts[i], in whole granules (at least one)."""
    item = meta.dtype.itemsize
    return [-(-max(count * meta.stride[0] * item, 1) // gran) * gran for _, count in meta.parts]


def host_view(host: torch.Tensor, device: int) -> torch.Tensor:
    """The zero-copy view of host memory from ``device`` (registered while the view lives)."""
    return _C._host_device_view(host, device)
