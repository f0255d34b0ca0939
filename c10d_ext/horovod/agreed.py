"""The one-step path of a process set on one host: the *agreed all_reduce*.

Every cycle of a set whose members share memory opens with myccl's agreed all_reduce: each member
offers a key (a hash of the names and of everything that must agree) with its data, or nothing,
and the op reduces only if every member offered the same key, element count, dtype and op; else
every member gets "no" from the same step with nothing written and the cycle goes on to the
negotiation (controller.SetController._negotiate). Two ways in:

* ``offer``: a cycle run from the queue offers its one request when it holds exactly one eligible
  allreduce and nothing else waits.
* ``allreduce_now``: a synchronous ``hvd.allreduce`` / ``grouped_allreduce`` on an idle set runs
  the cycle itself, without a request, a handle or the queue, and offers the op's whole data
  (a grouped op as one fused buffer). When the members disagree, its requests go into that same
  cycle's negotiation as if they had been queued.

Both make the same key for the same single tensor, so a member on one path and a member on the
other still agree. Only what cannot fail locally is offered (a local refusal would leave the
others waiting in the op): dense contiguous CPU tensors of the common dtypes, no prescale.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import _C as _ext
from . import controller as C
from .exceptions import HorovodInternalError
from .execute import _scale

# Horovod's op codes the agreed op takes (Average is a sum, scaled after) and the dtypes every one
# of them reduces on the CPU engine.
OPS = {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.SUM, 3: dist.ReduceOp.MIN, 4: dist.ReduceOp.MAX,
       5: dist.ReduceOp.PRODUCT}
DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64))

_M64 = 0xFFFFFFFFFFFFFFFF


def _signed(k: int) -> int:
    k &= _M64
    k = k or 1  # 0 means "no offer"
    return k - (1 << 64) if k >= 1 << 63 else k


def key_of(r: C.Request) -> int:
    """A nonzero signed 64-bit key of one request's name and everything that must agree."""
    return _signed(r.nhash * 0x9E3779B97F4A7C15 ^ r.sighash)


def _eligible(t: torch.Tensor) -> bool:
    return not t.is_cuda and t.dtype in DTYPES and t.layout == torch.strided and t.is_contiguous()


def _post_scale(ctrl, op: int, post: float) -> float:
    return post / ctrl.size if op == 0 else post  # Average: the sum over the set's size


def offer(ctrl, r: C.Request | None) -> bool:
    """Opens a queued cycle: offers `r` (None: nothing). True when every member offered the same
    and `r` is done; False (on every member) when anything differed and nothing moved."""
    buf, key, op = ctrl.no_offer, 0, dist.ReduceOp.SUM
    if r is not None and r.kind == C.ALLREDUCE and r.pre == 1.0 and r.op in OPS and _eligible(r.tensor):
        buf = r.tensor.view(-1) if r.output is r.tensor else r.tensor.reshape(-1).clone()
        key, op = key_of(r), OPS[r.op]
    else:
        r = None
    if not _ext._agreed_all_reduce_wait(ctrl.backend, buf, ctrl.agreed_flag, key, op) or r is None:
        return False
    _scale(buf, _post_scale(ctrl, r.op, r.post))
    if r.output is None:
        r.result = buf.view(r.tensor.shape)
    ctrl.complete(r)
    return True


_KEYS: dict = {}  # (names, op, post, ...) -> key: a training loop repeats its ops


def _key_one(name: str, t: torch.Tensor, op: int, post: float) -> int:
    """The key a queued cycle offers for the same single request (offer, key_of)."""
    sig = (name, op, post, t.dtype, t.shape)
    k = _KEYS.get(sig)
    if k is None:
        k = _remember(sig, key_of(C.Request(C.ALLREDUCE, name, t, op=op, post=post)))
    return k


def _key_many(names: tuple, op: int, post: float) -> int:
    """Stands for the names, op and factors of a grouped op; the dtype and every shape are folded
    in by the op (_agreed_all_reduce_many). A queued cycle never offers several requests, so this
    key never has to equal one of its keys."""
    sig = (names, op, post)
    k = _KEYS.get(sig)
    if k is None:
        k = 0x6A09E667F3BCC908
        for nm in names:
            k = ((k * 0x100000001B3) ^ C._h64(nm)) & _M64
        k = _remember(sig, _signed(k ^ C._h64(f"{op}/{post!r}")))
    return k


def _remember(sig, k: int) -> int:
    if len(_KEYS) > 1 << 14:
        _KEYS.clear()
    _KEYS[sig] = k
    return k


def can_offer(tensors, op: int, pre: float) -> bool:
    """Whether a synchronous allreduce of `tensors` may take allreduce_now (the caller checks
    before anything else, so that what it cannot take meets the queued path's errors first)."""
    if pre != 1.0 or op not in OPS or not tensors or C.TIMELINE[0] is not None:
        return False
    # several: the op checks them (in C++, before anything moves) and returns None if it can't
    return len(tensors) > 1 or _eligible(tensors[0])


def allreduce_now(ctrl, tensors: list, inplace: bool, names: tuple, op: int, post: float):
    """A synchronous allreduce of `tensors` (named `names`, checked by can_offer) run as a cycle
    on the caller's thread. Returns the results (a list) when every member agreed; a Handle to
    wait on when they did not (its requests went on into this cycle's negotiation); None when the
    set is busy (another cycle, queued or announced requests, a join), and the caller queues the
    op. A set of one member reduces nothing: the cycle is the scaling alone. While it runs, its
    names are not in the set's in-flight table: another thread submitting one of them meanwhile
    is queued for a later cycle rather than refused (the caller holds the set's cycle)."""
    if not ctrl.driver.acquire(blocking=False):
        return None
    try:
        with ctrl.cond:
            if (ctrl.failed is not None or ctrl.stopping or ctrl.queue or ctrl.mine or ctrl.table
                    or ctrl.join_req is not None or ctrl.joined):
                return None
            for nm in names:
                if nm in ctrl.in_flight:
                    return None  # queued, it gets Horovod's duplicate-name error
        # As on the set's thread, the data ops record no autograd history (set directly: the
        # no_grad context manager costs more than the rest of this path's Python).
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            return _cycle_now(ctrl, tensors, inplace, names, op, post)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
    finally:
        ctrl.driver.release()


def _cycle_now(ctrl, tensors, inplace, names, op, post):
    solo = ctrl.size == 1  # nothing to reduce: the cycle is the scaling alone
    scale = _post_scale(ctrl, op, post)
    try:
        if len(tensors) == 1:
            t = tensors[0]
            buf = t if inplace else t.clone()  # the op takes any contiguous shape: no views
            agreed = solo or _ext._agreed_all_reduce_wait(ctrl.backend, buf, ctrl.agreed_flag,
                                                          _key_one(names[0], t, op, post), OPS[op])
            if agreed:
                _scale(buf, scale)
                out = [buf]
        else:
            out = _ext._agreed_all_reduce_many(None if solo else ctrl.backend, tensors, ctrl.agreed_flag,
                                               0 if solo else _key_many(names, op, post), OPS[op], scale, inplace,
                                               ctrl.fusion_threshold)
            if out is None:  # a tensor it cannot offer, or more than one fusion buffer: nothing ran
                return None
            agreed = out is not False
    except BaseException as e:  # noqa: BLE001 - the set failed: every waiter must hear of it
        raise HorovodInternalError(str(ctrl.fail_with(e))) from None
    ctrl.cycles += 1
    ctrl.last_cycle = time.monotonic()
    if not agreed:
        return _negotiate_now(ctrl, tensors, inplace, names, op, post)
    ctrl.progress, ctrl.others_more = True, False
    return out


def _negotiate_now(ctrl, tensors, inplace, names, op, post) -> C.Handle:
    """The members disagreed: the op's requests go first into the queue and on into this cycle's
    negotiation, exactly as a queued cycle goes on after the agreed op said no."""
    reqs = [C.Request(C.ALLREDUCE, nm, t, t if inplace else None, op=op, post=post)
            for nm, t in zip(names, tensors)]
    handle = C.Handle(reqs, lambda: [r.result if r.output is None else r.output for r in reqs])
    handle.ctrl = ctrl
    with ctrl.cond:
        for r in reqs:
            ctrl.in_flight[r.name] = r
        ctrl.queue[:0] = reqs
        batch = ctrl.queue[:C.SLOTS]
        del ctrl.queue[:C.SLOTS]
        more = bool(ctrl.queue)
    for r in batch:  # from here a failure of the set completes them with its error
        ctrl.mine[r.nhash] = r
    try:
        ctrl.progress, ctrl.others_more = ctrl._negotiate(batch, more, None, False)
    except BaseException as e:  # noqa: BLE001
        ctrl.fail_with(e)
    return handle
