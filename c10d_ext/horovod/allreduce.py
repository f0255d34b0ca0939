"""Horovod's allreduce family on myccl: ``allreduce`` (with autograd), ``allreduce_``,
``allreduce_async`` / ``_async_``, and their grouped forms, each through the one-step path where
the set has it (agreed.py: held asynchronous ops, synchronous ops run on the caller's thread)
and through the set's queue otherwise. ``mpi_ops`` exports them with every other op; the
gradients of ``collectives`` use them."""

from __future__ import annotations

import torch

from .. import _C as _ext
from . import agreed
from .basics import is_homogeneous, local_size, nccl_built, size
from .compression import Compression
from .exceptions import HorovodInternalError
from .handles import (_REDUCE_TYPES, Adasum, Average, _average_compat, _check_tensor, _entry, _name,
                      _next_handle, _same_device, _submit, _sync, _wait, synchronize)
from .process_sets import global_process_set
from .records import ADASUM, ALLREDUCE, Request

# An allreduce_async's one call: its handle, with flags, when its set holds it (agreed.py; the set's
# thread runs a held list; the caller of agreed.added wakes it), 0 when not held, -1 a held name.
_hold = _ext._hvd_hold


def _adasum_checks(tensor, process_set) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if tensor.is_cuda and nccl_built():
        if not is_homogeneous():
            raise NotImplementedError("Running GPU Adasum on heterogeneous cluster is not supported yet.")
        nodes = size() // local_size()
        if nodes & (nodes - 1):
            raise NotImplementedError("Running GPU Adasum with non-power of 2 nodes is not supported yet.")
    # One algorithm for CPU and CUDA tensors here (VHDD over all ranks): it needs a power of 2.
    if size() & (size() - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    if tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        raise HorovodInternalError("Unsupported data type")


def _allreduce_entry(tensors, op, process_set):
    """The set of an allreduce, once its arguments passed Horovod's checks."""
    entry = _entry(process_set, "Allreduce")
    if op == Adasum:
        _adasum_checks(tensors[0], process_set)
    return entry


def _allreduce_requests(tensors, outputs, names, op, pre, post):
    kind = ADASUM if op == Adasum else ALLREDUCE
    return [Request(kind, nm, t, out, op=op if kind == ALLREDUCE else 0, pre=pre, post=post)
            for nm, t, out in zip(names, tensors, outputs)]


_GROUP_NAMES: dict = {}  # (base, n) -> the names of a grouped op's tensors


def _names(prefix: str, name, handle: int, n: int) -> tuple:
    """The names of an allreduce's tensors (a grouped op's are numbered "_1of3" ...)."""
    base = _name(prefix, name, handle)
    if prefix == "allreduce":
        return (base,)
    names = _GROUP_NAMES.get((base, n))
    if names is None:
        if len(_GROUP_NAMES) > 1 << 12:
            _GROUP_NAMES.clear()
        names = _GROUP_NAMES[(base, n)] = tuple(f"{base}_{i + 1}of{n}" for i in range(n))
    return names


def _allreduce_fast(tensors, inplace, prefix, name, op, pre, post, process_set):
    """A synchronous allreduce's one-step path (agreed.allreduce_now): (its results or None, its
    handle number or None). None results: the op goes through the queue as an asynchronous one
    would, under that handle number when it has one."""
    if not agreed.can_offer(tensors, op, pre):
        return None, None
    entry = _allreduce_entry(tensors, op, process_set)
    c = entry.controller
    if c is None or not (c.agreed_ok or c.size == 1):
        return None, None
    h = _next_handle()
    out = agreed.allreduce_now(c, tensors, inplace, _names(prefix, name, h, len(tensors)), op, post)
    if out is None:
        return None, h
    return (out if isinstance(out, list) else _wait(out)), h


@_sync
def _allreduce_sync(tensor, output, name, op, prescale_factor, postscale_factor, process_set, h=None):
    return synchronize(_allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set,
                                        h=h))


def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set, timed=True, h=None):
    """`timed` False: the caller is sure to synchronize the handle (DistributedOptimizer), so the
    op, if held, never runs on the set's timer (agreed.defer). `h`: the op's handle number, when
    a synchronous op took it already."""
    _check_tensor(tensor, _REDUCE_TYPES)
    entry = _allreduce_entry((tensor,), op, process_set)
    if h is None:
        h = _next_handle()
    names = _names("allreduce", name, h, 1)
    if agreed.can_defer((tensor,), op, prescale_factor) and entry.controller is not None:
        if agreed.defer(entry.controller, [tensor], output is not None, names, op, postscale_factor, True, timed, h):
            return h
    reqs = _allreduce_requests([tensor], [output], names, op, prescale_factor, postscale_factor)
    if output is None:
        return _submit(entry, reqs, lambda: reqs[0].result, h)
    return _submit(entry, reqs, lambda: output, h)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    # Held in one call when the set is idle (agreed.py). Written out here and in allreduce_async_
    # rather than in a helper, whose call is a measurable share of the op (docs/HOROVOD.md, "Cost").
    if average is None and prescale_factor == 1.0:
        code = _hold(process_set.process_set_id, tensor, name, False, Average if op is None else op, postscale_factor)
        if code > 0 and not code & 3:
            return code >> 2
        if code:
            return agreed.added(agreed.OWNERS[process_set.process_set_id], code)
    op = _average_compat(op, average)
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    if average is None and prescale_factor == 1.0:
        code = _hold(process_set.process_set_id, tensor, name, True, Average if op is None else op, postscale_factor)
        if code > 0 and not code & 3:
            return code >> 2
        if code:
            return agreed.added(agreed.OWNERS[process_set.process_set_id], code)
    op = _average_compat(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    op = _average_compat(op, average)
    out, h = _allreduce_fast([tensor], True, "allreduce", name, op, prescale_factor, postscale_factor, process_set)
    if out is not None:
        return out[0]
    return _allreduce_sync(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set, h)


class HorovodAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor, ctx.process_set = prescale_factor, postscale_factor, process_set
        return _allreduce_now(tensor, average, name, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        return (allreduce(grad_output, average=ctx.average, op=ctx.op, prescale_factor=ctx.prescale_factor,
                          postscale_factor=ctx.postscale_factor, process_set=ctx.process_set),
                None, None, None, None, None, None)


def _allreduce_now(tensor, average, name, op, prescale_factor, postscale_factor, process_set):
    op = _average_compat(op, average)
    out, h = _allreduce_fast([tensor], False, "allreduce", name, op, prescale_factor, postscale_factor, process_set)
    if out is not None:
        return out[0]
    return _allreduce_sync(tensor, None, name, op, prescale_factor, postscale_factor, process_set, h)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    tensor_compressed, ctx = compression.compress(tensor)
    if tensor_compressed.requires_grad and torch.is_grad_enabled():
        summed = HorovodAllreduce.apply(tensor_compressed, average, name, op, prescale_factor, postscale_factor,
                                        process_set)
    else:  # nothing for autograd to record: the same op without the Function's own cost
        summed = _allreduce_now(tensor_compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(summed, ctx)


# ---- grouped allreduce ------------------------------------------------------------------------
def _grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set,
                             timed=True, h=None):
    _check_tensor(tensors[0], _REDUCE_TYPES)
    _same_device(tensors)
    for t in tensors[1:]:
        if not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
    entry = _allreduce_entry(tensors, op, process_set)
    if h is None:
        h = _next_handle()
    names = _names("grouped_allreduce", name, h, len(tensors))
    if agreed.can_defer(tensors, op, prescale_factor) and entry.controller is not None:
        if agreed.defer(entry.controller, list(tensors), outputs is not None, names, op, postscale_factor, False,
                        timed, h):
            return h
    reqs = _allreduce_requests(tensors, outputs or [None] * len(tensors), names, op, prescale_factor,
                               postscale_factor)
    if outputs is None:
        return _submit(entry, reqs, lambda: tuple(r.result for r in reqs), h)
    return _submit(entry, reqs, lambda: tuple(outputs), h)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    op = _average_compat(op, average)
    return _grouped_allreduce_async(tensors, None, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    op = _average_compat(op, average)
    return _grouped_allreduce_async(tensors, list(tensors), name, op, prescale_factor, postscale_factor,
                                    process_set)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    op = _average_compat(op, average)
    out, h = _allreduce_fast(list(tensors), True, "grouped_allreduce", name, op, prescale_factor, postscale_factor,
                             process_set)
    if out is not None:
        return tuple(out)
    return _grouped_sync(tensors, list(tensors), name, op, prescale_factor, postscale_factor, process_set, h)


@_sync
def _grouped_sync(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set, h=None):
    return synchronize(_grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor,
                                                process_set, h=h))


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor, ctx.process_set = prescale_factor, postscale_factor, process_set
        op = _average_compat(op, average)
        out, h = _allreduce_fast(list(tensors), False, "grouped_allreduce", name, op, prescale_factor,
                                 postscale_factor, process_set)
        if out is not None:
            return tuple(out)
        return _grouped_sync(list(tensors), None, name, op, prescale_factor, postscale_factor, process_set, h)

    @staticmethod
    def backward(ctx, *grad_output):
        grads = grouped_allreduce(list(grad_output), average=ctx.average, op=ctx.op,
                                  prescale_factor=ctx.prescale_factor, postscale_factor=ctx.postscale_factor,
                                  process_set=ctx.process_set)
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    if compression is Compression.none:  # what none's compress and decompress do, without a call per tensor
        return list(HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                                  *tensors))
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    summed = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor, process_set,
                                           *compressed)
    return [compression.decompress(t, c) for t, c in zip(summed, ctxs)]
