"""The one-step path of a process set on one host: the *agreed all_reduce*.

Every cycle of a set whose members share memory opens with myccl's agreed all_reduce: each member
offers a key (a hash of the names and of everything that must agree) with its data, or nothing,
and the op reduces only if every member offered the same key, element count, dtype and op; else
every member gets "no" from the same step with nothing written and the cycle goes on to the
negotiation (controller.py). Two ways in:

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

import threading

import torch
import torch.distributed as dist

from .. import _C as _ext
from . import timeline
from .basics import STATE
from .exceptions import DUPLICATE_NAME, SHUT_DOWN, HorovodInternalError
from .execute import ALONE_BYTES, _scale
from .records import ALLREDUCE, HANDLES, Handle, Request

# Horovod's op codes the agreed op takes (Average is a sum, scaled after) and the dtypes every one
# of them reduces on the CPU engine.
OPS = {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.SUM, 3: dist.ReduceOp.MIN, 4: dist.ReduceOp.MAX,
       5: dist.ReduceOp.PRODUCT}
DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64))

_M64 = 0xFFFFFFFFFFFFFFFF
# The most an agreed op carries itself: it is a one-step reduction (every rank folds every peer's
# staged copy), which myccl picks for all_reduce only up to this size. A list whose buffers are
# all larger sends its key in a one-element agreed step first.
AGREE_BYTES = 64 * 1024


def _signed(k: int) -> int:
    k &= _M64
    k = k or 1  # 0 means "no offer"
    return k - (1 << 64) if k >= 1 << 63 else k


def key_of(r: Request) -> int:
    """A nonzero signed 64-bit key of one request's name and everything that must agree."""
    return _signed(r.nhash * 0x9E3779B97F4A7C15 ^ r.sighash)


def _eligible(t: torch.Tensor) -> bool:
    return _ext._cuda_engine_device(t) < 0 and t.dtype in DTYPES and t.layout == torch.strided and t.is_contiguous()


def _post_scale(ctrl, op: int, post: float) -> float:
    return post / ctrl.size if op == 0 else post  # Average: the sum over the set's size


def offer(ctrl, r: Request | None) -> bool:
    """Opens a queued cycle: offers `r` (None: nothing). True when every member offered the same
    and `r` is done; False (on every member) when anything differed and nothing moved."""
    buf, key, op = ctrl.no_offer, 0, dist.ReduceOp.SUM
    if (r is not None and r.kind == ALLREDUCE and r.pre == 1.0 and r.op in OPS and _eligible(r.tensor)
            and r.tensor.nbytes <= AGREE_BYTES):
        # (a new tensor where not in place: Horovod's results are never views)
        buf = r.tensor if r.output is r.tensor else r.tensor.clone()
        key, op = key_of(r), OPS[r.op]
    else:
        r = None
    if not _ext._agreed_all_reduce_wait(ctrl.backend, buf, ctrl.agreed_flag, key, op) or r is None:
        return False
    _scale(buf, _post_scale(ctrl, r.op, r.post))
    if r.output is None:
        r.result = buf
    ctrl.complete(r)
    return True


_KEYS: dict = {}  # (names, op, post, ...) -> key: a training loop repeats its ops


def _key_one(name: str, t: torch.Tensor, op: int, post: float) -> int:
    """The key a queued cycle offers for the same single request (offer, key_of)."""
    sig = (name, op, post, t.dtype, t.shape)
    k = _KEYS.get(sig)
    if k is None:
        k = _remember(sig, key_of(Request(ALLREDUCE, name, t, op=op, post=post)))
    return k


def _key_many(names: tuple, op: int, post: float) -> int:
    """Stands for the names, op and factors of a grouped op; the dtype and every shape are folded
    in by the op (_agreed_all_reduce_many). The same function as a held list's (_HeldList.run),
    so a synchronous op on one rank and the same op held on another agree. A queued cycle never
    offers several requests, so this key never has to equal one of its keys."""
    sig = (names, op, post)
    k = _KEYS.get(sig)
    if k is None:
        k = _remember(sig, _ext._hvd_key(list(names), op, post))
    return k


def _remember(sig, k: int) -> int:
    if len(_KEYS) > 1 << 14:
        _KEYS.clear()
    _KEYS[sig] = k
    return k


def can_offer(tensors, op: int, pre: float) -> bool:
    """Whether a synchronous allreduce of `tensors` may take allreduce_now (the caller checks
    before anything else, so that what it cannot take meets the queued path's errors first)."""
    if pre != 1.0 or op not in OPS or not tensors or timeline.ACTIVE[0] is not None:
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
    if not ctrl.loop.free or not ctrl.driver.acquire(blocking=False):
        return None
    try:
        if not ctrl.quiet_for(names):
            return None
        # As on the loop's thread, the data ops record no autograd history (set directly: the
        # no_grad context manager costs more than the rest of this path's Python).
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            return _cycle_now(ctrl, tensors, inplace, names, op, post)
        finally:
            if grad:
                torch._C._set_grad_enabled(True)
            if not ctrl.held.accepting:  # its requests went on into the negotiation
                ctrl.reopen()
    finally:
        ctrl.driver.release()


def _cycle_now(ctrl, tensors, inplace, names, op, post):
    try:
        out = run_list(ctrl, tensors, [inplace] * len(tensors), names, op, post)
    except BaseException as e:  # noqa: BLE001 - the set failed: every waiter must hear of it
        raise HorovodInternalError(str(ctrl.fail_with(e))) from None
    if out is None:  # a tensor it cannot offer: nothing ran
        return None
    if out is False:
        ctrl.cycled(None)
        d = Deferred(ctrl, threading.Event(), tensors, inplace, names, op, post, single=False)
        _negotiate_now(ctrl, [d])
        return d
    ctrl.cycled(True)
    return out


def run_list(ctrl, tensors, inplace, names, op, post):
    """One agreed step of `tensors` (named `names`; `inplace` per tensor): the results (a list)
    when every member offered the same, False when not (nothing written), None when a tensor
    cannot be offered (nothing ran). A set of one reduces nothing: the step is the scaling."""
    solo = ctrl.size == 1
    scale = _post_scale(ctrl, op, post)
    if len(tensors) == 1 and tensors[0].nbytes <= AGREE_BYTES:  # the key a queued cycle offers (offer)
        t = tensors[0]
        buf = t if inplace[0] else t.clone()  # the op takes any contiguous shape: no views
        if not solo and not _ext._agreed_all_reduce_wait(ctrl.backend, buf, ctrl.agreed_flag,
                                                         _key_one(names[0], t, op, post), OPS[op]):
            return False
        _scale(buf, scale)
        return [buf]
    return _ext._agreed_all_reduce_many(None if solo else ctrl.backend, tensors, inplace, ctrl.agreed_flag,
                                        0 if solo else _key_many(names, op, post), OPS[op], scale,
                                        ctrl.fusion_threshold, ALONE_BYTES, AGREE_BYTES)


def _negotiate_now(ctrl, ops: list, tl=None) -> None:
    """The members disagreed: the requests of `ops` (Deferred) go first into the queue and on
    into this cycle's negotiation, exactly as a queued cycle goes on after the agreed op said no."""
    reqs = []
    for d in ops:  # its requests complete one by one
        d.reqs = [Request(ALLREDUCE, nm, t, t if d.inplace else None, op=d.op, post=d.post)
                  for nm, t in zip(d.names, d.tensors)]
        d.remaining = len(d.reqs)
        for r in d.reqs:
            r.handle = d
        reqs += d.reqs
    if tl is not None:
        tl.mark_cycle_start()
    ctrl.negotiate_first(reqs, tl)


# ---- asynchronous allreduces: held for the set's next agreed step -----------------------------
# A set's pending list lives in C++ (_C._HeldSet, src/python/HorovodHeld.cpp): an op joins it in
# one call, and its handle's result comes back in one more. The list runs (flush) as one agreed
# step when a caller waits on one of its ops, when its bytes reach the fusion threshold (sealed
# at that op, the same op on every member: it runs at once), or on the loop once no op
# joined it for PENDING_IDLE cycle times (at most PENDING_CAP after its first). Where the lists
# of two members end differs only when one of them runs on its timer: then the negotiation sorts
# the requests out, each op becoming a Deferred.
PENDING_IDLE, PENDING_CAP = 20, 100
AWAKE_SECONDS = 1.0  # the loop looks for pending lists itself this long after a set's cycle
DONE, FAILED, HANDED = 2, 3, 4  # a held list's states from which it is over
OWNERS: dict = {}  # set id -> its controller, for a list's waiters


class Deferred(Handle):
    """An allreduce (or grouped allreduce) whose agreed step said no, going on into the
    negotiation as a handle of requests: the ops of a held list that differed between the ranks,
    or a synchronous allreduce that did (allreduce_now)."""

    __slots__ = ("names", "tensors", "inplace", "single", "reqs", "op", "post")

    def __init__(self, ctrl, event, tensors, inplace, names, op, post, single):
        self.remaining, self.error, self.event, self.cuda_event, self.ctrl = 1, None, event, None, ctrl
        self.names, self.tensors, self.inplace, self.single = names, tensors, inplace, single
        self.op, self.post = op, post
        self.reqs = None

    def finish(self):  # what synchronize returns
        out = [r.result if r.output is None else r.output for r in self.reqs]
        return out[0] if self.single else tuple(out)


def can_defer(tensors, op: int, pre: float) -> bool:
    return pre == 1.0 and op in OPS and timeline.ACTIVE[0] is None


def defer(ctrl, tensors: list, inplace: bool, names: tuple, op: int, post: float, single: bool, timed: bool,
          handle: int):
    """Adds an asynchronous allreduce (checked by can_defer) to the set's pending list under the
    op's handle number; returns it, or None when the set holds no op now (queued or announced
    requests, a join, a pending list of another op or factor, a tensor it does not hold) and the
    op is queued instead. A list of untimed ops only (`timed` False: their caller always
    synchronizes them) never runs on the timer, so where it ends is a point of the program on
    every member."""
    return added(ctrl, ctrl.held.add(tensors, list(names), inplace, op, post, timed, single, handle))


def added(ctrl, code: int):
    """The handle number of what _HeldSet.add / _hvd_hold answered (None: not held), waking the set's
    thread when the list wants timing or was sealed."""
    if code > 0:
        if code & 2 or (code & 1 and ctrl.asleep):  # sealed, or a list to time and nobody looks
            ctrl.wake()
        return code >> 2
    if code == 0:
        return None
    raise ValueError(DUPLICATE_NAME)


def pending_due(ctrl) -> float:
    """When the loop runs a set's pending list (monotonic), unless a caller does first."""
    t = ctrl.cycle_time
    return ctrl.held.due(PENDING_IDLE * t, PENDING_CAP * t)


def wait(lst):
    """synchronize of a held op whose list is not done: runs or waits for the list. Returns
    True when the handle is to be looked up again (done, or handed to the negotiation)."""
    if lst.state < DONE:
        ctrl = OWNERS.get(lst.owner)
        if ctrl is None:
            lst.fail(SHUT_DOWN)
        else:
            ctrl.drive_held(lst)
    if lst.state == FAILED:
        raise HorovodInternalError(lst.error)
    return True


def flush(ctrl, lst) -> None:
    """Runs a pending list as one cycle (its caller holds the set's cycle): one agreed step of all
    its tensors, or, when the members' lists differ, the negotiation of their requests."""
    op, post = lst.op, lst.post
    tl = timeline.ACTIVE[0] if STATE.rank == 0 else None
    try:
        got = -1  # 1 done, 0 the members' lists differed, -1 nothing ran
        across = tl is None and ctrl.size > 1 and not ctrl.agreed_ok
        if across:
            # Across hosts (no agreed op): the list's key rides on this cycle's negotiation
            # message; where every member announced the same, its buffers run as plain all_reduces.
            got = 0
            if ctrl.negotiate_list(lst.key()):
                got = lst.run(ctrl.backend, ctrl.agreed_flag, OPS[op], _post_scale(ctrl, op, post),
                              ctrl.fusion_threshold, ALONE_BYTES, -1)
        elif tl is None:
            got = lst.run(None if ctrl.size == 1 else ctrl.backend, ctrl.agreed_flag, OPS[op],
                          _post_scale(ctrl, op, post), ctrl.fusion_threshold, ALONE_BYTES, AGREE_BYTES)
            if got == -2:  # one small tensor: offered with the key a queued cycle offers
                tensors, inplace, names, _, _ = lst.contents()
                out = run_list(ctrl, tensors, inplace, names, op, post)
                got = -1 if out is None else 1 if out else 0
                if got == 1:
                    lst.complete(out)
        if got < 0 and ctrl.agreed_ok:  # nothing ran: the cycle still opens with the agreed op
            offer(ctrl, None)
    except BaseException as e:  # noqa: BLE001 - the set failed: every waiter must hear of it
        lst.fail(str(ctrl.fail_with(e)))
        return
    if got != 1:  # on into this cycle's negotiation (across hosts: the next one), as requests
        ctrl.cycled(None)
        tensors, inplace, names, _, _ = lst.contents()
        _handoff(ctrl, lst, tensors, inplace, names, op, post, tl)
        return
    ctrl.cycled(True, None if across else False)  # (across hosts the negotiation said who has more)


def _handoff(ctrl, lst, tensors, inplace, names, op, post, tl) -> None:
    """The members' lists differed: each op of `lst` becomes a Deferred under its handle number
    (registered before the list lets go of it, so a waiter always finds one of the two) and goes
    into this cycle's negotiation."""
    ops = []
    for h, first, count, single in lst.ops():
        d = Deferred(ctrl, threading.Event(), tensors[first:first + count], inplace[first],
                     names[first:first + count], op, post, single)
        HANDLES[h] = d
        ops.append(d)
    lst.handoff()
    _negotiate_now(ctrl, ops, tl)
