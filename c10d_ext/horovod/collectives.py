"""Horovod's data-movement ops on myccl: allgather, broadcast, alltoall and reducescatter (and
their grouped forms), each synchronous, asynchronous and with autograd as ``horovod.torch`` has
them. The allreduce family is in ``allreduce`` (their gradients use it), join and barrier in
``mpi_ops``, which exports all of them."""

from __future__ import annotations

import torch

from .allreduce import allreduce, grouped_allreduce
from .basics import rank
from .compression import Compression
from .exceptions import HorovodInternalError
from .handles import (_MOVE_TYPES, _REDUCE_TYPES, Average, Sum, _check_tensor, _entry, _name, _next_handle,
                      _same_device, _submit, _sync, synchronize)
from .process_sets import global_process_set
from .records import ALLGATHER, ALLTOALL, BROADCAST, REDUCESCATTER, Request


# ---- allgather --------------------------------------------------------------------------------
def _allgather_requests(tensors, prefix, name, process_set):
    entry = _entry(process_set, "Allgather")
    h = _next_handle()
    base = _name(prefix, name, h)
    n = len(tensors)
    names = [base] if prefix == "allgather" else [f"{base}_{i + 1}of{n}" for i in range(n)]
    return entry, [Request(ALLGATHER, nm, t) for nm, t in zip(names, tensors)], h


def allgather_async(tensor, name=None, process_set=global_process_set):
    _check_tensor(tensor, _MOVE_TYPES)
    entry, reqs, h = _allgather_requests([tensor], "allgather", name, process_set)
    return _submit(entry, reqs, lambda: reqs[0].result, h)


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
    entry, reqs, h = _allgather_requests(tensors, "grouped_allgather", name, process_set)
    return _submit(entry, reqs, lambda: tuple(r.result for r in reqs), h)


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
    h = _next_handle()
    req = Request(BROADCAST, _name("broadcast", name, h), tensor, output, root=root_rank)
    return _submit(entry, [req], lambda: output, h)


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
    h = _next_handle()
    req = Request(ALLTOALL, _name("alltoall", name, h), tensor, splits=send)

    def finish():
        out, recv = req.result
        return out, recv.to(out_device)

    return _submit(entry, [req], finish, h)


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
    h = _next_handle()
    base = _name(prefix, name, h)
    n = len(tensors)
    names = [base] if prefix == "reducescatter" else [f"{base}_{i + 1}of{n}" for i in range(n)]
    return entry, [Request(REDUCESCATTER, nm, t, pre=pre, post=post) for nm, t in zip(names, tensors)], h


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    _check_tensor(tensor, _REDUCE_TYPES)
    entry, reqs, h = _reducescatter_requests([tensor], "reducescatter", name, op, prescale_factor,
                                             postscale_factor, process_set)
    return _submit(entry, reqs, lambda: reqs[0].result, h)


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
    entry, reqs, h = _reducescatter_requests(tensors, "grouped_reducescatter", name, op, prescale_factor,
                                             postscale_factor, process_set)
    return _submit(entry, reqs, lambda: tuple(r.result for r in reqs), h)


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
