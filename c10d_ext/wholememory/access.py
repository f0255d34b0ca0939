"""gather / scatter of rows by index, for every kind.

Mapped kinds (HOST, CHUNKED) are read and written in place by the calling rank alone: no
collective. DISTRIBUTED rows live with their owner, so gather and scatter are collective over the
tensor's group (every rank calls, each with its own indices, zero included), in three exchanges:
counts per owner, the indices, then the rows. Bad input on any rank is announced in the first
exchange, so every rank raises (the bad one with what was wrong, the others naming it) and the
group stays usable: no rank waits on an exchange the others skipped.

Indices may repeat and come in any order. A scatter that names a row more than once keeps the
last value given (for DISTRIBUTED: the highest rank's, then the last position).
"""

from __future__ import annotations

import math
import mmap

import torch
import torch.distributed as dist

from .. import _C
from .errors import agree_on_error, fail
from .tensor import ChunkedTensor, DistributedTensor, meta_of


BAD_PEER = "rank {rank} passed bad input (its error says what); nothing was moved"


def check_index_form(op: str, group, idx) -> None:
    """Indices are a 1-D tensor of int32 or int64: the start of every index check of the layer."""
    if not isinstance(idx, torch.Tensor):
        fail(op, group, f"indices must be a tensor, got {type(idx).__name__}", TypeError)
    if idx.dtype not in (torch.int32, torch.int64):
        fail(op, group, f"indices must be int32 or int64, got {idx.dtype}", TypeError)
    if idx.dim() != 1:
        fail(op, group, f"indices must be 1-D, got shape {list(idx.shape)}")


def check_index_range(op: str, group, idx: torch.Tensor, rows: int, what: str) -> None:
    """Every index in [0, rows); else an IndexError naming the first one outside, its position
    and ``what`` has the rows."""
    if idx.numel():
        lo, hi = torch.aminmax(idx)
        if lo.item() < 0 or hi.item() >= rows:
            pos = int(((idx < 0) | (idx >= rows)).nonzero()[0])
            fail(op, group, f"index {int(idx[pos])} (position {pos}) is out of range for {what} of {rows} rows",
                 IndexError)


def _check_indices(op, group, idx, rows: int, device) -> torch.Tensor:
    """The indices of a gather or scatter, on the rows' device (CPU indices are moved there,
    others must be there already), of the dtype given."""
    check_index_form(op, group, idx)
    if idx.device != device:
        if idx.device.type != "cpu":
            fail(op, group, f"indices are on {idx.device}, the tensor's rows on {device}")
        idx = idx.to(device)  # CPU indices for a table on a GPU: moved there
    check_index_range(op, group, idx, rows, "a whole-memory tensor")
    return idx


def _check_values(op, group, values, n: int, row_shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        fail(op, group, f"values must be a tensor, got {type(values).__name__}", TypeError)
    want = (n,) + tuple(row_shape)
    if tuple(values.shape) != want:
        fail(op, group, f"values have shape {list(values.shape)}, expected {list(want)} (one row per index)")
    if values.dtype != dtype and values.is_floating_point() != dtype.is_floating_point:
        fail(op, group, f"values are {values.dtype}, the tensor is {dtype}", TypeError)
    if values.device != device:
        fail(op, group, f"values are on {values.device}, the tensor's rows on {device}")
    return values.to(dtype)


# A gather's result this large goes in memory advised for huge pages. Below it glibc hands torch
# back memory it freed earlier (its mmap threshold adapts up to 32 MiB), already faulted in.
HUGE_FROM = 32 << 20
_HUGE = 2 << 20


def result_rows(n: int, row_shape: tuple, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The tensor a gather returns. A large one on the CPU is anonymous memory advised for
    transparent huge pages: the first writes into a fresh result fault a 2 MiB page at a time
    instead of 4 KiB (docs/DECISIONS.md, "Large gather results in huge pages"). It is an
    ordinary tensor whose memory goes with its last reference."""
    nbytes = n * math.prod(row_shape) * dtype.itemsize
    if (device is not None and torch.device(device).type != "cpu") or nbytes < HUGE_FROM or _MADV_HUGEPAGE is None:
        return torch.empty((n,) + tuple(row_shape), dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_MADV_HUGEPAGE)
    except OSError:
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    skip = -raw.data_ptr() % _HUGE  # start on a huge-page boundary
    return raw[skip:skip + nbytes].view(dtype).view((n,) + tuple(row_shape))


_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _last_wins(idx: torch.Tensor):
    """(distinct indices, position of the last occurrence of each)."""
    s, order = torch.sort(idx.to(torch.int64), stable=True)
    if s.numel() < 2:
        return s, order
    keep = torch.empty(s.numel(), dtype=torch.bool, device=s.device)
    keep[-1] = True
    torch.ne(s[1:], s[:-1], out=keep[:-1])
    return s[keep], order[keep]


def gather(t, indices) -> torch.Tensor:
    """The rows ``t[indices]`` as a new tensor of shape [len(indices), *t.shape[1:]]."""
    m = meta_of(t, "gather")
    if isinstance(t, DistributedTensor):
        return _distributed(t, indices, None)
    if isinstance(t, ChunkedTensor):
        idx = _check_indices("gather", m.group, indices, m.rows, t.device)
        return _chunked_gather(t, idx)
    idx = _check_indices("gather", m.group, indices, t.shape[0], t.device)
    return torch.index_select(t, 0, idx, out=result_rows(idx.numel(), tuple(t.shape[1:]), t.dtype, t.device))


def scatter(t, values, indices) -> None:
    """``t[indices] = values``, in place (the last value wins for a repeated index)."""
    m = meta_of(t, "scatter")
    if isinstance(t, DistributedTensor):
        _distributed(t, indices, values)
        return
    rows = m.rows if isinstance(t, ChunkedTensor) else t.shape[0]
    row_shape = m.shape[1:] if isinstance(t, ChunkedTensor) else tuple(t.shape[1:])
    idx = _check_indices("scatter", m.group, indices, rows, t.device)
    vals = _check_values("scatter", m.group, values, idx.numel(), row_shape, m.dtype, t.device)
    if not idx.numel():
        return
    if isinstance(t, ChunkedTensor) and _dense_rows(m) and t.device.type == "cpu":  # the last value wins
        _C._wm_scatter_rows(t._chunks, m.parts[0][1], m.rows, m.stride[0], idx.contiguous(), vals.contiguous())
        return
    uniq, last = _last_wins(idx)
    if isinstance(t, ChunkedTensor):
        _chunked_scatter(t, uniq, vals.index_select(0, last))
    else:
        t.index_copy_(0, uniq, vals.index_select(0, last))


def _by_owner(idx: torch.Tensor, per: int, parts: int):
    """Groups indices by the part that holds them: (order, counts per part, sorted indices)."""
    owner = torch.div(idx, per, rounding_mode="floor") if per else torch.zeros_like(idx)
    order = torch.argsort(owner, stable=True)
    counts = (torch.bincount(owner, minlength=parts) if idx.numel()
              else torch.zeros(parts, dtype=torch.int64, device=idx.device))
    return order, counts, idx.index_select(0, order)


def _dense_rows(m) -> bool:
    """Whether a row's elements are contiguous (padding only between rows): the row kernels'
    case, one memcpy per row."""
    want = 1
    for size, stride in zip(reversed(m.shape[1:]), reversed(m.stride[1:])):
        if stride != want:
            return False
        want *= size
    return True


def _chunked_gather(t: ChunkedTensor, idx: torch.Tensor) -> torch.Tensor:
    m = t._meta
    per = m.parts[0][1]
    out = result_rows(idx.numel(), tuple(m.shape[1:]), m.dtype, t.device)
    if not idx.numel():
        return out
    if _dense_rows(m) and t.device.type == "cpu":  # the C++ row kernel (host memory)
        _C._wm_gather_rows(t._chunks, per, m.rows, m.stride[0], idx.contiguous(), out)
        return out
    chunks = t.get_all_chunked_tensor()
    order, counts, s = _by_owner(idx.to(torch.int64), per, len(chunks))
    pieces = []
    for c, piece in enumerate(s.split(counts.tolist())):
        if piece.numel():
            pieces.append(chunks[c].index_select(0, piece - m.parts[c][0]))
    out.index_copy_(0, order, torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    return out


def _chunked_scatter(t: ChunkedTensor, uniq: torch.Tensor, vals: torch.Tensor) -> None:
    m = t._meta
    chunks = t.get_all_chunked_tensor()
    per = m.parts[0][1]
    owner = torch.div(uniq, per, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=len(chunks)).tolist()  # uniq is sorted: owners are too
    at = 0
    for c, k in enumerate(counts):
        if k:
            chunks[c].index_copy_(0, uniq[at:at + k] - m.parts[c][0], vals[at:at + k])
        at += k


def _distributed(t: DistributedTensor, indices, values):
    """The collective path: counts, then indices, then rows, each one all_to_all over the group."""
    m = t._meta
    op = "gather" if values is None else "scatter"
    group, n, me = m.group, len(m.members), m.index
    dev = t.device
    row_shape = tuple(m.shape[1:])
    error = None
    if values is None and t._peers is not None and _dense_rows(m):
        return _direct_gather(t, indices)
    try:
        idx = _check_indices(op, group, indices, m.rows, dev).to(torch.int64)
        if values is not None:
            values = _check_values(op, group, values, idx.numel(), row_shape, m.dtype, dev)
        order, send_counts, send_ids = _by_owner(idx, m.parts[0][1], n)
    except (TypeError, ValueError, IndexError) as e:
        error = e
        send_counts = torch.full((n,), -1, dtype=torch.int64, device=dev)
    recv_counts = torch.empty(n, dtype=torch.int64, device=dev)
    dist.all_to_all_single(recv_counts, send_counts.to(dev), group=group)
    if error is not None:
        raise error
    bad = (recv_counts < 0).nonzero()
    if bad.numel():
        fail(op, group, BAD_PEER.format(rank=int(bad[0])))
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    id_type = torch.int32 if m.rows < 2**31 else torch.int64  # half the bytes on the wire
    recv_ids = torch.empty(sum(recvs), dtype=id_type, device=dev)
    dist.all_to_all_single(recv_ids, send_ids.to(id_type), recvs, sends, group=group)
    local = t.get_local_tensor()
    first, count = m.parts[me]
    recv_ids -= first
    if values is None:  # rows go back to whoever asked, then into the order they asked in
        row_bytes = m.dtype.itemsize * max(1, math.prod(row_shape))
        if dev.type == "cpu" and _dense_rows(m) and max(sum(sends), sum(recvs)) * row_bytes >= PIECES_FROM:
            return _rows_back_in_pieces(t, local, recv_ids, sends, recvs, order)
        rows = torch.index_select(local, 0, recv_ids, out=_scratch(t, "send", sum(recvs), row_shape))
        got = _scratch(t, "recv", sum(sends), row_shape)
        dist.all_to_all_single(got, rows, sends, recvs, group=group)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=dev))
        return torch.index_select(got, 0, inverse, out=result_rows(got.shape[0], row_shape, m.dtype, dev))
    rows = torch.index_select(values, 0, order, out=_scratch(t, "send", idx.numel(), row_shape))
    got = _scratch(t, "recv", sum(recvs), row_shape)
    dist.all_to_all_single(got, rows, recvs, sends, group=group)
    if not recv_ids.numel():
        return None
    if dev.type == "cpu" and _dense_rows(m):  # in arrival order: the last value wins
        _C._wm_scatter_rows([t._local], count, count, m.stride[0], recv_ids, got)
    else:
        uniq, last = _last_wins(recv_ids)
        local.index_copy_(0, uniq, got.index_select(0, last))
    return None


PIECES_FROM = 1 << 20  # rows a rank sends or receives in one gather, in bytes, from which they move in pieces
PIECES = 8


def _split(count: int, k: int) -> list[int]:
    """count rows in k pieces, the first ones a row longer: what both ends of a transfer compute."""
    q, r = divmod(count, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def _rows_back_in_pieces(t: DistributedTensor, local, recv_ids, sends, recvs, order) -> torch.Tensor:
    """A large gather's rows go back in PIECES exchanges, each started before the previous one is
    placed: the owners' row gathers and the askers' placing overlap the transfers (across hosts,
    the link then carries rows nearly all the time)."""
    m = t._meta
    group, n = m.group, len(m.members)
    row_shape = tuple(m.shape[1:])
    per_row = max(1, math.prod(row_shape))
    out = result_rows(sum(sends), row_shape, m.dtype)
    out_flat = out.view(-1)
    send_buf = _scratch(t, "send", sum(recvs), row_shape)
    recv_buf = _scratch(t, "recv", sum(sends), row_shape)
    send_pieces = [_split(c, PIECES) for c in sends]  # rows this rank asked of peer p, per piece
    recv_pieces = [_split(c, PIECES) for c in recvs]  # rows peer p asked of this rank, per piece
    soff = [sum(sends[:p]) for p in range(n)]  # where peer p's rows start in `order`
    roff = [sum(recvs[:p]) for p in range(n)]  # where peer p's ids start in recv_ids
    s_at = r_at = 0
    pending = None
    for i in range(PIECES):
        ids = torch.cat([recv_ids[roff[p] + sum(recv_pieces[p][:i]):][:recv_pieces[p][i]] for p in range(n)])
        out_sizes = [send_pieces[p][i] for p in range(n)]
        in_sizes = [recv_pieces[p][i] for p in range(n)]
        rows = torch.index_select(local, 0, ids, out=send_buf[s_at:s_at + ids.numel()])
        got = recv_buf[r_at:r_at + sum(out_sizes)]
        work = dist.all_to_all_single(got, rows, out_sizes, in_sizes, group=group, async_op=True)
        places = torch.cat([order[soff[p] + sum(send_pieces[p][:i]):][:send_pieces[p][i]] for p in range(n)])
        if pending is not None:
            _place(out_flat, per_row, *pending)
        pending = (work, got, places)
        s_at += ids.numel()
        r_at += got.shape[0]
    _place(out_flat, per_row, *pending)
    return out


def _place(out_flat, per_row, work, got, places) -> None:
    work.wait()
    if places.numel():
        rows = out_flat.numel() // per_row
        _C._wm_scatter_rows([out_flat], rows, rows, per_row, places, got)


def _direct_gather(t: DistributedTensor, indices) -> torch.Tensor:
    """One host: every part is mapped here, so the rows are read where they lie. Collective, with
    the exchange's consistency: the ranks first agree that nobody's input is bad, which orders
    this gather after every rank's earlier writes (a scatter's rows, writes to its own part), and
    agree again once every rank has read, so that no rank returns (and goes on to write its own
    part) while another still reads that part."""
    m = t._meta
    error = None
    try:
        idx = _check_indices("gather", m.group, indices, m.rows, t.device).contiguous()
    except (TypeError, ValueError, IndexError) as e:
        error = e
    agree_on_error("gather", m.group, error, BAD_PEER)
    try:
        out = gather_in_place(t, idx)
    except RuntimeError as e:
        error = e
    agree_on_error("gather", m.group, error, "rank {rank} failed reading rows (its error says why)", RuntimeError)
    return out


def mapped_here(t) -> bool:
    """Whether this rank can read every row of ``t``, a DISTRIBUTED tensor, where it lies (one
    host and MYCCL_WM_DIRECT: every rank's part mapped here; every rank of the group alike)."""
    return isinstance(t, DistributedTensor) and t._peers is not None and _dense_rows(t._meta)


def gather_in_place(t: DistributedTensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (checked, on the CPU) of a tensor that is mapped_here, read by this rank alone:
    no collective, so nothing orders the read with the owners' writes (the caller's part)."""
    m = t._meta
    out = result_rows(idx.numel(), tuple(m.shape[1:]), m.dtype)
    if idx.numel():
        _C._wm_gather_rows(t._peers, m.parts[0][1], m.rows, m.stride[0], idx.contiguous(), out)
    return out


# Bytes of one staging buffer a tensor keeps between calls. A call that needs more stages in a
# buffer of its own, freed when it returns: one large gather does not pin its size for the
# tensor's life.
SCRATCH_KEEP = 16 << 20


def _scratch(t: DistributedTensor, name: str, n: int, row_shape: tuple) -> torch.Tensor:
    """A buffer of n rows for the exchanges' staging. Up to SCRATCH_KEEP bytes it is kept with the
    tensor and reused (its pages are then already there: a fresh buffer of that size costs as
    much as the copy into it); a larger one lives for the call only."""
    need = n * math.prod(row_shape)
    buf = t._scratch.get(name)
    if buf is None or buf.numel() < need:
        buf = torch.empty(max(need, 1), dtype=t.dtype, device=t.device)
        if buf.numel() * buf.element_size() <= SCRATCH_KEEP:
            t._scratch[name] = buf
    return buf[:need].view((n,) + row_shape)
