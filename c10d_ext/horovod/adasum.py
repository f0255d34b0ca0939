"""Adasum (adaptive summation) for c10d_ext.horovod: the Vector-Halving Distance-Doubling (VHDD)
reduction over a torch.distributed group, and a local reference of the same arithmetic.

The pairwise rule, for two vectors a and b (one original tensor at a time):

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

where a coefficient is 1 when that vector's squared norm is below sqrt(DBL_MIN). Dot products and
squared norms are accumulated in float64; the combine uses float64 coefficients for float32 and
float64 buffers and float32 coefficients (and float32 arithmetic) for float16 buffers.

VHDD over P = 2^k ranks: at levels L = 1, 2, 4, ..., P/2 a rank r exchanges half of the segment
it currently owns with r XOR L (the rank with bit L clear keeps the first half, floor(n/2)
elements, the other keeps the rest), computes partial (a.b, |a|^2, |b|^2) per original tensor on
the half it keeps (a = the lower, "left" side), sums those over the 2L ranks of its block, and
combines its half. At the end each rank owns 1/P of the result; the same exchanges in reverse
order (distance halving) give every rank the whole vector. Every element of the result is
computed by exactly one rank, so all ranks end with the same bits.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Sequence

import torch
import torch.distributed as dist

from ._torch import all_gather_single

__all__ = ["adasum_allreduce_", "adasum_reference", "pairwise_coefficients"]

SQRT_DBL_MIN = sys.float_info.min ** 0.5  # sqrt(DBL_MIN), about 1.49e-154
DEFAULT_CHUNK_BYTES = 1 << 30  # HOROVOD_ADASUM_MPI_CHUNK_SIZE's default
SUPPORTED = (torch.float16, torch.float32, torch.float64)

_P2P_HAS_GROUP_PEER = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters


# ---- shared arithmetic ------------------------------------------------------------------------

def pairwise_coefficients(dot: torch.Tensor, anormsq: torch.Tensor, bnormsq: torch.Tensor):
    """Per-tensor float64 coefficients (acoeff, bcoeff) from float64 dot products and squared
    norms (any shape, elementwise)."""
    one = torch.ones_like(dot)
    acoeff = torch.where(anormsq >= SQRT_DBL_MIN, 1.0 - dot / anormsq * 0.5, one)
    bcoeff = torch.where(bnormsq >= SQRT_DBL_MIN, 1.0 - dot / bnormsq * 0.5, one)
    return acoeff, bcoeff


def _block_elems(device: torch.device) -> int:
    """Elements handled per step of the local arithmetic: small on the CPU, so the float64
    temporaries stay in cache (whole-buffer temporaries are several times slower), one step on a GPU."""
    return 1 << 16 if device.type == "cpu" else 1 << 26


def _blocks(counts: Sequence[int], block: int):
    """Cuts a run of tensors (element counts `counts`) into blocks of at most `block` elements.
    Yields (offset, length, i0, lens): the block covers tensors i0, i0+1, ... with lens[j]
    elements of tensor i0+j (zeros allowed)."""
    total = sum(counts)
    off = i = used = 0  # used: elements of tensor i already covered
    while off < total:
        n = min(block, total - off)
        while counts[i] == used:
            i, used = i + 1, 0
        i0, lens, left = i, [], n
        while left:
            take = min(counts[i] - used, left)
            lens.append(take)
            left -= take
            used += take
            if left and used == counts[i]:
                i, used = i + 1, 0
        yield off, n, i0, lens
        off += n


def _segment_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of `values` (float64) of the given lengths (zeros allowed)."""
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)


def _dot_norms(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """[3, k] float64: per tensor (a.b, |a|^2, |b|^2) over runs of `counts` elements."""
    out = torch.zeros(3, len(counts), dtype=torch.float64, device=a.device)
    for off, n, i0, lens in _blocks(counts, _block_elems(a.device)):
        a64 = a[off:off + n].to(torch.float64)
        b64 = b[off:off + n].to(torch.float64)
        if len(lens) == 1:  # inside one tensor (the usual case for large ones)
            out[:, i0] += torch.stack([torch.dot(a64, b64), torch.dot(a64, a64), torch.dot(b64, b64)])
            continue
        lengths = torch.tensor(lens, dtype=torch.long, device=a.device)
        out[:, i0:i0 + len(lens)] += torch.stack([
            _segment_sum(a64 * b64, lengths),
            _segment_sum(a64 * a64, lengths),
            _segment_sum(b64 * b64, lengths),
        ])
    return out


def _scaled_add_(own: torch.Tensor, other: torch.Tensor, own_coeff: torch.Tensor,
                 other_coeff: torch.Tensor, counts: Sequence[int]) -> None:
    """own <- own_coeff * own + other_coeff * other, with one coefficient per run of `counts`
    elements (float64 per-tensor coefficients and arithmetic; float32 for float16 buffers)."""
    work = torch.float32 if own.dtype == torch.float16 else torch.float64
    ca_all, cb_all = own_coeff.to(work), other_coeff.to(work)
    for off, n, i0, lens in _blocks(counts, _block_elems(own.device)):
        if len(lens) == 1:
            ca, cb = ca_all[i0], cb_all[i0]
        else:
            lengths = torch.tensor(lens, dtype=torch.long, device=own.device)
            ca = torch.repeat_interleave(ca_all[i0:i0 + len(lens)], lengths, output_size=n)
            cb = torch.repeat_interleave(cb_all[i0:i0 + len(lens)], lengths, output_size=n)
        dst, src = own[off:off + n], other[off:off + n]
        if dst.dtype == work:
            dst.mul_(ca).addcmul_(src, cb)
        else:
            dst.copy_(dst.to(work).mul_(ca).addcmul_(src.to(work), cb))


def _split_counts(counts: list[int], first: int) -> tuple[list[int], list[int]]:
    """Splits per-tensor counts of a segment at element `first`: (counts of the first part,
    counts of the rest)."""
    head, tail = [], []
    seen = 0
    for c in counts:
        h = min(c, max(0, first - seen))
        head.append(h)
        tail.append(c - h)
        seen += c
    return head, tail


def _check_sizes(numel: int, sizes: Sequence[int]) -> list[int]:
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"Adasum: negative tensor size in {sizes}")
    if sum(sizes) != numel:
        raise ValueError(f"Adasum: sizes add up to {sum(sizes)} elements, the buffer has {numel}")
    return sizes


# ---- local reference ----------------------------------------------------------------------------

def adasum_reference(vectors: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """Adasum of `vectors` (one per rank, in rank order; same dtype and element count) computed
    locally as VHDD's binary tree: level 1 combines (0,1), (2,3), ..., the next level combines
    the pairs' results pairwise, and so on. Coefficients per original tensor (`sizes`). Each level's
    result is rounded to the vectors' dtype, as in the distributed algorithm. Returns a new 1-D
    tensor."""
    if len(vectors) == 0:
        raise ValueError("Adasum: no vectors")
    n = len(vectors)
    if n & (n - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    dtype = vectors[0].dtype
    if dtype not in SUPPORTED:
        raise RuntimeError("Unsupported data type")
    level = [v.detach().reshape(-1).clone() for v in vectors]
    numel = level[0].numel()
    if any(v.dtype != dtype or v.numel() != numel for v in level):
        raise ValueError("Adasum: the vectors differ in dtype or element count")
    sizes = _check_sizes(numel, sizes)
    while len(level) > 1:
        nxt = []
        for left, right in zip(level[0::2], level[1::2]):
            dot, an, bn = _dot_norms(left, right, sizes)
            ac, bc = pairwise_coefficients(dot, an, bn)
            _scaled_add_(left, right, ac, bc, sizes)
            nxt.append(left)
        level = nxt
    return level[0]


# ---- the distributed reduction --------------------------------------------------------------------

def _chunk_elems(elem_size: int) -> int:
    raw = os.environ.get("HOROVOD_ADASUM_MPI_CHUNK_SIZE", "").strip()
    chunk_bytes = int(raw) if raw else DEFAULT_CHUNK_BYTES
    return max(1, chunk_bytes // elem_size)


class _Peer:
    """Point-to-point with one group-relative peer."""

    def __init__(self, group, group_peer: int, chunk: int):
        self.group = group
        self.chunk = chunk
        if _P2P_HAS_GROUP_PEER:
            self.kw = {"group_peer": group_peer}
        else:  # older torch: P2POp wants the global rank
            self.kw = {"peer": dist.get_global_rank(group, group_peer)}

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Sends `send` and receives `recv` (both contiguous), in chunks of at most `chunk`
        elements each way; the peer knows both lengths, so the chunks pair up."""
        ns, nr = send.numel(), recv.numel()
        s = r = 0
        while s < ns or r < nr:
            ops = []
            if s < ns:
                ops.append(dist.P2POp(dist.isend, send[s:s + self.chunk], group=self.group, **self.kw))
            if r < nr:
                ops.append(dist.P2POp(dist.irecv, recv[r:r + self.chunk], group=self.group, **self.kw))
            for work in dist.batch_isend_irecv(ops) or []:
                work.wait()
            s += self.chunk
            r += self.chunk


def adasum_allreduce_(buf: torch.Tensor, sizes: Sequence[int], group, ranks: Sequence[int]) -> None:
    """In place: `buf` (1-D contiguous float16/32/64, CPU or CUDA; the concatenation of tensors
    of `sizes` elements) becomes, on every rank of `group`, Adasum over the group's ranks in rank
    order, with coefficients per tensor. `ranks` are the group's members as global ranks, sorted.
    The group size must be a power of 2. Pre/postscale are the caller's."""
    if buf.dtype not in SUPPORTED:
        raise RuntimeError("Unsupported data type")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("Adasum: the buffer must be a 1-D contiguous tensor")
    sizes = _check_sizes(buf.numel(), sizes)
    size = dist.get_world_size(group)
    if len(ranks) != size:
        raise ValueError(f"Adasum: {len(ranks)} ranks given for a group of {size}")
    if size & (size - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    if size == 1 or buf.numel() == 0:
        return
    rank = dist.get_rank(group)
    device = buf.device
    k = len(sizes)
    chunk = _chunk_elems(buf.element_size())

    recv_space = torch.empty((buf.numel() + 1) // 2, dtype=buf.dtype, device=device)
    start, counts = 0, sizes  # the segment this rank owns, and its per-tensor element counts
    history = []  # per level: ((start, length) of the half I keep, (start, length) of the other)
    triples = torch.zeros(3 * k, dtype=torch.float64, device=device)
    gathered = torch.empty(size * 3 * k, dtype=torch.float64, device=device)

    level = 1
    while level < size:
        peer = _Peer(group, rank ^ level, chunk)
        length = sum(counts)
        first = length // 2
        head, tail = _split_counts(counts, first)
        left = (rank & level) == 0
        if left:  # keep the first half, send the second
            mine, theirs, counts = (start, first), (start + first, length - first), head
        else:
            mine, theirs, counts = (start + first, length - first), (start, first), tail
        history.append((mine, theirs))
        own = buf.narrow(0, *mine)
        recv = recv_space.narrow(0, 0, mine[1])
        peer.sendrecv(buf.narrow(0, *theirs), recv)

        # Partial a.b, |a|^2, |b|^2 on my half; a is the left side's data.
        if left:
            part = _dot_norms(own, recv, counts)
        else:
            part = _dot_norms(recv, own, counts)
        triples.copy_(part.reshape(-1))
        # Summed over this level's 2L-rank block: every rank gives its triples to the group,
        # each block adds its own members' in rank order (the same sum on each of them).
        all_gather_single(gathered, triples, group=group)
        block = 2 * level
        lo = (rank // block) * block
        rows = gathered.view(size, 3, k)
        total = rows[lo].clone()
        for r in range(lo + 1, lo + block):
            total += rows[r]
        ac, bc = pairwise_coefficients(total[0], total[1], total[2])
        if left:
            _scaled_add_(own, recv, ac, bc, counts)
        else:
            _scaled_add_(own, recv, bc, ac, counts)
        start = mine[0]
        level <<= 1

    # Distance-halving allgather: give my part to the peer of each level, take theirs.
    level = size >> 1
    while level >= 1:
        mine, theirs = history.pop()
        _Peer(group, rank ^ level, chunk).sendrecv(buf.narrow(0, *mine), buf.narrow(0, *theirs))
        level >>= 1
