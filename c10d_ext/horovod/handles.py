"""What every op of ``mpi_ops`` shares: Horovod's op codes, the dtypes each op family takes, the
handles an asynchronous op returns (``poll``, ``synchronize``) and the steps of enqueueing
(argument checks in Horovod's words, naming, submitting requests to a set's controller)."""

from __future__ import annotations

import threading
import warnings

import torch

from .. import _C as _ext
from . import agreed, controller as C, streams
from .basics import STATE
from .exceptions import NOT_INITIALIZED, HorovodInternalError
from .process_sets import _lookup
from .records import HANDLES, Handle

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_REDUCE_TYPES = {torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16}
_MOVE_TYPES = _REDUCE_TYPES | {torch.uint8, torch.int8, torch.int16}

_handles = HANDLES  # the handles of ops not held (agreed.py holds the others)
_local = threading.local()  # .sync: inside a synchronous op, whose caller drives the cycles
_handles_lock = threading.Lock()
_held_result, _held_poll, _HeldList = _ext._hvd_result, _ext._hvd_poll, _ext._HeldList
_next_handle, reset_handles = _ext._hvd_next_handle, _ext._hvd_reset_handles


# ---- handles ----------------------------------------------------------------------------------
# Numbers come from one counter with the held ops' (src/python/HorovodHeld.cpp), from 1 after init.
# As in Horovod, an op takes its number first (_next_handle, once its arguments are checked) and
# an unnamed op is named after it, so two threads never share a name.
def poll(handle: int) -> bool:
    done = _held_poll(handle)
    if done == 2:  # a held op of an untimed list: now timed, and the loop must know
        for ctrl in list(agreed.OWNERS.values()):
            ctrl.wake()
        return False
    if done >= 0:
        return bool(done)
    h = _handles.get(handle)
    if h is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return h.event.is_set()


def synchronize(handle: int):
    while True:
        r = _held_result(handle)
        if r is None:
            break
        if type(r) is not _HeldList:
            return r  # a held op's result: its handle is gone
        agreed.wait(r)  # runs its list, or raises its error; then look again
    h = _handles.get(handle)
    if h is None:
        return None
    try:
        return _wait(h)
    finally:
        _handles.pop(handle, None)  # one dict operation: atomic, no lock needed


def _wait(h: Handle):
    if not h.event.is_set():  # (is_set costs a fraction of wait: most handles are done by now)
        if h.ctrl is not None:
            h.ctrl.drive(h)
        while not h.event.wait(0.1):
            pass
    if h.error is not None:
        raise HorovodInternalError(str(h.error))
    if h.cuda_event is not None:
        streams.consume(h.device, h.cuda_event, h.staged)
        h.staged = []  # the caller owns the results now
    finish = h.finish
    if type(h) is Handle:  # its requests point at it: no cycle may keep the results alive
        h.finish = None
    return finish()


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


def _submit(entry, reqs, finish, h: int) -> int:
    """Queues the requests of one op on its set under handle number `h` (taken by the op)."""
    ctrl = C.controller_for(entry)
    for r in reqs:
        if r.is_cuda:  # Horovod's ready event: the data work waits for the producer's stream
            r.cuda_event = streams.ready_event(r.device)
            ctrl.streams.note(r.device)
    handle = Handle(reqs, finish)
    handle.ctrl = ctrl
    ctrl.submit(reqs, wake=not getattr(_local, "sync", False))
    _handles[h] = handle
    return h


def _sync(fn):
    """Marks a synchronous op: its requests do not wake the loop, the caller's
    synchronize runs the cycle (unless the loop is in one already, or runs in lockstep)."""
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
