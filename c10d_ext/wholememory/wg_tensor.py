"""pylibwholegraph.torch's tensors on the seed layer: WholeMemoryTensor, create_wholememory_tensor
(and from a file list), their views, gathers, scatters and files.

A WholeMemoryTensor wraps one seed tensor (``wmb_tensor``) and a window of it (a sub tensor: rows
and columns). The memory types map onto the seed's kinds:

    continuous  cpu: HOST in host memory, one table mapped by every rank of the host;
                cuda: DEVICE, one range of addresses over the host's GPUs
    chunked     CHUNKED, one chunk per rank mapped by all (host memory, or GPU memory on cuda)
    distributed DISTRIBUTED, one part per rank held by it alone (collective gathers and scatters)

Rows are partitioned over the communicator's ranks: equally (``ceil(rows / n)`` each) or as
``tensor_entry_partition`` says. The seed splits chunked and distributed tensors equally only, so
for another partition the seed tensor has ``n * max(partition)`` rows, rank i's entries at the
start of its part, and rows are translated on the way in.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from . import access
from . import device as device_mod
from . import tensor as tensor_mod
from .files import read_rows
from .tensor import WmTensorType
from .wg_comm import WholeMemoryCommunicator, check_location, check_memory_type, fail

__all__ = ["WholeMemoryTensor", "create_wholememory_tensor", "create_wholememory_tensor_from_filelist",
           "destroy_wholememory_tensor", "get_part_file_name", "get_part_file_list"]

_DTYPES = (torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.int16,
           torch.int8, torch.uint8)
_KINDS = {"continuous": (WmTensorType.HOST, WmTensorType.DEVICE), "chunked": (WmTensorType.CHUNKED,) * 2,
          "distributed": (WmTensorType.DISTRIBUTED,) * 2}  # (cpu, cuda)
_BAD_INPUT = (TypeError, ValueError, IndexError)


def get_part_file_name(prefix: str, part_id: int, part_count: int) -> str:
    return "%s_part_%d_of_%d" % (prefix, part_id, part_count)


def get_part_file_list(prefix: str, part_count: int) -> list[str]:
    return [get_part_file_name(prefix, i, part_count) for i in range(part_count)]


class _Layout:
    """What every view of one tensor shares: memory type and location, communicator, the root's
    logical shape, row stride and dtype, each rank's (first, count) entries, and ``per`` (rows per
    rank in the seed tensor when the partition is not the seed's own, else None)."""

    __slots__ = ("memory_type", "location", "comm", "rows", "cols", "stride0", "dtype", "parts", "per")

    def __init__(self, memory_type, location, comm, rows, cols, stride0, dtype, parts, per=None):
        self.memory_type, self.location, self.comm = memory_type, location, comm
        self.rows, self.cols, self.stride0, self.dtype = rows, cols, stride0, dtype
        self.parts, self.per = parts, per


def _layout_of(t) -> _Layout:
    """The layout of a seed tensor wrapped as it is (equal partition)."""
    kind = tensor_mod.get_wm_tensor_type(t)
    group = tensor_mod.get_wm_communicator(t)
    shape, stride = tuple(t.shape), tuple(t.stride())
    if len(shape) not in (1, 2):
        fail("WholeMemoryTensor", group.rank(), f"only 1-D and 2-D tensors are supported, got shape {list(shape)}")
    memory_type = {WmTensorType.HOST: "continuous", WmTensorType.DEVICE: "continuous",
                   WmTensorType.CHUNKED: "chunked"}.get(kind, "distributed")
    location = {WmTensorType.HOST: "cpu", WmTensorType.DEVICE: "cuda"}.get(kind, t.device.type)
    cols = shape[1] if len(shape) == 2 else None
    return _Layout(memory_type, location, WholeMemoryCommunicator(group), shape[0], cols, stride[0], t.dtype,
                   tensor_mod.split_rows(shape[0], group.size()))


def _last_wins(idx: torch.Tensor):
    """(distinct indices, position of the last occurrence of each)."""
    s, order = torch.sort(idx, stable=True)
    if s.numel() < 2:
        return s, order
    keep = torch.ones(s.numel(), dtype=torch.bool, device=s.device)
    torch.ne(s[1:], s[:-1], out=keep[:-1])
    return s[keep], order[keep]


class WholeMemoryTensor:
    """A WholeMemory tensor (1-D or 2-D), or a window of one (get_sub_tensor). ``wmb_tensor`` is
    the seed tensor it wraps (None once destroyed)."""

    def __init__(self, wmb_tensor, _layout: _Layout | None = None, _window=None):
        self.wmb_tensor = wmb_tensor
        self._layout = _layout if _layout is not None else _layout_of(wmb_tensor)
        L = self._layout
        self._window = _window if _window is not None else (0, L.rows, 0, L.cols or 0)  # rows r0:r1, cols c0:c1

    # -- what it is --

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    def dim(self) -> int:
        return 1 if self._layout.cols is None else 2

    @property
    def shape(self) -> tuple:
        r0, r1, c0, c1 = self._window
        return (r1 - r0,) if self._layout.cols is None else (r1 - r0, c1 - c0)

    def stride(self) -> tuple:
        return (self._layout.stride0,) if self._layout.cols is None else (self._layout.stride0, 1)

    def storage_offset(self) -> int:
        return self._window[0] * self._layout.stride0 + self._window[2]

    def get_comm(self) -> WholeMemoryCommunicator:
        return self._layout.comm

    def __repr__(self) -> str:
        L = self._layout
        return (f"WholeMemoryTensor(shape={list(self.shape)}, dtype={L.dtype}, memory_type={L.memory_type}, "
                f"location={L.location}{', destroyed' if self.wmb_tensor is None else ''})")

    # -- helpers --

    def _seed(self, op: str):
        if self.wmb_tensor is None:
            fail(op, None, "this WholeMemoryTensor was destroyed (destroy_wholememory_tensor)", RuntimeError)
        return self.wmb_tensor

    def _rank(self) -> int:
        g = self._layout.comm.wmb_comm
        return g.rank() if g is not None else None

    def _fail(self, op, text, exc=ValueError):
        fail(op, self._rank(), text, exc)

    def _plain_rows(self) -> bool:
        """Whether this view's row i is the seed tensor's row i."""
        return self._window[0] == 0 and self._window[1] == self._layout.rows and self._layout.per is None

    def _all_cols(self) -> bool:
        return self._layout.cols is None or (self._window[2] == 0 and self._window[3] == self._layout.cols)

    def _device(self, op) -> torch.device:
        return self._seed(op).device

    def _indices(self, op: str, indice) -> torch.Tensor:
        """The indices as the seed tensor's rows, checked here where the seed's own check would not
        see this view's bounds."""
        dev = self._device(op)
        if not isinstance(indice, torch.Tensor):
            self._fail(op, f"indice must be a tensor, got {type(indice).__name__}", TypeError)
        if indice.dtype not in (torch.int32, torch.int64):
            self._fail(op, f"indice must be int32 or int64, got {indice.dtype}", TypeError)
        if indice.dim() != 1:
            self._fail(op, f"indice must be 1-D, got shape {list(indice.shape)}")
        if indice.device != dev:
            indice = indice.to(dev)
        if self._plain_rows():
            return indice  # the seed checks the range
        rows = self.shape[0]
        if indice.numel():
            lo, hi = torch.aminmax(indice)
            if lo.item() < 0 or hi.item() >= rows:
                pos = int(((indice < 0) | (indice >= rows)).nonzero()[0])
                self._fail(op, f"index {int(indice[pos])} (position {pos}) is out of range for a WholeMemoryTensor "
                           f"of {rows} rows", IndexError)
        idx = indice.to(torch.int64) + self._window[0]
        L = self._layout
        if L.per is not None:
            firsts = torch.tensor([f for f, _ in L.parts], dtype=torch.int64, device=dev)
            ends = firsts + torch.tensor([c for _, c in L.parts], dtype=torch.int64, device=dev)
            owner = torch.searchsorted(ends, idx, right=True)
            shift = torch.arange(len(L.parts), dtype=torch.int64, device=dev) * L.per - firsts
            idx = idx + shift[owner]
        return idx

    def _fail_together(self, op: str, problem: BaseException, first: str):
        """Raises ``problem``; for distributed memory, whose accesses are collective, this rank first
        fails the seed's first collective step of the op, so every rank raises (naming this one)
        and none waits."""
        if self._layout.memory_type == "distributed":
            try:
                if first == "gather":
                    access.gather(self.wmb_tensor, None)
                else:
                    access.scatter(self.wmb_tensor, torch.empty(0), None)
            except _BAD_INPUT:
                pass
        raise problem

    def _finish(self, rows: torch.Tensor, dtype) -> torch.Tensor:
        """A gather's result: this view's columns, in ``dtype``, on the current CUDA device where
        the process has CUDA (as pylibwholegraph), else where the rows are."""
        if not self._all_cols():
            rows = rows[:, self._window[2]:self._window[3]]
        out = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else rows.device
        return rows.to(device=out, dtype=dtype).contiguous()

    # -- gather / scatter --

    def gather(self, indice: torch.Tensor, *, force_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``self[indice]``: [len(indice), cols] (1-D: [len(indice)]), in force_dtype if given.
        Collective for distributed memory (every rank calls, each with its own indices)."""
        op = "gather"
        try:
            if force_dtype is not None and force_dtype not in _DTYPES:
                self._fail(op, f"force_dtype must be one of {', '.join(map(str, _DTYPES))}, got {force_dtype!r}",
                           TypeError)
            idx = self._indices(op, indice)
        except _BAD_INPUT as e:
            self._fail_together(op, e, "gather")
        return self._finish(access.gather(self.wmb_tensor, idx), force_dtype or self.dtype)

    def _values(self, op: str, input_tensor, n: int) -> torch.Tensor:
        if not isinstance(input_tensor, torch.Tensor):
            self._fail(op, f"input_tensor must be a tensor, got {type(input_tensor).__name__}", TypeError)
        want = (n,) + tuple(self.shape[1:])
        if tuple(input_tensor.shape) != want:
            self._fail(op, f"input_tensor has shape {list(input_tensor.shape)}, expected {list(want)} (one row per "
                       "index)")
        if input_tensor.is_floating_point() != self.dtype.is_floating_point:
            self._fail(op, f"input_tensor is {input_tensor.dtype}, the tensor is {self.dtype}", TypeError)
        return input_tensor.to(device=self._device(op), dtype=self.dtype)

    def scatter(self, input_tensor: torch.Tensor, indice: torch.Tensor) -> None:
        """``self[indice] = input_tensor`` (the last value wins for a repeated index; for
        distributed memory, the highest rank's). Collective for distributed memory."""
        op = "scatter"
        partial = not self._all_cols()
        first = "gather" if partial else "scatter"
        try:
            idx = self._indices(op, indice)
            vals = self._values(op, input_tensor, idx.shape[0])
        except _BAD_INPUT as e:
            self._fail_together(op, e, first)
        t = self.wmb_tensor
        if not partial:
            access.scatter(t, vals, idx)
            return
        c0, c1 = self._window[2], self._window[3]
        if self._layout.memory_type == "distributed":  # whole rows: read, patch this view's columns, write
            full = access.gather(t, idx)
            full[:, c0:c1] = vals
            access.scatter(t, full, idx)
            return
        if not idx.numel():
            return
        uniq, last = _last_wins(idx.to(torch.int64))
        vals = vals.index_select(0, last)
        if isinstance(t, torch.Tensor):  # continuous: one table
            t[:, c0:c1].index_copy_(0, uniq, vals)
            return
        parts = tensor_mod.split_rows(t.shape[0], len(self._layout.parts))
        per = parts[0][1]
        counts = torch.bincount(torch.div(uniq, per, rounding_mode="floor"), minlength=len(parts)).tolist()
        at = 0
        for chunk, (first_row, _), k in zip(t.get_all_chunked_tensor(), parts, counts):
            if k:
                chunk[:, c0:c1].index_copy_(0, uniq[at:at + k] - first_row, vals[at:at + k])
            at += k

    # -- views --

    def get_sub_tensor(self, starts, ends) -> "WholeMemoryTensor":
        """A window of this tensor: per dimension, entries [starts[i], ends[i]) (-1: from the first,
        to the last). It shares the memory."""
        op = "get_sub_tensor"
        self._seed(op)
        d = self.dim()
        try:
            starts, ends = [int(s) for s in starts], [int(e) for e in ends]
        except (TypeError, ValueError):
            self._fail(op, f"starts and ends must be sequences of ints, got {starts!r} and {ends!r}", TypeError)
        if len(starts) != d or len(ends) != d:
            self._fail(op, f"starts {starts} and ends {ends} must have one entry per dimension ({d})")
        window = list(self._window)
        for i, size in enumerate(self.shape):
            s = 0 if starts[i] == -1 else starts[i]
            e = size if ends[i] == -1 else ends[i]
            if not (0 <= s < size and s < e <= size):
                self._fail(op, f"dimension {i}: [{starts[i]}, {ends[i]}) is not a non-empty range within [0, {size}) "
                           f"of shape {list(self.shape)}", IndexError)
            window[2 * i + 1] = window[2 * i] + e
            window[2 * i] += s
        return WholeMemoryTensor(self.wmb_tensor, self._layout, tuple(window))

    def _root_global(self, op: str, host_view: bool) -> torch.Tensor:
        """A continuous tensor's whole table: host memory, or the device's view of it."""
        t = self._seed(op)
        if self._layout.location == "cuda":
            if host_view:
                self._fail(op, "cuda WholeMemory cannot get view from host (host_view=True)")
            return t
        dev = None if host_view else device_mod.current_device()
        return t if dev is None else tensor_mod.get_tensor_view(t, f"cuda:{dev}")

    def _root_parts(self, op: str, host_view: bool, mine_only: bool) -> list[tuple[torch.Tensor, int, int]]:
        """(rows, first, count) of each rank's entries (or this rank's alone), all columns."""
        L = self._layout
        t = self._seed(op)
        me = self._rank()
        if host_view and L.location == "cuda":
            self._fail(op, "cuda WholeMemory cannot get view from host (host_view=True)")
        which = [me] if mine_only else range(len(L.parts))
        if L.memory_type == "continuous":
            g = self._root_global(op, host_view)
            return [(g.narrow(0, L.parts[i][0], L.parts[i][1]), *L.parts[i]) for i in which]
        if L.memory_type == "distributed":
            if not mine_only:
                self._fail(op, "distributed WholeMemory has no view of other ranks' memory")
            return [(t.get_local_tensor().narrow(0, 0, L.parts[me][1]), *L.parts[me])]
        chunks = t.get_all_chunked_tensor()
        return [(chunks[i].narrow(0, 0, L.parts[i][1]), *L.parts[i]) for i in which]

    def _in_window(self, rows: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, int]:
        """Part of the root's rows [first, first + count) within this view, and where it starts."""
        r0, r1, c0, c1 = self._window
        lo = max(first, r0)
        hi = max(lo, min(first + count, r1))
        part = rows.narrow(0, lo - first, hi - lo)
        if self._layout.cols is not None:
            part = part[:, c0:c1]
        return part, lo - r0

    def get_local_tensor(self, host_view: bool = False) -> tuple[torch.Tensor, int]:
        """(this rank's entries of this view, the index of the first of them in the view). The
        rows are the memory itself: writes go to the tensor. host_view=False gives the CUDA
        device's view where there is one."""
        return self._in_window(*self._root_parts("get_local_tensor", host_view, True)[0])

    def get_global_tensor(self, host_view: bool = False) -> torch.Tensor:
        """The whole view as one tensor: continuous memory only."""
        op = "get_global_tensor"
        if self._layout.memory_type != "continuous":
            self._fail(op, f"{self._layout.memory_type} WholeMemory has no global view (continuous memory has one); "
                       "use gather, get_local_tensor or get_all_chunked_tensor")
        return self._in_window(self._root_global(op, host_view), 0, self._layout.rows)[0]

    def get_all_chunked_tensor(self, host_view: bool = False) -> list[torch.Tensor]:
        """Every rank's entries of this view, as tensors (continuous and chunked memory)."""
        return [self._in_window(*p)[0] for p in self._root_parts("get_all_chunked_tensor", host_view, False)]

    # -- files --

    def _entry_bytes(self) -> int:
        return (self.shape[1] if self.dim() == 2 else 1) * self.dtype.itemsize

    def _agree(self, op: str, error: BaseException | None) -> None:
        tensor_mod.agree_on_error(op, self._layout.comm.wmb_comm, error, "rank {rank} failed (its error says why)",
                                  OSError)

    def from_filelist(self, filelist, round_robin_size: int = 0) -> None:
        """Collective: fills the view from files holding its entries back to back (raw, native byte
        order, only the view's columns), each rank reading its own entries; the files may hold
        fewer entries than the view. round_robin_size > 0: entry e belongs to rank (e // size) % n,
        placed at local entry (e // (size * n)) * size + e % size."""
        op = "from_filelist"
        if isinstance(filelist, str):
            filelist = [filelist]
        error = None
        try:
            if isinstance(round_robin_size, bool) or not isinstance(round_robin_size, int) or round_robin_size < 0:
                self._fail(op, f"round_robin_size must be an int >= 0, got {round_robin_size!r}")
            entry = self._entry_bytes()
            sizes = [_file_size(op, self._rank(), f) for f in filelist]
            for f, s in zip(filelist, sizes):
                if s % entry:
                    self._fail(op, f"file {f} has {s} bytes, not a multiple of an entry ({entry} bytes)")
            total = sum(sizes) // entry
            if total > self.shape[0]:
                self._fail(op, f"the {len(filelist)} files hold {total} entries, the tensor has {self.shape[0]}")
            local, first = self.get_local_tensor(host_view=self._layout.location == "cpu")
            reader = functools.partial(read_rows, filelist, sizes, entry)  # (first, dest): entries of the files in turn
            if round_robin_size == 0:
                stop = min(first + local.shape[0], total)
                if stop > first:
                    reader(first, local.narrow(0, 0, stop - first))
            else:
                self._read_round_robin(op, reader, total, round_robin_size, local)
        except (OSError, ValueError, TypeError) as e:
            error = e
        self._agree(op, error)

    def _read_round_robin(self, op, reader, total: int, size: int, local: torch.Tensor) -> None:
        n, me = len(self._layout.parts), self._rank()
        if size > total // n:
            self._fail(op, f"illegal round_robin_size {size}: the files hold {total} entries for {n} ranks "
                       f"(at most {total // n})")
        k = 0
        while (k * n + me) * size < total:
            start = (k * n + me) * size
            count = min(size, total - start)
            if k * size + count > local.shape[0]:
                self._fail(op, f"round robin gives this rank more than its {local.shape[0]} entries")
            reader(start, local.narrow(0, k * size, count))
            k += 1

    def from_file_prefix(self, file_prefix: str, part_count: int | None = None) -> None:
        """from_filelist of ``{file_prefix}_part_{i}_of_{part_count}`` (default: the communicator's size)."""
        if part_count is None:
            part_count = self.get_comm().get_size()
        self.from_filelist(get_part_file_list(file_prefix, part_count))

    def local_to_file(self, filename: str) -> None:
        """Collective: each rank writes its entries of the view (get_local_tensor) to its own file,
        raw, only the view's columns."""
        op = "local_to_file"
        error = None
        try:
            local, _ = self.get_local_tensor(host_view=self._layout.location == "cpu")
            flat = local.cpu().contiguous().view(-1)
            with open(filename + ".tmp", "wb") as f:
                if flat.numel():
                    f.write(memoryview(flat.view(torch.uint8).numpy()))
            os.replace(filename + ".tmp", filename)
        except OSError as e:
            error = OSError(f"myccl: {op} (rank {self._rank()}): {e}")
        self._agree(op, error)

    def to_file_prefix(self, file_prefix: str) -> None:
        """local_to_file to ``{file_prefix}_part_{rank}_of_{size}``."""
        comm = self.get_comm()
        self.local_to_file(get_part_file_name(file_prefix, comm.get_rank(), comm.get_size()))


def _file_size(op: str, rank, filename: str) -> int:
    if not os.path.isfile(filename):
        fail(op, rank, f"File {filename} not found or not file")
    if not os.access(filename, os.R_OK):
        fail(op, rank, f"File {filename} not readable")
    return os.path.getsize(filename)


def create_wholememory_tensor(comm: WholeMemoryCommunicator, memory_type: str, memory_location: str, sizes, dtype,
                              strides, tensor_entry_partition=None) -> WholeMemoryTensor:
    """Collective over ``comm``: a new zero-filled tensor of 1 or 2 dimensions. memory_type
    continuous, chunked or distributed; memory_location cpu or cuda; strides None for contiguous
    rows (else the last is 1 and a row's stride at least its length); tensor_entry_partition[i]
    the entries of rank i (they add up to sizes[0]), None for an equal partition."""
    return _create("create_wholememory_tensor", comm, memory_type, memory_location, sizes, dtype, strides,
                   tensor_entry_partition, None)


def _layout_args(op, rank, n, memory_type, memory_location, sizes, dtype, strides, partition):
    """Every argument checked; (sizes, strides, parts) normalized."""
    check_memory_type(op, rank, memory_type)
    check_location(op, rank, memory_location)
    try:
        sizes = [int(s) for s in sizes]
        strides = None if strides is None else [int(s) for s in strides]
    except (TypeError, ValueError):
        fail(op, rank, f"sizes and strides must be sequences of ints, got {sizes!r} and {strides!r}", TypeError)
    if len(sizes) not in (1, 2):
        fail(op, rank, f"Only dim 1 or 2 is supported now (sizes {sizes})")
    if any(s <= 0 for s in sizes):
        fail(op, rank, f"sizes {sizes}: every size must be > 0")
    if strides is None:
        strides = [sizes[1], 1] if len(sizes) == 2 else [1]
    if len(strides) != len(sizes) or strides[-1] != 1 or (len(sizes) == 2 and strides[0] < sizes[1]):
        fail(op, rank, f"strides {strides} do not fit sizes {sizes} (one per dimension, the last 1, a row's stride "
             "at least its length)")
    if dtype not in _DTYPES:
        fail(op, rank, f"dtype {dtype!r} not supported (one of {', '.join(map(str, _DTYPES))})", TypeError)
    if partition is None:
        return sizes, strides, tensor_mod.split_rows(sizes[0], n)
    try:
        counts = [int(c) for c in (partition.tolist() if isinstance(partition, torch.Tensor) else partition)]
    except (TypeError, ValueError):
        fail(op, rank, f"tensor_entry_partition must be a sequence of ints, got {partition!r}", TypeError)
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != sizes[0]:
        fail(op, rank, f"tensor_entry_partition {counts} must give each of the {n} ranks a count >= 0, adding up to "
             f"{sizes[0]} entries")
    firsts = [sum(counts[:i]) for i in range(n)]
    return sizes, strides, list(zip(firsts, counts))


def _create(op, comm, memory_type, memory_location, sizes, dtype, strides, partition, problem) -> WholeMemoryTensor:
    if isinstance(comm, dist.ProcessGroup):
        comm = WholeMemoryCommunicator(comm)
    if not isinstance(comm, WholeMemoryCommunicator):
        fail(op, None, f"comm must be a WholeMemoryCommunicator, got {type(comm).__name__}", TypeError)
    group = comm._group(op)
    rank, n = group.rank(), group.size()
    parts = None
    try:
        if problem is not None:
            raise problem
        sizes, strides, parts = _layout_args(op, rank, n, memory_type, memory_location, sizes, dtype, strides,
                                             partition)
        if not comm.support_type_location(memory_type, memory_location):
            fail(op, rank, f"{memory_type} memory on {memory_location} is not supported on this communicator "
                 f"({_why_not(comm, memory_type, memory_location)})")
    except (TypeError, ValueError, NotImplementedError, OSError) as e:
        problem = e
    what = (memory_type, memory_location, sizes, strides, str(dtype), parts)
    if n > 1:
        got = [None] * n
        dist.all_gather_object(got, (problem is not None, what), group=group)
        if problem is not None:
            raise problem
        bad = next((r for r, (b, _) in enumerate(got) if b), None)
        if bad is not None:
            fail(op, rank, f"rank {bad} passed bad arguments (its error says what)")
        names = ("memory_type", "memory_location", "sizes", "strides", "dtype", "tensor_entry_partition")
        for r, (_, other) in enumerate(got):
            if other != what:
                i = next(i for i in range(len(what)) if other[i] != what[i])
                fail(op, rank, f"ranks disagree on {names[i]}: this rank passed {what[i]}, rank {r} passed {other[i]}")
    elif problem is not None:
        raise problem
    counts = [c for _, c in parts]
    per = None
    if memory_type != "continuous" and parts != tensor_mod.split_rows(sizes[0], n):
        per = max(max(counts), 1)
    seed_sizes = [per * n if per else sizes[0]] + sizes[1:]
    if memory_location == "cpu":
        device = "cpu"
    elif memory_type == "distributed":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = f"cuda:{device_mod.current_device()}"
    kind = _KINDS[memory_type][memory_location == "cuda"]
    t = tensor_mod.create_wm_tensor(group, seed_sizes, strides, dtype, kind, device=device)
    layout = _Layout(memory_type, memory_location, comm, sizes[0], sizes[1] if len(sizes) == 2 else None, strides[0],
                     dtype, parts, per)
    return WholeMemoryTensor(t, layout)


def _why_not(comm: WholeMemoryCommunicator, memory_type: str, memory_location: str) -> str:
    if memory_type == "hierarchy":
        return "hierarchy memory is not offered"
    if memory_type == "distributed":
        return "no CUDA device is available to this process"
    hosts = comm.host_count()
    if hosts is None:
        return f"{memory_type} memory needs a communicator running myccl"
    if hosts > 1:
        return f"{memory_type} memory is shared by the ranks of one host and this communicator spans {hosts} hosts"
    return "this process has no CUDA device: call torch.cuda.set_device(local_rank) first"


def create_wholememory_tensor_from_filelist(comm: WholeMemoryCommunicator, memory_type: str, memory_location: str,
                                            filelist, dtype, last_dim_size: int = 0, last_dim_strides: int = -1,
                                            tensor_entry_partition=None) -> WholeMemoryTensor:
    """Collective: a tensor holding the entries of the files (raw, back to back): 1-D of elements
    (last_dim_size 0) or rows of last_dim_size elements, last_dim_strides apart (-1: packed)."""
    op = "create_wholememory_tensor_from_filelist"
    if isinstance(filelist, str):
        filelist = [filelist]
    rank = comm.get_rank() if isinstance(comm, WholeMemoryCommunicator) else None
    problem, sizes, strides = None, None, None
    try:
        if not isinstance(dtype, torch.dtype):
            fail(op, rank, f"dtype must be a torch.dtype, got {dtype!r}", TypeError)
        if last_dim_strides == -1:
            last_dim_strides = last_dim_size if last_dim_size > 0 else 1
        entry = dtype.itemsize * (last_dim_size if last_dim_size > 0 else 1)
        total = 0
        for f in filelist:
            size = _file_size(op, rank, f)
            if size % entry:
                fail(op, rank, f"File {f} size is {size} not multiple of {entry}")
            total += size
        count = total // entry
        sizes, strides = ([count], [1]) if last_dim_size == 0 else ([count, last_dim_size], [last_dim_strides, 1])
    except (TypeError, ValueError, OSError) as e:
        problem = e
    t = _create(op, comm, memory_type, memory_location, sizes, dtype, strides, tensor_entry_partition, problem)
    t.from_filelist(filelist)
    return t


def destroy_wholememory_tensor(wm_tensor: WholeMemoryTensor) -> None:
    """Lets the tensor go: its memory goes with the last reference to it (views and sub tensors
    hold it too). Using the object afterwards is an error."""
    if wm_tensor is not None:
        wm_tensor.wmb_tensor = None
