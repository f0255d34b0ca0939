"""The operations of ``horovod.torch`` (its ``mpi_ops``): the same names, signatures, defaults,
return values and exceptions, each enqueuing requests on a process set's controller.

Enqueue-time argument errors are ValueError (Horovod's invalid-argument statuses); an op before
``init`` or after a failure raises HorovodInternalError; what the ranks disagree on comes out of
``synchronize`` as HorovodInternalError on every rank. Handles are ints from 1, reset by
``shutdown``; ``synchronize`` of an unknown handle returns None, ``poll`` of one raises.
"""

from __future__ import annotations

import torch

from . import controller as C, lifecycle, timeline
from .allreduce import (HorovodAllreduce, HorovodGroupedAllreduce, _allreduce_async,  # noqa: F401
                        _grouped_allreduce_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                        grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_)
from .basics import (STATE, ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,  # noqa: F401
                     gloo_enabled, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, size)
from .collectives import (HorovodAllgather, HorovodAlltoall, HorovodBroadcast,  # noqa: F401
                          HorovodGroupedAllgather, HorovodGroupedReducescatter, HorovodReducescatter,
                          allgather, allgather_async, alltoall, alltoall_async, broadcast, broadcast_,
                          broadcast_async, broadcast_async_, grouped_allgather, grouped_allgather_async,
                          grouped_reducescatter, grouped_reducescatter_async, reducescatter,
                          reducescatter_async)
from .exceptions import NOT_INITIALIZED
from .handles import (Adasum, Average, Max, Min, Product, Sum, _entry, _handles, _handles_lock,  # noqa: F401
                      _next_handle, _submit, _sync, poll, reset_handles, synchronize)
from .process_sets import ProcessSet, global_process_set  # noqa: F401
from .records import BARRIER, JOIN, Request


def init(*args, **kwargs):
    """``init(comm=None, process_sets=None)``: see lifecycle.init. Idempotent until shutdown."""
    lifecycle.init(*args, **kwargs)
    _open_env_timeline()


def shutdown():
    with _handles_lock:
        _handles.clear()
        reset_handles()
    stop_timeline_quietly()
    lifecycle.shutdown()


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


# ---- join, barrier ----------------------------------------------------------------------------
@_sync
def join(device=-1) -> int:
    """This rank has no more data: it takes part in the others' allreduces with zeros until every
    rank joined; returns the last rank to join (the same on every rank)."""
    entry = _entry(global_process_set, "Join")
    ctrl = C.controller_for(entry)
    ctrl.join_device = device if (device is not None and device >= 0 and torch.cuda.is_available()) else -1
    req = Request(JOIN, "join.noname", None)
    handle = _submit(entry, [req], lambda: torch.tensor(req.result, dtype=torch.int32), _next_handle())
    return int(synchronize(handle).item())


@_sync
def barrier(process_set=global_process_set):
    entry = _entry(process_set, "Barrier")
    req = Request(BARRIER, "barrier.noname", None)
    synchronize(_submit(entry, [req], lambda: None, _next_handle()))


# ---- timeline ---------------------------------------------------------------------------------
def _timeline_env():
    import os

    return os.environ.get("HOROVOD_TIMELINE"), int(os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") or 0) > 0


def _open_env_timeline():
    path, mark = _timeline_env()
    if path and path != "DYNAMIC" and STATE.rank == 0 and timeline.ACTIVE[0] is None:
        C.set_timeline(timeline.Timeline(path, mark))


def start_timeline(file_path, mark_cycles=False):
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)
    path, _ = _timeline_env()
    if not path:
        raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
    if STATE.rank != 0:
        return
    current = timeline.ACTIVE[0]
    if current is not None and getattr(current, "path", None) == file_path:
        return
    C.set_timeline(timeline.Timeline(file_path, mark_cycles))
    if current is not None:
        current.close()


def stop_timeline():
    if not STATE.initialized:
        raise ValueError(NOT_INITIALIZED)
    if timeline.ACTIVE[0] is None:
        import logging

        logging.getLogger("c10d_ext.horovod").warning(
            "Timeline is already stopped. Please start timeline before stopping it.")
        return
    stop_timeline_quietly()


def stop_timeline_quietly():
    tl = timeline.ACTIVE[0]
    C.set_timeline(None)
    if tl is not None:
        tl.close()
