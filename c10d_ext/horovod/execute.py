"""What a set's members run once a cycle found requests ready on all of them: Horovod's
validation (its messages, checked in its order), tensor fusion, and the data collectives on the
set's myccl group. Every member calls ``run`` with the same ready list, so every decision here
(what fails, what fuses with what, the order of the collectives) comes out the same on each."""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import records as R
from .exceptions import HorovodInternalError
from ._torch import all_gather_single, reduce_scatter_single
from .streams import OnStream

_REDUCE = {1: dist.ReduceOp.SUM, 3: dist.ReduceOp.MIN, 4: dist.ReduceOp.MAX, 5: dist.ReduceOp.PRODUCT}
_FUSABLE = (R.ALLREDUCE, R.ADASUM, R.ALLGATHER)


def _kind(rec) -> int:
    return rec[2] & 0xFF


def _dtype(rec) -> torch.dtype:
    return R.DTYPES[(rec[2] >> 8) & 0xFF]


def _on_cuda(rec) -> bool:
    return bool((rec[2] >> 16) & 1)


def _op(rec) -> int:
    return (rec[2] >> 20) & 0xF


def _ndim(rec) -> int:
    return (rec[2] >> 24) & 0xFF


def _shape(s) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def mismatch_message(descs: list) -> str:
    """Horovod's coordinator checks, first failure wins, comparing the lowest member that sent
    the tensor with each other one. A desc is Request.desc: (type, dtype, device, shape, pre,
    post, op, root)."""
    sent = [d for d in descs if d is not None]
    first = sent[0]
    t0 = first[0]
    for d in sent[1:]:
        if d[1] != first[1]:
            return f"Mismatched data types: One rank had type {first[1]}, but another rank had type {d[1]}."
    for d in sent[1:]:
        if d[0] != t0:
            return f"Mismatched operations: One rank did an {t0}, but another rank did an {d[0]}."
    if t0 in ("ALLREDUCE", "ADASUM", "BROADCAST", "REDUCESCATTER"):
        for d in sent[1:]:
            if d[3] != first[3]:
                return (f"Mismatched {t0} tensor shapes: One rank sent a tensor of shape {_shape(first[3])}, "
                        f"but another rank sent a tensor of shape {_shape(d[3])}.")
    if t0 in ("ALLREDUCE", "ADASUM", "REDUCESCATTER"):
        for d in sent[1:]:
            if (d[4], d[5]) != (first[4], first[5]):
                return (f"Mismatched prescale and/or postscale factors: One rank sent factors "
                        f"({first[4]:g}, {first[5]:g}), but another rank sent factors ({d[4]:g}, {d[5]:g}).")
    if t0 == "ALLREDUCE":
        for d in sent[1:]:
            if d[6] != first[6]:
                return (f"Mismatched reduction operation: One rank sent reduction op {first[6]}, "
                        f"but another rank sent reduction op {d[6]}.")
    if t0 in ("ALLGATHER", "ALLTOALL"):
        if descs[0] is not None and len(descs[0][3]) == 0:
            return f"Process-set rank zero tried to {t0} a rank-zero tensor."
        for d in sent[1:]:
            if len(d[3]) != len(first[3]):
                return (f"Mismatched {t0} tensor shapes: One rank sent a tensor of rank {len(first[3])}, "
                        f"but another rank sent a tensor of rank {len(d[3])}.")
        for d in sent[1:]:
            for k in range(1, len(first[3])):
                if d[3][k] != first[3][k]:
                    return (f"Mismatched {t0} tensor shapes: One rank sent a tensor with dimension {k} equal "
                            f"to {first[3][k]}, but another rank sent a tensor with dimension {k} equal to {d[3][k]}.")
    if t0 == "BROADCAST":
        for d in sent[1:]:
            if d[7] != first[7]:
                return (f"Mismatched BROADCAST root ranks: One rank specified root rank {first[7]}, "
                        f"but another rank specified root rank {d[7]}.")
    for d in sent[1:]:
        if d[2] != first[2]:
            return (f"Mismatched {t0} CPU/GPU device selection: One rank specified device {first[2]}, "
                    f"but another rank specified device {d[2]}.")
    return "Mismatched requests for one tensor name (the ranks sent different parameters)."


def run(ctrl, ready: list, tl) -> None:
    """ready: [(name hash, Announced)] in table order, the same on every member."""
    responses = []  # (kind, hash, recs by member, error text or None)
    mismatched = []
    for h, entry in ready:
        recs = entry.recs
        first = recs[min(recs)]
        kind = _kind(first)
        if len({r[1] for r in recs.values()}) > 1:
            mismatched.append(h)
            responses.append([kind, h, recs, None])
            continue
        err = None
        if ctrl.joined and kind in R.JOIN_UNSUPPORTED:
            err = R.JOIN_UNSUPPORTED[kind]
        elif kind in (R.ALLGATHER, R.ALLTOALL) and _ndim(recs[min(recs)]) == 0:
            err = f"Process-set rank zero tried to {R.KIND_NAMES[kind]} a rank-zero tensor."
        responses.append([kind, h, recs, err])
    if mismatched:
        _explain(ctrl, responses, mismatched)
    for bucket in _fuse(ctrl, responses):
        _execute(ctrl, bucket, tl)


def _explain(ctrl, responses, mismatched) -> None:
    """Mismatches are rare: one more exchange (every member knows the list) gets each member's
    description of the disagreeing tensors for Horovod's message."""
    mine = {h: ctrl.mine[h].desc for h in mismatched if h in ctrl.mine}
    every = [None] * ctrl.size
    dist.all_gather_object(every, mine, group=ctrl.group)
    for resp in responses:
        if resp[1] in mismatched:
            descs = [(e or {}).get(resp[1]) for e in every]
            resp[3] = mismatch_message(descs)


def _nbytes(resp) -> int:
    kind, _, recs, _ = resp
    first = recs[min(recs)]
    item = _dtype(first).itemsize
    if kind == R.ALLGATHER:
        rowsize = first[3] // first[4] if first[4] else 0
        return item * rowsize * sum(r[4] for r in recs.values())
    return item * first[3]


ALONE_BYTES = 1 << 20  # an allreduce this large runs on its own tensor: fusing it would only copy it twice


def _fuse(ctrl, responses):
    """Horovod's fusion: an allreduce/adasum (or allgather) takes later compatible ones (same
    kind, dtype, device, op and scale factors) while the bytes stay within the threshold. An
    allreduce of ALONE_BYTES or more is not fused: in place, it is reduced where it lies (one
    more collective costs less than copying it into a fusion buffer and back)."""
    threshold = ctrl.fusion_threshold
    if len(responses) == 1:
        yield responses
        return
    nbytes = [_nbytes(r) for r in responses]  # once each: the pairs below look at them again and again
    fusable = [r[3] is None and r[0] in _FUSABLE and not _alone(r[0], b) for r, b in zip(responses, nbytes)]
    taken = [False] * len(responses)
    for i, resp in enumerate(responses):
        if taken[i]:
            continue
        taken[i] = True
        bucket = [resp]
        if fusable[i] and threshold > 0:
            first = resp[2][min(resp[2])]
            key = (first[2] & 0xFFFFFF, first[5], first[6])
            size = nbytes[i]
            for j in range(i + 1, len(responses)):
                other = responses[j]
                if taken[j] or not fusable[j] or other[0] != resp[0]:
                    continue
                o = other[2][min(other[2])]
                if (o[2] & 0xFFFFFF, o[5], o[6]) != key or size + nbytes[j] > threshold:
                    continue
                size += nbytes[j]
                taken[j] = True
                bucket.append(other)
        yield bucket


def _alone(kind: int, nbytes: int) -> bool:
    return kind in (R.ALLREDUCE, R.ADASUM) and nbytes >= ALONE_BYTES


def _scale(t: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if t.is_floating_point():
        t.mul_(factor)
    else:  # Horovod scales integers through a double and truncates toward zero
        t.copy_((t.to(torch.float64) * factor).trunc())


def _execute(ctrl, bucket, tl) -> None:
    kind = bucket[0][0]
    reqs = [ctrl.mine.get(resp[1]) for resp in bucket]
    names = [r.name for r in reqs if r is not None]
    if bucket[0][3] is not None:  # an error response (never fused)
        for r in reqs:
            if r is not None:
                ctrl.complete(r, HorovodInternalError(f"{bucket[0][3]} (tensor {r.name})"))
        return
    if tl is not None:
        for n in names:
            tl.negotiate_end(n)
            tl.start(n, R.KIND_NAMES[kind])
    dev = next((r.device for r in reqs if r is not None and r.is_cuda), -1)
    if dev < 0 and ctrl.join_device >= 0 and _on_cuda(bucket[0][2][min(bucket[0][2])]):
        dev = ctrl.join_device  # a joined rank's zeros for the others' CUDA allreduce
    try:
        if dev < 0:
            _run(ctrl, kind, bucket, reqs, _new_cpu)
        else:  # on the set's stream, after the producers' ready events (streams.py)
            ready = [r.cuda_event for r in reqs if r is not None and r.cuda_event is not None]
            with OnStream(ctrl.streams, dev, ready) as on:
                _run(ctrl, kind, bucket, reqs, on.empty)
            for r in reqs:
                if r is not None:
                    r.cuda_event = on.done
    except Exception:
        for r in reqs:
            if r is not None and tl is not None:
                tl.end(r.name)
        raise
    for r in reqs:
        if r is None:
            continue
        if tl is not None:  # Horovod records the output's shape
            out = r.result if r.result is not None else r.output
            out = out[0] if isinstance(out, tuple) else out
            shape = list(out.shape) if out is not None else list(r.tensor.shape)
            tl.end(r.name, R.DTYPE_NAMES[R.DTYPE_CODE[r.dtype]], shape)
        ctrl.complete(r)


def _new_cpu(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _run(ctrl, kind, bucket, reqs, new) -> None:
    """`new(shape, like)`: where results and staging buffers are allocated (on CUDA, on the
    set's stream)."""
    if kind in (R.ALLREDUCE, R.ADASUM):
        _allreduce(ctrl, bucket, reqs, new)
    elif kind == R.ALLGATHER:
        _allgather(ctrl, bucket, reqs, new)
    elif kind == R.BROADCAST:
        _broadcast(ctrl, reqs[0])
    elif kind == R.ALLTOALL:
        _alltoall(ctrl, reqs[0], new)
    elif kind == R.REDUCESCATTER:
        _reducescatter(ctrl, bucket[0], reqs[0], new)


def _joined_zeros(rec, new) -> torch.Tensor:
    """A joined rank's share of an allreduce it did not submit: zeros (Horovod's join)."""
    return new((rec[3],), torch.empty(0, dtype=_dtype(rec))).zero_()


def _allreduce(ctrl, bucket, reqs, new) -> None:
    first = bucket[0][2][min(bucket[0][2])]
    op, pre, post = _op(first), R._bitsf(first[5]), R._bitsf(first[6])
    kind = bucket[0][0]
    if kind == R.ALLREDUCE and op == 0:  # Average: the sum times postscale / set size
        post = post / ctrl.size
    # The buffer the collective runs on: the tensor itself (in place) or a new tensor that is the
    # result (Horovod returns new tensors, never views); a fused buffer for several, copied out
    # into in-place tensors and new results at the end.
    if len(bucket) == 1 and reqs[0] is not None:
        r = reqs[0]
        if r.output is r.tensor:
            out = r.tensor
        else:
            out = new(r.tensor.shape, r.tensor)
            out.copy_(r.tensor)
        buf = out.view(-1)
        _reduce(ctrl, buf, [buf.numel()], kind, op, pre, post)
        if r.output is None:
            r.result = out
        return
    ins = [r.tensor.reshape(-1) if r is not None else _joined_zeros(resp[2][min(resp[2])], new)
           for r, resp in zip(reqs, bucket)]
    sizes = [t.numel() for t in ins]
    buf = new((sum(sizes),), ins[0])
    torch.cat(ins, out=buf)
    _reduce(ctrl, buf, sizes, kind, op, pre, post)
    parts = buf.split(sizes)
    dst, src = [], []
    for r, part in zip(reqs, parts):
        if r is None:
            continue
        if r.output is None:
            r.result = new(r.tensor.shape, r.tensor)
            dst.append(r.result.view(-1))
        else:
            dst.append(r.output.view(-1))
        src.append(part)
    if dst:
        torch._foreach_copy_(dst, src)


def _reduce(ctrl, buf, sizes, kind, op, pre, post) -> None:
    _scale(buf, pre)
    if kind == R.ADASUM:
        from .adasum import adasum_allreduce_

        adasum_allreduce_(buf, sizes, ctrl.group, ctrl.entry.ranks)
    elif ctrl.size > 1:
        dist.all_reduce(buf, op=_REDUCE.get(op, dist.ReduceOp.SUM), group=ctrl.group)
    _scale(buf, post)


def _allgather(ctrl, bucket, reqs, new) -> None:
    """Ranks' first dimensions may differ: each member's contributions of all the bucket's
    tensors go in one padded block, one all_gather, then each output is cut out of the blocks."""
    size = ctrl.size
    counts, rows = [], []  # per tensor: elements each member contributes, rows of the result
    for resp, r in zip(bucket, reqs):  # every member sent each one (no allgather while joined)
        counts.append([resp[2][m][4] * r.rowsize for m in range(size)])
        rows.append(sum(resp[2][m][4] for m in range(size)))
    per_member = [sum(c[m] for c in counts) for m in range(size)]
    block = max(per_member)
    mine = [r.tensor.reshape(-1) for r in reqs]
    if len(bucket) == 1 and len(set(per_member)) == 1:
        r = reqs[0]
        rest = tuple(r.tensor.shape[1:])
        out = new((rows[0],) + rest, r.tensor)
        if size > 1:
            all_gather_single(out.view(-1), mine[0], group=ctrl.group)
        else:
            out.view(-1).copy_(mine[0])
        r.result = out
        return
    send = new((block,), reqs[0].tensor)
    if mine:
        torch.cat(mine, out=send[:per_member[ctrl.me]])
    recv = new((block * size,), reqs[0].tensor)
    all_gather_single(recv, send, group=ctrl.group)
    offsets = [m * block for m in range(size)]
    for t, (r, c) in enumerate(zip(reqs, counts)):
        pieces = []
        for m in range(size):
            pieces.append(recv[offsets[m]:offsets[m] + c[m]])
            offsets[m] += c[m]
        r.result = new((rows[t],) + tuple(r.tensor.shape[1:]), r.tensor)
        torch.cat(pieces, out=r.result.view(-1))


def _broadcast(ctrl, r) -> None:
    root = ctrl.entry.ranks.index(r.root)
    out = r.output
    if out is not r.tensor and ctrl.me == root:
        out.copy_(r.tensor)
    if ctrl.size > 1:
        dist.broadcast(out, group_src=root, group=ctrl.group)


def _alltoall(ctrl, r, new) -> None:
    size = ctrl.size
    send_splits = r.splits.to(torch.int64)
    recv_splits = torch.empty(size, dtype=torch.int64)
    if size > 1:
        dist.all_to_all_single(recv_splits, send_splits, group=ctrl.group)
    else:
        recv_splits.copy_(send_splits)
    sends = send_splits.tolist()
    recvs = recv_splits.tolist()
    rest = tuple(r.tensor.shape[1:])
    inp = r.tensor[:sum(sends)]
    out = new((sum(recvs),) + rest, r.tensor)
    if size > 1:
        dist.all_to_all_single(out, inp, output_split_sizes=recvs, input_split_sizes=sends, group=ctrl.group)
    else:
        out.copy_(inp)
    r.result = (out, recv_splits.to(torch.int32).to(r.splits.device))


def _reducescatter(ctrl, resp, r, new) -> None:
    """Rows split as Horovod does: the first dim0 % size members get one row more. Uneven
    splits go through one padded reduce_scatter (every block one row longer)."""
    size = ctrl.size
    first = resp[2][min(resp[2])]
    pre, post = R._bitsf(first[5]), R._bitsf(first[6])
    t = r.tensor
    rest = tuple(t.shape[1:])
    d, extra = divmod(t.shape[0], size)
    rows = [d + (1 if m < extra else 0) for m in range(size)]
    inp = t.clone() if pre != 1.0 else t
    _scale(inp, pre)
    if size == 1:
        out = inp.clone() if inp is t else inp
    elif extra == 0:
        out = new((d,) + rest, t)
        reduce_scatter_single(out, inp.contiguous(), group=ctrl.group)
    else:
        padded = new((size * (d + 1),) + rest, t).zero_()
        off = 0
        for m in range(size):
            padded[m * (d + 1):m * (d + 1) + rows[m]] = inp[off:off + rows[m]]
            off += rows[m]
        got = new((d + 1,) + rest, t)
        reduce_scatter_single(got, padded, group=ctrl.group)
        out = got[:rows[ctrl.me]].clone() if rows[ctrl.me] < d + 1 else got
    _scale(out, post)
    r.result = out
