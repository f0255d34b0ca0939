"""Where an embedding's rows live and how they move between ranks: which rank holds which rows,
row ids checked on every rank at once, ids (with a payload row each: a gradient) sent to the
ranks that hold them, and rows sent back to whoever asked, in the order asked.

Every exchange is one ``all_to_all_single`` per piece (counts, ids, rows) over the embedding's
group, on the device of its rows. A rank with bad input sends counts of -1: every rank learns of
it in the first exchange and raises (the bad one its own error, the others naming it), so nobody
waits in an exchange the others skip.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .access import BAD_PEER, check_index_form, check_index_range
from .tensor import agree_on_error, fail


class Owners:
    """The rows each rank of ``group`` holds: [starts[r], ends[r]). Collective at creation (each
    rank says where its own rows are). On one host, or for distributed memory, the ranges are
    disjoint and ordered; a host-memory table across hosts has one copy per host, so a row may have
    several holders (one per host), each of which must see every update."""

    def __init__(self, group, start: int, count: int):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.start, self.count = int(start), int(count)
        mine = torch.tensor([self.start, self.count], dtype=torch.int64)
        every = [torch.zeros(2, dtype=torch.int64) for _ in range(self.size)]
        if self.size > 1:
            dist.all_gather(every, mine, group=group)
        else:
            every = [mine]
        self.starts = [int(x[0]) for x in every]
        self.ends = [int(x[0] + x[1]) for x in every]
        self.ordered = all(self.starts[r] == (self.ends[r - 1] if r else 0) for r in range(self.size))
        self._ends_tensor = {}

    def route(self, ids: torch.Tensor):
        """(positions into ids in send order, counts per destination rank) for int64 ``ids``."""
        n = self.size
        if self.ordered:
            ends = self._ends_tensor.get(ids.device)
            if ends is None:
                ends = self._ends_tensor[ids.device] = torch.tensor(self.ends, dtype=torch.int64, device=ids.device)
            dest = torch.searchsorted(ends, ids, right=True)
            order = torch.argsort(dest, stable=True)
            counts = torch.bincount(dest, minlength=n) if ids.numel() else torch.zeros(n, dtype=torch.int64,
                                                                                        device=ids.device)
            return order, counts
        pieces, counts = [], []
        for r in range(n):
            pos = ((ids >= self.starts[r]) & (ids < self.ends[r])).nonzero().view(-1)
            pieces.append(pos)
            counts.append(pos.numel())
        return torch.cat(pieces), torch.tensor(counts, dtype=torch.int64, device=ids.device)


def check_ids(op: str, group, ids, rows: int, device, collective: bool) -> torch.Tensor:
    """``ids`` as int64 on ``device``, after checking them (a tensor of int32 / int64, 1-D, every id
    in [0, rows)). collective: every rank learns whether any rank's ids were bad and raises."""
    error, out = None, None
    try:
        out = _checked(op, group, ids, rows, device)
    except (TypeError, ValueError, IndexError) as e:
        error = e
    if collective:
        agree_on_error(op, group, error, BAD_PEER)
    elif error is not None:
        raise error
    return out


def _checked(op, group, ids, rows, device) -> torch.Tensor:
    """The tensor layer's checks (access), with the embedding's device rule: ids on any device
    are moved to the rows' (pylibwholegraph's lookups take them on the CUDA device even for a
    table in host memory), as int64, the dtype the exchanges and the round-robin mapping use."""
    check_index_form(op, group, ids)
    out = ids.to(device=device, dtype=torch.int64)
    check_index_range(op, group, out, rows, "an embedding")
    return out


def _counts(op, group, send_counts: torch.Tensor, error) -> torch.Tensor:
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    if error is not None:
        raise error
    bad = (recv < 0).nonzero()
    if bad.numel():
        fail(op, group, BAD_PEER.format(rank=int(bad[0])))
    return recv


def to_owners(op: str, owners: Owners, ids: torch.Tensor | None, payload: torch.Tensor | None,
              error: BaseException | None, device, width: int = 0, dtype=torch.float32):
    """Sends every id (and its payload row) to each rank holding it. Returns (ids received, in
    source-rank order then position; their payload rows, or None; the plan for rows_back).
    A rank with ``error`` set takes part and raises it; the others raise naming it."""
    group, n = owners.group, owners.size
    if error is None:
        order, send_counts = owners.route(ids)
    else:
        order, send_counts = None, torch.full((n,), -1, dtype=torch.int64, device=device)
    recv_counts = _counts(op, group, send_counts, error)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    send_ids = ids.index_select(0, order)
    got_ids = torch.empty(sum(recvs), dtype=torch.int64, device=device)
    if n > 1:
        dist.all_to_all_single(got_ids, send_ids, recvs, sends, group=group)
    else:
        got_ids = send_ids
    got_rows = None
    if payload is not None:
        send_rows = payload.index_select(0, order)
        if n > 1:
            got_rows = torch.empty((sum(recvs), width), dtype=dtype, device=device)
            dist.all_to_all_single(got_rows, send_rows, recvs, sends, group=group)
        else:
            got_rows = send_rows
    return got_ids, got_rows, (order, sends, recvs)


def rows_back(owners: Owners, plan, rows: torch.Tensor) -> torch.Tensor:
    """The rows each holder found for the ids it received (in to_owners' order), sent back and put
    in the order the asker gave its ids."""
    order, sends, recvs = plan
    n = owners.size
    if n > 1:
        got = torch.empty((sum(sends),) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        dist.all_to_all_single(got, rows.contiguous(), sends, recvs, group=owners.group)
    else:
        got = rows
    out = torch.empty_like(got)
    out.index_copy_(0, order, got)
    return out
