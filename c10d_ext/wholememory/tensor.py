"""Whole-memory tensors: creation, the kinds, row partitions and views.

A whole-memory tensor is created collectively over a process group and spread over the group's
memory. Rows are split as WholeMemory splits them: ``ceil(rows / n)`` per part, the trailing parts
possibly shorter or empty. What a kind keeps where:

- HOST: one copy per host in shared memory (myccl's shared tensor), mapped by every local rank;
  a plain CPU tensor. Its parts (``local_partition``) are over the host's ranks.
- CHUNKED: one chunk per local rank, each made by its rank and mapped by all the others; a
  ``ChunkedTensor``. One host only.
- DISTRIBUTED (old name NCCL): one part per rank of the group, on any host, held by that rank
  alone; a ``DistributedTensor``, reached through the collective gather / scatter.
- DEVICE: GPU memory of the host's ranks mapped by every local process as one CUDA tensor
  (device.py). CHUNKED goes in CUDA memory too, and HOST becomes a CUDA view of the host copy,
  where the process has a CUDA device (or ``device=`` names one).
"""

from __future__ import annotations

import enum
import itertools
import math
import weakref

import torch
import torch.distributed as dist

from . import comm as comm_mod
from . import device as device_mod
from .errors import agree_on_error, fail  # noqa: F401 (agree_on_error: also this module's name for it)

__all__ = ["WmTensorType", "ChunkedTensor", "DistributedTensor", "NCCLTensor", "create_wm_tensor",
           "get_tensor_view", "local_partition", "get_partition_plan", "get_wm_tensor_type", "is_wm_tensor",
           "get_wm_communicator", "get_local_tensor"]

_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
           torch.float32, torch.float64)


class WmTensorType(enum.Enum):
    """The kinds, with WholeMemory's values; NCCL is the old name of DISTRIBUTED (an alias)."""

    HOST = 0
    DEVICE = 1
    CHUNKED = 2
    DISTRIBUTED = 3
    NCCL = 3


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """WholeMemory's equal partition: ceil(rows/parts) rows each, clamped; (first, count) each."""
    per = -(-rows // parts) if parts else 0
    out = []
    for i in range(parts):
        first = min(i * per, rows)
        out.append((first, min(first + per, rows) - first))
    return out


class _Meta:
    """What a whole-memory tensor is, kept per storage: kind, group, logical shape and stride,
    which ranks share its memory (``members``: group ranks of this host for the mapped kinds, the
    whole group for DISTRIBUTED) and this rank's index among them."""

    __slots__ = ("kind", "group", "shape", "stride", "dtype", "members", "index", "parts", "host", "hosts",
                 "region", "host_ref", "view", "view_device", "__weakref__")

    def __init__(self, kind, group, shape, stride, dtype, members, index, host, hosts):
        self.kind, self.group, self.shape, self.stride, self.dtype = kind, group, shape, stride, dtype
        self.members, self.index, self.host, self.hosts = members, index, host, hosts
        self.parts = split_rows(shape[0], len(members))
        self.region = None  # the mapped CUDA memory (DEVICE, CUDA CHUNKED)
        self.host_ref = None  # the host copy behind a HOST tensor's CUDA view (a weak reference)
        self.view, self.view_device = None, None  # that view (a weak reference) and its device

    @property
    def host_tensor(self) -> torch.Tensor | None:
        """The host copy behind a HOST tensor's CUDA view, while it lives (each view holds it)."""
        return self.host_ref() if self.host_ref is not None else None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_stride(self) -> int:
        return self.stride[0]


# storage data_ptr -> [meta, how many tracked tensors name it], for the plain tensors (HOST,
# DEVICE). Counted: views of one memory (a DEVICE tensor seen from two devices, a HOST tensor and
# its CUDA view) may share an address, and the memory stays known while any of them lives.
_BY_STORAGE: dict[int, list] = {}


def _untrack(keys) -> None:
    for key in keys:
        entry = _BY_STORAGE.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _BY_STORAGE[key]


def _track(t: torch.Tensor, meta: _Meta, *also: torch.Tensor) -> None:
    """``t`` (and tensors over the same memory, ``also``) names ``meta`` until ``t`` goes."""
    keys = [x.untyped_storage().data_ptr() for x in (t,) + also]
    for key in keys:
        entry = _BY_STORAGE.setdefault(key, [meta, 0])
        entry[0] = meta
        entry[1] += 1
    weakref.finalize(t, _untrack, keys)


def meta_of(t, op: str) -> _Meta:
    if isinstance(t, (ChunkedTensor, DistributedTensor)):
        return t._meta
    if isinstance(t, torch.Tensor):
        entry = _BY_STORAGE.get(t.untyped_storage().data_ptr())
        if entry is not None:
            return entry[0]
    fail(op, None, f"expected a whole-memory tensor (from create_wm_tensor), got {type(t).__name__}", TypeError)


class _Sharded:
    """What ChunkedTensor and DistributedTensor share: WholeMemory's tensor-like surface."""

    _ids = itertools.count(1)

    def __init__(self, meta: _Meta):
        self._meta = meta
        self._id = next(self._ids)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._meta.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._meta.dtype

    def stride(self, dim: int | None = None):
        return tuple(self._meta.stride) if dim is None else self._meta.stride[dim]

    def dim(self) -> int:
        return len(self._meta.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self._meta.shape[dim]

    def numel(self) -> int:
        return math.prod(self._meta.shape)

    def get_ptr(self) -> int:
        """An int that names this tensor in this process (WholeMemory passes it to its ops)."""
        return self._id

    @property
    def group(self):
        return self._meta.group

    def _part_view(self, storage: torch.Tensor, count: int) -> torch.Tensor:
        m = self._meta
        return storage.as_strided((count,) + tuple(m.shape[1:]), tuple(m.stride))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self._meta.shape)}, dtype={self.dtype}, kind={self._meta.kind.name})"


class ChunkedTensor(_Sharded):
    """One chunk per local rank, in shared memory made by that rank and mapped by every local
    rank: each process reads and writes every chunk directly."""

    def __init__(self, meta: _Meta, chunks: list[torch.Tensor]):
        super().__init__(meta)
        self._chunks = chunks  # flat storage per chunk

    def get_all_chunked_tensor(self) -> list[torch.Tensor]:
        """The chunks as tensors, chunk i holding rows [first_i, first_i + count_i)."""
        return [self._part_view(s, c) for s, (_, c) in zip(self._chunks, self._meta.parts)]

    @property
    def chunks(self) -> list[torch.Tensor]:
        return self.get_all_chunked_tensor()

    def get_local_tensor(self) -> torch.Tensor:
        return self.get_all_chunked_tensor()[self._meta.index]

    @property
    def device(self) -> torch.device:
        return self._chunks[0].device


class DistributedTensor(_Sharded):
    """One part per rank of the group, held by that rank alone; every access is collective."""

    def __init__(self, meta: _Meta, local: torch.Tensor, peers: list[torch.Tensor] | None = None):
        super().__init__(meta)
        self._local = local  # flat storage of this rank's part
        self._peers = peers  # one host: every rank's part, mapped here (gathers read them directly)
        self._scratch: dict[str, torch.Tensor] = {}  # the exchanges' staging, reused (access.py)

    def get_local_tensor(self) -> torch.Tensor:
        return self._part_view(self._local, self._meta.parts[self._meta.index][1])

    @property
    def device(self) -> torch.device:
        return self._local.device


NCCLTensor = DistributedTensor  # the old API's name


def _check_layout(op, group, sizes, strides) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(sizes, int):
        sizes = (sizes,)
    sizes = tuple(int(s) for s in sizes)
    if not sizes:
        fail(op, group, "shape must have at least one dimension (rows), got []")
    for d, s in enumerate(sizes):
        if s <= 0:
            fail(op, group, f"dimension {d} of shape {list(sizes)} is {s}; every dimension must be > 0")
    contiguous = []
    acc = 1
    for s in reversed(sizes):
        contiguous.append(acc)
        acc *= s
    contiguous = tuple(reversed(contiguous))
    if strides is None or len(strides) == 0:
        return sizes, contiguous
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(sizes):
        fail(op, group, f"stride {list(strides)} has {len(strides)} dimensions, shape {list(sizes)} has {len(sizes)}")
    if strides[-1] != 1:
        fail(op, group, f"the last stride must be 1, got stride {list(strides)}")
    for d in range(len(sizes) - 1):
        if strides[d] < sizes[d + 1] * strides[d + 1]:
            fail(op, group, f"stride {list(strides)} overlaps rows of shape {list(sizes)}: stride[{d}] = "
                 f"{strides[d]} < {sizes[d + 1] * strides[d + 1]}")
    return sizes, strides


def _topology(group):
    """(members on this host as group ranks, my index there, host index, number of hosts)."""
    from .. import _myccl_backend

    be = _myccl_backend(group)
    hosts = be.host_of_rank  # group rank -> host index
    me = group.rank()
    members = [r for r, h in enumerate(hosts) if h == hosts[me]]
    return be, members, members.index(me), hosts[me], max(hosts) + 1


def _resolve_kind(kind) -> WmTensorType:
    if isinstance(kind, WmTensorType):
        return kind
    if isinstance(kind, str) and kind.upper() in WmTensorType.__members__:
        return WmTensorType[kind.upper()]
    if isinstance(kind, int) and not isinstance(kind, bool):
        try:
            return WmTensorType(kind)
        except ValueError:
            pass
    raise ValueError("Invalid wm_tensor_type")


def create_wm_tensor(group=None, sizes=None, strides=(), tensor_dtype=torch.float32,
                     wm_tensor_type=WmTensorType.CHUNKED, *, shape=None, stride=None, dtype=None, kind=None,
                     device=None):
    """Collective over ``group`` (a communicator from create_communicator, a torch process group, or
    None: the default group): every rank passes the same shape,
    stride, dtype and kind. Returns a CPU tensor (HOST), a ChunkedTensor or a DistributedTensor.
    The keywords shape=, stride=, dtype=, kind= name the last four too. ``device`` places a
    DISTRIBUTED tensor's parts (default: this process's current CUDA device where CUDA is
    available and the group runs CUDA tensors, else the CPU)."""
    sizes = shape if shape is not None else sizes
    strides = stride if stride is not None else strides
    tensor_dtype = dtype if dtype is not None else tensor_dtype
    wm_tensor_type = kind if kind is not None else wm_tensor_type
    op = "create_wm_tensor"
    group = comm_mod.resolve_group(op, group)
    kind = _resolve_kind(wm_tensor_type)
    if sizes is None:
        fail(op, group, "shape is required")
    if tensor_dtype not in _DTYPES:
        fail(op, group, f"dtype {tensor_dtype} is not supported (one of {', '.join(str(d) for d in _DTYPES)})")
    shape, stride = _check_layout(op, group, sizes, strides)
    cuda, error = None, None  # the CUDA device of a mapped kind's memory or view, None for host memory
    where, direct = None, None  # DISTRIBUTED: where its parts live; whether one host's parts are read in place
    try:
        if kind is WmTensorType.DISTRIBUTED:
            where = _device(op, group, device)
            direct = f"MYCCL_WM_DIRECT={int(_direct_allowed())}"
        else:
            cuda = device_mod.resolve_device(op, group, device, kind is WmTensorType.DEVICE, f"a {kind.name} tensor")
    except (ValueError, NotImplementedError) as e:
        error = e
    on_cuda = cuda is not None or (where is not None and where.type == "cuda")
    _agree(op, group, (kind.value, shape, stride, str(tensor_dtype), "cuda" if on_cuda else "host", direct), error)
    storage_rows = shape[0] * stride[0]
    if kind is WmTensorType.DISTRIBUTED:
        n, me = group.size(), group.rank()
        meta = _Meta(kind, group, shape, stride, tensor_dtype, list(range(n)), me, 0, 1)
        be = _one_host_backend(group) if where.type == "cpu" else None
        if be is not None:  # each part in shared memory its rank makes: gathers read rows where they lie
            peers = _parts_in_shared_memory(be, meta)
            return DistributedTensor(meta, peers[me], peers)
        count = meta.parts[me][1]
        local = torch.zeros(max(count * stride[0], 1), dtype=tensor_dtype, device=where)
        return DistributedTensor(meta, local)
    be, members, index, host, hosts = _topology(group)
    if kind in (WmTensorType.DEVICE, WmTensorType.CHUNKED) and hosts > 1:
        fail(op, group, f"{kind.name} memory is mapped by the ranks of one host and this group spans {hosts} "
             "hosts; use WmTensorType.DISTRIBUTED (one part per rank, any host) or HOST (one copy per host)")
    meta = _Meta(kind, group, shape, stride, tensor_dtype, members, index, host, hosts)
    if kind is WmTensorType.HOST:
        flat = be.shared_tensor([storage_rows], tensor_dtype)
        t = flat.as_strided(shape, stride)
        if cuda is None:
            _track(t, meta)
            return t
        return _host_view(meta, t, cuda)  # as WholeMemory: the device's zero-copy view
    if cuda is None:
        return ChunkedTensor(meta, _parts_in_shared_memory(be, meta))
    gran = device_mod.granularity(cuda)
    if kind is WmTensorType.DEVICE:
        sizes = device_mod.device_pages(storage_rows * tensor_dtype.itemsize, gran, len(members))
        meta.region = device_mod.map_region(op, group, members, index, cuda, sizes, contiguous=True)
        t = meta.region.view(-1, 0, list(shape), list(stride), tensor_dtype, cuda)
        _track(t, meta)
        return t
    meta.region = device_mod.map_region(op, group, members, index, cuda, device_mod.chunk_bytes(meta, gran),
                                        contiguous=False)
    chunks = [meta.region.view(i, 0, [max(count * stride[0], 1)], [1], tensor_dtype, cuda)
              for i, (_, count) in enumerate(meta.parts)]
    return ChunkedTensor(meta, chunks)


def _parts_in_shared_memory(be, meta: _Meta) -> list[torch.Tensor]:
    """Part i (flat) in shared memory that local rank i makes; every local rank maps every part."""
    return [be.shared_tensor([max(count * meta.stride[0], 1)], meta.dtype, owner=i)
            for i, (_, count) in enumerate(meta.parts)]


def _direct_allowed() -> bool:
    """MYCCL_WM_DIRECT: whether one host's DISTRIBUTED parts may be read where they lie."""
    from ..config import parse_env

    return bool(parse_env()["wm_direct"])


def _one_host_backend(group):
    """The group's myccl backend where its ranks share one host's memory and direct access is
    allowed (MYCCL_WM_DIRECT, which every rank agreed on); else None."""
    from .. import _C

    if not _direct_allowed() or group.size() == 1:
        return None
    be = group._get_backend(torch.device("cpu"))
    ok = isinstance(be, _C.MycclBackend) and be.cross_size == 1 and be.uses_shared_memory
    return be if ok else None


def _device(op, group, device) -> torch.device:
    """Where a DISTRIBUTED tensor's parts live."""
    if device is not None:
        try:
            device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        except (RuntimeError, TypeError) as e:
            fail(op, group, f"device must be a CPU or CUDA device, got {device!r} ({e})")
        if device.type not in ("cpu", "cuda"):
            fail(op, group, f"device must be a CPU or CUDA device, got {device}")
        if device.type == "cuda" and not torch.cuda.is_available():
            fail(op, group, f"device={device} but no CUDA device is available to this process")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available() and comm_mod.backend_name(group) in ("myccl", "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(op, group, what, error: BaseException | None = None) -> None:
    """Every rank must ask for the same tensor and be able to place it, in one exchange: a rank
    that could not raises its own ``error`` and the others name it; a mismatch is an error on
    every rank."""
    if group.size() == 1:
        if error is not None:
            raise error
        return
    got = [None] * group.size()
    dist.all_gather_object(got, (what, error is not None), group=group)
    if error is not None:
        raise error
    failed = next((r for r, (_, bad) in enumerate(got) if bad), None)
    if failed is not None:
        fail(op, group, f"rank {failed} cannot place this tensor (its error says why)")
    for r, (other, _) in enumerate(got):
        if other != what:
            names = ("kind", "shape", "stride", "dtype", "memory (host or CUDA device)",
                     "MYCCL_WM_DIRECT setting (one host's parts read in place)")
            diff = next(i for i in range(len(what)) if other[i] != what[i])
            mine, theirs = what[diff], other[diff]
            if diff == 0:
                mine, theirs = WmTensorType(mine).name, WmTensorType(theirs).name
            fail(op, group, f"ranks disagree on the {names[diff]}: this rank asked for {mine}, rank {r} for {theirs}")


def local_partition(t):
    """(this rank's rows as a tensor, the index of its first row) - WholeMemory's local tensor."""
    m = meta_of(t, "local_partition")
    first, count = m.parts[m.index]
    if isinstance(t, (ChunkedTensor, DistributedTensor)):
        return t.get_local_tensor(), first
    return t.narrow(0, first, count), first


def get_partition_plan(t, total_entry_count: int | None = None) -> tuple[int, int, int, int]:
    """(first row, rows, rows per part, total rows) of this rank's part of a whole-memory tensor,
    or, given a communicator (or group) and ``total_entry_count``, of that many rows split over it."""
    op = "get_partition_plan"
    if isinstance(t, dist.ProcessGroup):
        group = comm_mod.check_communicator(op, t)
        if isinstance(total_entry_count, bool) or not isinstance(total_entry_count, int) or total_entry_count < 0:
            fail(op, group, f"a communicator's plan needs total_entry_count, a count >= 0; got {total_entry_count!r}")
        first, count = split_rows(total_entry_count, group.size())[group.rank()]
        return first, count, -(-total_entry_count // group.size()), total_entry_count
    m = meta_of(t, op)
    if total_entry_count is not None and total_entry_count != m.rows:
        fail(op, m.group, f"total_entry_count {total_entry_count!r} differs from the tensor's {m.rows} rows")
    first, count = m.parts[m.index]
    return first, count, -(-m.rows // len(m.members)), m.rows


def get_wm_communicator(t):
    """The communicator (or group) a whole-memory tensor was made on."""
    return meta_of(t, "get_wm_communicator").group


def get_local_tensor(t) -> torch.Tensor:
    """This rank's rows of a whole-memory tensor (its part, as local_partition)."""
    return local_partition(t)[0]


def get_wm_tensor_type(t) -> WmTensorType:
    return meta_of(t, "get_wm_tensor_type").kind


def is_wm_tensor(t) -> bool:
    if isinstance(t, (ChunkedTensor, DistributedTensor)):
        return True
    return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in _BY_STORAGE


def get_tensor_view(t, device):
    """The tensor as seen from ``device``: a HOST tensor's host copy ("cpu") or its view from this
    process's CUDA device; a DEVICE tensor from any local device (that device is given access)."""
    op = "get_tensor_view"
    m = meta_of(t, op)
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if m.kind not in (WmTensorType.HOST, WmTensorType.DEVICE):
        fail(op, m.group, f"{m.kind.name} tensors have no single view; use gather / scatter or local_partition")
    if m.kind is WmTensorType.DEVICE:
        if device.type != "cuda":
            fail(op, m.group, f"a DEVICE tensor is GPU memory: it has no view on {device}")
        index = device.index if device.index is not None else device_mod.current_device()
        view = m.region.view(-1, 0, list(m.shape), list(m.stride), m.dtype, index)
        _track(view, m)
        return view
    if device.type == "cpu":
        host = m.host_tensor
        return host if host is not None else t
    index = device.index if device.index is not None else device_mod.current_device()
    view = m.view() if m.view is not None else None
    if view is not None:
        if index != m.view_device:
            fail(op, m.group, f"this HOST tensor is registered for cuda:{m.view_device}; no view of it from {device}")
        return view
    cuda = device_mod.resolve_device(op, m.group, device, required=True)
    return _host_view(m, t, cuda)


def _host_view(m: _Meta, host: torch.Tensor, cuda: int) -> torch.Tensor:
    """The CUDA view of a HOST tensor's host copy. Each names the tensor while it lives: the view
    holds the host copy, and the host copy, held apart from the view, stays a whole-memory tensor
    (from which a new view can be made) after the view went."""
    view = device_mod.host_view(host, cuda)
    view._wm_host = host  # (the view's Python object keeps the host copy's: one object for both names)
    if m.host_tensor is not host:
        m.host_ref = weakref.ref(host)
        _track(host, m)
    m.view, m.view_device = weakref.ref(view), cuda
    _track(view, m)
    return view
