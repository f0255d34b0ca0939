"""The operations of ``horovod.torch`` (its ``mpi_ops``): the same names, signatures, defaults,
return values and exceptions, each enqueuing requests on a process set's controller.

Enqueue-time argument errors are ValueError (Horovod's invalid-argument statuses); an op before
``init`` or after a failure raises HorovodInternalError; what the ranks disagree on comes out of
``synchronize`` as HorovodInternalError on every rank. Handles are ints from 1, reset by
``shutdown``; ``synchronize`` of an unknown handle returns None, ``poll`` of one raises.
"""

from __future__ import annotations

import threading
import warnings

import torch

from . import agreed, basics, controller as C
from .basics import (STATE, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,  # noqa: F401
                     gloo_enabled, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .compression import Compression
from .exceptions import NOT_INITIALIZED, HorovodInternalError
from .process_sets import ProcessSet, _lookup, global_process_set  # noqa: F401

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_REDUCE_TYPES = {torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16}
_MOVE_TYPES = _REDUCE_TYPES | {torch.uint8, torch.int8, torch.int16}

_handles: dict[int, C.Handle] = {}
_local = threading.local()  # .sync: inside a synchronous op, whose caller drives the cycles
_handles_lock = threading.Lock()
_next = [0]


def init(*args, **kwargs):
    """``init(comm=None, process_sets=None)``: see basics.init. Idempotent until shutdown."""
    basics.init(*args, **kwargs)
    _open_env_timeline()


def shutdown():
    with _handles_lock:
        _handles.clear()
        _next[0] = 0
    stop_timeline_quietly()
    basics.shutdown()


# ---- handles ----------------------------------------------------------------------------------
def _new_handle(handle: C.Handle) -> int:
    with _handles_lock:
        _next[0] += 1
        _handles[_next[0]] = handle
        return _next[0]


def _peek_handle() -> int:
    return _next[0] + 1


def poll(handle: int) -> bool:
    h = _handles.get(handle)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return h.event.is_set()


def synchronize(handle: int):
    h = _handles.get(handle)
    if h is None:
        return None
    try:
        return _wait(h)
    finally:
        with _handles_lock:
            _handles.pop(handle, None)


def _wait(h: C.Handle):
    if h.ctrl is not None:
        h.ctrl.drive(h)
    while not h.event.wait(0.1):
        pass
    if h.error is not None:
        raise HorovodInternalError(str(h.error))
    if h.cuda_event is not None:
        torch.cuda.current_stream().wait_event(h.cuda_event)
    return h.finish()


# ---- enqueueing -------------------------------------------------------------------------------
def _average_compat(op, average):
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning)
        return Average if average else Sum
    return Average if op is None else op


def _check_tensor(tensor, types) -> None:
    if tensor.dtype not in types:
        raise ValueError("Tensor type %s is not supported." % tensor.type())
    if not tensor.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")


def _entry(process_set, op: str):
    if not STATE.initialized:
        raise HorovodInternalError(NOT_INITIALIZED)
    return _lookup(process_set, op)


def _name(prefix: str, name, handle: int) -> str:
    return f"{prefix}.{name}" if name else f"{prefix}.noname.{handle}"


def _submit(entry, reqs, finish) -> int:
    for r in reqs:
        if r.is_cuda:
            r.cuda_event = torch.cuda.Event()
            r.cuda_event.record(torch.cuda.current_stream(r.tensor.device))
    handle = C.Handle(reqs, finish)
    handle.ctrl = C.controller_for(entry)
    handle.ctrl.submit(reqs, wake=not getattr(_local, "sync", False))
    return _new_handle(handle)


def _sync(fn):
    """Marks a synchronous op: its requests do not wake the set's thread, the caller's
    synchronize runs the cycle (unless the thread is in one already)."""
    def wrapper(*args, **kwargs):
        outer = getattr(_local, "sync", False)
        _local.sync = True
        try:
            return fn(*args, **kwargs)
        finally:
            _local.sync = outer
    wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
    return wrapper


def _same_device(tensors) -> None:
    if len({t.device for t in tensors}) > 1:
        raise HorovodInternalError("Tensors in list must be on same device.")


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


def _allreduce_requests(tensors, outputs, prefix, name, op, pre, post, process_set):
    entry = _entry(process_set, "Allreduce")
    if op == Adasum:
        _adasum_checks(tensors[0], process_set)
    base = _name(prefix, name, _peek_handle())
    kind = C.ADASUM if op == Adasum else C.ALLREDUCE
    n = len(tensors)
    names = [base] if prefix == "allreduce" else [f"{base}_{i + 1}of{n}" for i in range(n)]
    return entry, [C.Request(kind, nm, t, out, op=op if kind == C.ALLREDUCE else 0, pre=pre, post=post)
                   for nm, t, out in zip(names, tensors, outputs)]


_GROUP_NAMES: dict = {}  # (base, n) -> the names of a grouped op's tensors


def _allreduce_fast(tensors, inplace, prefix, name, op, pre, post, process_set):
    """A synchronous allreduce's one-step path (agreed.allreduce_now): its results, or None when
    the op goes through the queue as an asynchronous one would."""
    if not agreed.can_offer(tensors, op, pre):
        return None
    entry = _entry(process_set, "Allreduce")
    c = entry.controller
    if c is None or not (c.agreed_ok or c.size == 1):
        return None
    base = _name(prefix, name, _next[0] + 1)
    if prefix == "allreduce":
        names = (base,)
    else:
        n = len(tensors)
        names = _GROUP_NAMES.get((base, n))
        if names is None:
            if len(_GROUP_NAMES) > 1 << 12:
                _GROUP_NAMES.clear()
            names = _GROUP_NAMES[(base, n)] = tuple(f"{base}_{i + 1}of{n}" for i in range(n))
    out = agreed.allreduce_now(c, tensors, inplace, names, op, post)
    if out is None:
        return None
    with _handles_lock:  # the handle number the op would have had (unnamed ops are named by it)
        _next[0] += 1
    return out if isinstance(out, list) else _wait(out)


@_sync
def _allreduce_sync(tensor, output, name, op, prescale_factor, postscale_factor, process_set):
    return synchronize(_allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set))


def _allreduce_async(tensor, output, name, op, prescale_factor, postscale_factor, process_set):
    _check_tensor(tensor, _REDUCE_TYPES)
    entry, reqs = _allreduce_requests([tensor], [output], "allreduce", name, op, prescale_factor,
                                      postscale_factor, process_set)
    if output is None:  # not in place: the result is a view of what the collective reduced
        return _submit(entry, reqs, lambda: reqs[0].result)
    return _submit(entry, reqs, lambda: output)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    op = _average_compat(op, average)
    return _allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    op = _average_compat(op, average)
    return _allreduce_async(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    op = _average_compat(op, average)
    out = _allreduce_fast([tensor], True, "allreduce", name, op, prescale_factor, postscale_factor, process_set)
    if out is not None:
        return out[0]
    return _allreduce_sync(tensor, tensor, name, op, prescale_factor, postscale_factor, process_set)


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
    out = _allreduce_fast([tensor], False, "allreduce", name, op, prescale_factor, postscale_factor, process_set)
    if out is not None:
        return out[0]
    return _allreduce_sync(tensor, None, name, op, prescale_factor, postscale_factor, process_set)


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
def _grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set):
    _check_tensor(tensors[0], _REDUCE_TYPES)
    _same_device(tensors)
    for t in tensors[1:]:
        if not t.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
    entry, reqs = _allreduce_requests(tensors, outputs or [None] * len(tensors), "grouped_allreduce", name, op, prescale_factor,
                                      postscale_factor, process_set)
    if outputs is None:
        return _submit(entry, reqs, lambda: tuple(r.result for r in reqs))
    return _submit(entry, reqs, lambda: tuple(outputs))


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
    out = _allreduce_fast(list(tensors), True, "grouped_allreduce", name, op, prescale_factor, postscale_factor,
                          process_set)
    if out is not None:
        return tuple(out)
    return _grouped_sync(tensors, list(tensors), name, op, prescale_factor, postscale_factor, process_set)


@_sync
def _grouped_sync(tensors, outputs, name, op, prescale_factor, postscale_factor, process_set):
    return synchronize(_grouped_allreduce_async(tensors, outputs, name, op, prescale_factor, postscale_factor,
                                                process_set))


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.average, ctx.op = average, op
        ctx.prescale_factor, ctx.postscale_factor, ctx.process_set = prescale_factor, postscale_factor, process_set
        op = _average_compat(op, average)
        out = _allreduce_fast(list(tensors), False, "grouped_allreduce", name, op, prescale_factor, postscale_factor,
                              process_set)
        if out is not None:
            return tuple(out)
        return _grouped_sync(list(tensors), None, name, op, prescale_factor, postscale_factor, process_set)

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


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Allgathers the indices and values of a sparse tensor; returns a function that waits and
    builds the (uncoalesced) sum, divided by the set's size for Average."""
    t = tensor
    indices_handle = allgather_async(t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                                     process_set=process_set)
    values_handle = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle():
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        values = values if op != Average else values / process_set.size()
        if indices.dim() == 0 or values.dim() == 0:
            return t.new().resize_as_(t)
        return t.new(indices.transpose(0, 1), values, t.size())

    return handle


# ---- allgather --------------------------------------------------------------------------------
def _allgather_requests(tensors, prefix, name, process_set):
    entry = _entry(process_set, "Allgather")
    base = _name(prefix, name, _peek_handle())
    n = len(tensors)
    names = [base] if prefix == "allgather" else [f"{base}_{i + 1}of{n}" for i in range(n)]
    return entry, [C.Request(C.ALLGATHER, nm, t) for nm, t in zip(names, tensors)]


def allgather_async(tensor, name=None, process_set=global_process_set):
    _check_tensor(tensor, _MOVE_TYPES)
    entry, reqs = _allgather_requests([tensor], "allgather", name, process_set)
    return _submit(entry, reqs, lambda: reqs[0].result)


class HorovodAllgather(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() else 0
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output, average=True, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32), process_set=ctx.process_set)
        offset = int(dims[:ctx.process_set.rank()].sum().item())
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    _check_tensor(tensors[0], _MOVE_TYPES)
    _same_device(tensors)
    entry, reqs = _allgather_requests(tensors, "grouped_allgather", name, process_set)
    return _submit(entry, reqs, lambda: tuple(r.result for r in reqs))


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 0 for t in tensors]
        ctx.process_set = process_set
        return synchronize(grouped_allgather_async(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grad_output):
        reduced = grouped_allreduce(list(grad_output), average=True, process_set=ctx.process_set)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims],
                                 process_set=ctx.process_set)
        r = ctx.process_set.rank()
        grads = [g.narrow(0, int(d[:r].sum().item()), dim) for g, d, dim in zip(reduced, dims, ctx.dims)]
        return (None, None, *grads)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    return HorovodGroupedAllgather.apply(name, process_set, *tensors)


# ---- broadcast --------------------------------------------------------------------------------
def _broadcast_async(tensor, output, root_rank, name, process_set):
    _check_tensor(tensor, _MOVE_TYPES)
    entry = _entry(process_set, "Broadcast")
    if root_rank not in entry.ranks:
        raise ValueError(f"broadcast received invalid root rank {root_rank} for provided process set")
    req = C.Request(C.BROADCAST, _name("broadcast", name, _peek_handle()), tensor, output, root=root_rank)
    return _submit(entry, [req], lambda: output)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, torch.empty_like(tensor), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    return _broadcast_async(tensor, tensor, root_rank, name, process_set)


@_sync
def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad_reduced = allreduce(grad_output, average=True, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad_reduced *= 0
        return grad_reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# ---- alltoall ---------------------------------------------------------------------------------
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    _check_tensor(tensor, _MOVE_TYPES)
    entry = _entry(process_set, "Alltoall")
    n = len(entry.ranks)
    if splits is None:
        splits = torch.empty(0, dtype=torch.int32)
    elif not isinstance(splits, torch.Tensor):
        splits = torch.tensor(splits, dtype=torch.int32, device="cpu")
    if splits.dim() != 1:
        raise ValueError("alltoall expects a 1D splits tensor")
    if splits.dtype != torch.int32:
        raise ValueError("alltoall expects splits to contain 32-bit integer elements.")
    dim0 = tensor.shape[0] if tensor.dim() else 0
    if splits.numel() == 0:
        if tensor.dim() and dim0 % n:
            raise ValueError("splits not provided, but first dimension of tensor is not an even multiple "
                             "of the number of workers.")
        send = torch.full((n,), dim0 // n if tensor.dim() else 0, dtype=torch.int32)
        out_device = torch.device("cpu")
    else:
        if splits.numel() != n:
            raise ValueError("Number of entries in splits does not equal number of workers.")
        send = splits.cpu()
        if int(send.sum()) > dim0:
            raise ValueError("Sum of splits entries is greater than the first dimension of tensor.")
        out_device = splits.device
    req = C.Request(C.ALLTOALL, _name("alltoall", name, _peek_handle()), tensor, splits=send)

    def finish():
        out, recv = req.result
        return out, recv.to(out_device)

    return _submit(entry, [req], finish)


class HorovodAlltoall(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.recvsplits = received_splits
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, grad_received_splits):
        return alltoall(grad_output, splits=ctx.recvsplits, process_set=ctx.process_set)[0], None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    output, received_splits = HorovodAlltoall.apply(tensor, splits, name, process_set)
    if splits is None:
        return output
    return output, received_splits


# ---- reducescatter ----------------------------------------------------------------------------
def _reducescatter_requests(tensors, prefix, name, op, pre, post, process_set):
    entry = _entry(process_set, "Reducescatter")
    if op not in (Average, Sum):
        raise HorovodInternalError("Reducescatter currently only supports AVERAGE and SUM.")
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("Reducescatter does not support scalar inputs")
    if op == Average:
        post = post / len(entry.ranks)
    base = _name(prefix, name, _peek_handle())
    n = len(tensors)
    names = [base] if prefix == "reducescatter" else [f"{base}_{i + 1}of{n}" for i in range(n)]
    return entry, [C.Request(C.REDUCESCATTER, nm, t, pre=pre, post=post) for nm, t in zip(names, tensors)]


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    _check_tensor(tensor, _REDUCE_TYPES)
    entry, reqs = _reducescatter_requests([tensor], "reducescatter", name, op, prescale_factor,
                                          postscale_factor, process_set)
    return _submit(entry, reqs, lambda: reqs[0].result)


def _reducescatter_grad(grad, op, size_, pre, post, inplace):
    if op == Sum:
        grad = grad.mul_(size_) if inplace else grad * size_
    if pre != 1.0:
        grad = grad.mul_(pre) if inplace else grad * pre
    if post != 1.0:
        grad = grad.mul_(post) if inplace else grad * post
    return grad


class HorovodReducescatter(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        g = _reducescatter_grad(grad_output, ctx.op, ctx.process_set.size(), ctx.prescale_factor,
                                ctx.postscale_factor, inplace=True)
        return allgather(g, process_set=ctx.process_set), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    tensor_compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(tensor_compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    _check_tensor(tensors[0], _REDUCE_TYPES)
    _same_device(tensors)
    entry, reqs = _reducescatter_requests(tensors, "grouped_reducescatter", name, op, prescale_factor,
                                          postscale_factor, process_set)
    return _submit(entry, reqs, lambda: tuple(r.result for r in reqs))


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    @_sync
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                       postscale_factor))

    @staticmethod
    def backward(ctx, *grad_output):
        grads = [_reducescatter_grad(g, ctx.op, ctx.process_set.size(), ctx.prescale_factor,
                                     ctx.postscale_factor, inplace=False) for g in grad_output]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(t, c) for t, c in zip(outs, ctxs)]


# ---- join, barrier ----------------------------------------------------------------------------
@_sync
def join(device=-1) -> int:
    """This rank has no more data: it takes part in the others' allreduces with zeros until every
    rank joined; returns the last rank to join (the same on every rank)."""
    entry = _entry(global_process_set, "Join")
    ctrl = C.controller_for(entry)
    ctrl.join_device = device if (device is not None and device >= 0 and torch.cuda.is_available()) else -1
    req = C.Request(C.JOIN, "join.noname", None)
    handle = _submit(entry, [req], lambda: torch.tensor(req.result, dtype=torch.int32))
    return int(synchronize(handle).item())


@_sync
def barrier(process_set=global_process_set):
    entry = _entry(process_set, "Barrier")
    req = C.Request(C.BARRIER, "barrier.noname", None)
    synchronize(_submit(entry, [req], lambda: None))


# ---- timeline ---------------------------------------------------------------------------------
def _timeline_env():
    import os

    return os.environ.get("HOROVOD_TIMELINE"), int(os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") or 0) > 0


def _open_env_timeline():
    path, mark = _timeline_env()
    if path and path != "DYNAMIC" and STATE.rank == 0 and C.TIMELINE[0] is None:
        from .timeline import Timeline

        C.TIMELINE[0] = Timeline(path, mark)


def start_timeline(file_path, mark_cycles=False):
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)
    path, _ = _timeline_env()
    if not path:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    if STATE.rank != 0:
        return
    current = C.TIMELINE[0]
    if current is not None and getattr(current, "path", None) == file_path:
        return
    from .timeline import Timeline

    C.TIMELINE[0] = Timeline(file_path, mark_cycles)
    if current is not None:
        current.close()


def stop_timeline():
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)
    if C.TIMELINE[0] is None:
        import logging

        logging.getLogger("c10d_ext.horovod").warning(
            "Timeline is already stopped. Please start timeline before stopping it.")
        return
    stop_timeline_quietly()


def stop_timeline_quietly():
    tl, C.TIMELINE[0] = C.TIMELINE[0], None
    if tl is not None:
        tl.close()
