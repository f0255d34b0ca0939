"""Horovod's coordination on myccl: the state and the cycle of one process set.

Ops enqueue *requests* keyed by tensor name. The process's engine loop (loop.py) runs the set's
*cycles*: each cycle every member announces its new requests (fixed-size records: a hash of the
name, a hash of everything that must agree, and what fusion and a joined rank need: kind, dtype,
device, op, element counts, scale factors, root) in one all_gather of the set's group. Every member
then holds the same table of who announced what, so all of them pick the same ready requests (all
non-joined members announced) in the same order, check that they agree, fuse them and run the
data collectives identically: no coordinator round trip, and a mismatch is found before any
byte moves (a mismatched collective would leave the group unusable). Where the set's members share
memory, every cycle opens with one agreed step (agreed.py) and negotiates only if it said no.
"""

from __future__ import annotations

from array import array
import logging
import math
import os
import threading
import time

import torch

from .. import _C as _ext
from . import agreed, execute, timeline
from .basics import STATE
from .exceptions import DUPLICATE_NAME, SHUT_DOWN, HorovodInternalError
from .records import (ACTIVE, BARRIER, FIELDS, HEADER, JOIN, JOIN_UNSUPPORTED, LEAVING, MORE, SLOTS, STALLED,
                      Handle, Request)
from .stall import StallInspector
from .streams import SetStreams
from ._torch import all_gather_single

log = logging.getLogger("c10d_ext.horovod")

# An idle member still cycles this often (Horovod's background loop cycles on idle ranks too), so
# a member busy outside Horovod (evaluation, a checkpoint) never leaves a peer's cycle waiting
# on it past the group's timeout; the stall inspector warns of what waits instead.
HEARTBEAT_SECONDS = 1.0

STEP, BEAT, LOOK, SLEEP = range(4)  # what a set's plan asks of the loop (SetController.plan)


def _kind_of(entry) -> int:
    return next(iter(entry.recs.values()))[2] & 0xFF


class Announced:
    """The table entry of one name: each member's record, in the order they came."""

    __slots__ = ("recs", "since")

    def __init__(self):
        self.recs: dict[int, list[int]] = {}
        self.since = time.monotonic()


def _threshold() -> int:
    try:
        return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024))
    except ValueError:
        return 128 * 1024 * 1024


def _cycle_seconds() -> float:
    try:
        return float(os.environ.get("HOROVOD_CYCLE_TIME", "1")) / 1000.0
    except ValueError:
        return 0.001


class SetController:
    """One process set on this rank: its queue, table, pending lists and cycle. The engine loop
    (loop.py) runs its cycles; a caller waiting on an op may run one itself where the loop lets
    it (``loop.free``). Every set of the process shares the loop's lock and its ``driver``, so
    one cycle of one set runs at a time in the process."""

    def __init__(self, entry, loop):
        self.entry = entry
        self.loop = loop
        self.group = entry.group
        self.size = len(entry.ranks)
        self.me = entry.ranks.index(STATE.rank)
        self.is_global = entry.id == 0
        self.lock = loop.lock
        self.cond = loop.cond
        self.queue: list[Request] = []
        self.in_flight: dict = {}  # name -> request (or agreed.Deferred), for the duplicate check
        self.fusion_threshold = _threshold()
        # Asynchronous allreduces held for one agreed step (agreed.py): the open pending list,
        # the sealed ones (they filled a fusion buffer: they run at once) and their names.
        self.held = _ext._HeldSet(entry.id, self.fusion_threshold)
        agreed.OWNERS[entry.id] = self
        self.mine: dict[int, Request] = {}  # announced here, not done: name hash -> request
        self.table: dict[int, Announced] = {}
        self.joined: dict[int, int] = {}  # member -> cycle it joined in
        self.join_req: Request | None = None
        self.join_device = -1
        self.stopping = False
        self.failed: BaseException | None = None
        self.cycles = 0
        # Negotiations run (every member runs each one, unlike the agreed steps a member may
        # take alone): the clock of joins, so that every member names the same last one.
        self.rounds = 0
        self.list_agreed = False  # every member announced the same pending list's key (_negotiate)
        self.stalls = StallInspector()  # a warning on the set's rank 0, and optionally a shutdown
        self.leaving = False  # this member's last cycle: it shuts down (_leave)
        self.peer_left = False  # another member shut down in order: this set stopped with it
        self.cycle_time = _cycle_seconds()
        self.streams = SetStreams()  # where the set's CUDA work runs (streams.py)
        # The agreed all_reduce (one host, shared memory): None until the set's first cycle has
        # made its CPU engine on every member, then the same answer on all of them.
        self.agreed_ok: bool | None = None if self.size > 1 else False
        self.agreed_byte = bytearray(1)  # what the op answers, read without a tensor op
        self.agreed_flag = torch.frombuffer(self.agreed_byte, dtype=torch.uint8)
        self.no_offer = torch.zeros(1)
        self.backend = None  # the group's myccl backend, once agreed_ok is known
        self.driver = loop.driver  # held by whoever runs a cycle (of any set of the process)
        self.last_cycle = 0.0  # when the last cycle with work began (monotonic)
        self.last_beat = 0.0  # when the last cycle of any kind began: the first runs at once
        self.progress = True  # the last cycle announced or ran something
        self.others_more = False  # some member has more queued than one cycle announces
        # The cycle's message and what it gathers, as Python arrays that tensors view: records
        # go in and come out without a tensor op per field.
        width = HEADER + SLOTS * FIELDS
        self.width = width
        self.msg_arr = array("q", bytes(8 * width))
        self.msg = torch.frombuffer(self.msg_arr, dtype=torch.int64)
        self.gathered_arr = array("q", bytes(8 * width * self.size))
        self.gathered = torch.frombuffer(self.gathered_arr, dtype=torch.int64)
        self._reopen()

    # ---- the caller's side -------------------------------------------------------------------
    def submit(self, requests: list[Request], wake: bool = True) -> None:
        """Atomically enqueues the requests of one op (a grouped op's members negotiate and fuse
        together), or raises as Horovod does at enqueue. `wake` False: a synchronous op, whose
        caller runs the cycle itself where the loop lets it (loop.free)."""
        with self.cond:
            if self.failed is not None or self.stopping:
                raise HorovodInternalError(SHUT_DOWN)
            held = self.held
            for r in requests:
                if r.kind not in (JOIN, BARRIER) and (r.name in self.in_flight or held.holds(r.name)):
                    raise ValueError(DUPLICATE_NAME)
            held.accepting = False  # until the queue is empty again (step)
            for r in requests:
                if r.kind == JOIN:
                    self.join_req = r
                else:
                    if r.kind != BARRIER:
                        self.in_flight[r.name] = r
                    self.queue.append(r)
            if not wake:
                self.loop.urgent = True  # a caller waits on this op: lockstep iterates at once
            if wake or not self.loop.free:
                self.cond.notify_all()

    # ---- what the loop asks ----------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """Whether nobody looks at this set until told (agreed.added wakes the loop then)."""
        return self.loop.asleep

    def _requests(self) -> bool:
        """Requests to cycle for: queued, announced and waiting on peers, or a join."""
        return bool(self.queue or self.mine or self.join_req)

    def _has_work(self) -> bool:
        return self._requests() or self.held.has_open or self.held.has_sealed

    def _reopen(self) -> None:
        """Whether asynchronous allreduces may be held now (agreed.defer): the set is idle (nothing
        queued, announced or joining), its first cycle told whether it has the agreed op (its
        lists then agree through that op, else through the negotiation's message), and the loop
        lets a caller run a cycle (a held list runs on its waiter's thread). Called with the cond
        held."""
        self.held.accepting = ((self.agreed_ok is not None or self.size == 1) and self.failed is None and not self.stopping
                               and timeline.ACTIVE[0] is None and self.loop.free
                               and not (self.queue or self.mine or self.table or self.join_req is not None
                                        or self.joined))

    def plan(self, now: float) -> tuple[float, int]:
        """When the loop runs this set's next cycle on its own (free mode; with the cond held):
        (monotonic time, STEP / BEAT / LOOK / SLEEP). STEP and BEAT run a cycle then (BEAT: a
        heartbeat, announcing nothing); LOOK and SLEEP only look again then (SLEEP: nobody looks
        before, unless told)."""
        if self.held.has_sealed:
            return now, STEP
        if self._requests():
            # Horovod's cycle: asynchronous requests gather for up to one cycle time after the
            # last cycle began, so that those submitted together fuse.
            return self.last_cycle + self.cycle_time, STEP
        due = agreed.pending_due(self)  # (infinite: no list, or one of untimed ops)
        if due != math.inf:  # runs once none came for a while (or a caller runs it)
            return due, STEP
        # Idle: a heartbeat cycle once a second (HEARTBEAT_SECONDS). While the set was used
        # lately, the loop also looks again every PENDING_IDLE cycle times, so that a pending list
        # that begins meanwhile is timed without waking it from its first op (agreed.added): a
        # wake would cost that op a thread switch. Idle longer, it sleeps until told or the beat.
        beat = self.last_beat + HEARTBEAT_SECONDS if self.size > 1 else math.inf
        if now >= beat:
            return now, BEAT
        if now - self.last_cycle < agreed.AWAKE_SECONDS:
            return min(beat, now + agreed.PENDING_IDLE * self.cycle_time), LOOK
        return beat, SLEEP

    def leave(self) -> None:
        """The set stops on this member (hvd.shutdown): one last cycle tells the others, whose
        sets then stop too (their ops fail with Horovod's shut-down error, not as a lost peer).
        A member that is busy takes part through its heartbeat. Run by the loop, which holds
        ``driver``."""
        if self.size == 1 or self.failed is not None:
            return
        self.leaving = True
        try:
            with torch.no_grad():
                self._cycle([], False, beat=True)
        except BaseException:  # noqa: BLE001 - a peer that is gone already: nothing to tell
            pass

    # ---- one cycle ---------------------------------------------------------------------------------
    def step(self, waiter: bool = False, beat: bool = False) -> None:
        """One cycle where there is one to run (free mode), by whoever holds ``driver``: the loop,
        or a caller waiting on an op (`waiter`; which saves two thread switches per op). `beat`: a
        heartbeat is due, so the cycle runs even with nothing to announce."""
        try:
            self._step(waiter, beat)
        finally:
            self.reopen()

    def _step(self, waiter: bool, beat: bool = False) -> None:
        held = self.held
        batch, more = None, False
        with self.cond:
            if self.failed or self.stopping:
                return
            if not self._has_work():
                if not beat or time.monotonic() < self.last_beat + HEARTBEAT_SECONDS:
                    return
                batch, more, deferred = [], False, None  # the heartbeat: a cycle announcing nothing
            else:
                deferred = held.take(False)  # a sealed list filled a fusion buffer: it runs first
                if deferred is None:
                    if (held.has_open and not waiter and not self._requests()
                            and time.monotonic() < agreed.pending_due(self)):
                        return  # nobody waits on the pending list and it is not due: the loop times it
                    if not held.has_open and not self.queue and not self.progress and not self.others_more:
                        # Requests wait on peers and nothing changed: one cycle time, or new work.
                        self.cond.wait(self.cycle_time)
                        if self.stopping or not self._requests():
                            return  # (a pending list that came meanwhile runs when due: the loop)
                    deferred = held.take(True)  # before anything queued: it came first
                    if deferred is None:
                        batch = self.queue[:SLOTS]
                        del self.queue[:SLOTS]
                        more = bool(self.queue)
        self._run_cycle(batch, more, beat, deferred)

    def cycle_once(self) -> None:
        """Exactly one cycle, whatever is queued (a heartbeat when nothing is): the set's turn in
        one of the loop's iterations (lockstep mode), run by the loop, which holds ``driver``."""
        try:
            with self.cond:
                if self.failed or self.stopping:
                    return
                deferred = self.held.take(True)  # (a list opened before the loop went lockstep)
                batch = self.queue[:SLOTS] if deferred is None else None
                if batch is not None:
                    del self.queue[:SLOTS]
                more = bool(self.queue)
            self._run_cycle(batch, more, not (batch or self.mine or self.join_req), deferred)
        finally:
            self.reopen()

    def _run_cycle(self, batch, more: bool, beat: bool, deferred) -> None:
        """A pending list's cycle (`deferred`), or a cycle announcing `batch`; a failure fails the
        set (every waiter hears of it)."""
        if deferred is not None:
            agreed.flush(self, deferred)
            return
        try:
            with self.streams.cycle():
                self.progress, self.others_more = self._cycle(batch, more, beat=not batch and beat)
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self.fail_with(e)

    def drive(self, handle: Handle) -> None:
        """Waits for `handle`, running cycles on this (the caller's) thread while no other cycle
        runs, where the loop lets a caller (loop.free)."""
        self._drive(handle.event.is_set, handle.event.wait)

    def drive_held(self, lst) -> None:
        """drive for a held list (agreed.py): until it is done, failed or handed on."""
        self._drive(lambda: lst.state >= agreed.DONE, lst.wait)

    def _drive(self, done, wait) -> None:
        while not done():
            if self.failed is not None or self.stopping or not self.loop.free:
                wait(0.01)
                continue
            if self.driver.acquire(blocking=False):
                try:
                    if not done() and self.loop.free:
                        with torch.no_grad():
                            self.step(waiter=True)
                finally:
                    self.driver.release()
            else:
                wait(0.0005)

    # ---- the fast paths' interface (agreed.py): a cycle that a caller opens with an agreed step --
    def quiet_for(self, names) -> bool:
        """Whether a caller holding ``driver`` may run an agreed step of `names` as the set's cycle:
        the loop is free (the caller checked before it took ``driver``: a cycle may have changed
        it meanwhile), the set is idle (nothing queued, announced, held or joining; not failed or stopping) and
        no name is in flight (queued, such an op gets Horovod's duplicate-name error)."""
        with self.cond:
            if (not self.loop.free or self.failed is not None or self.stopping or self.queue or self.mine or self.table
                    or self.held.has_open or self.held.has_sealed or self.join_req is not None or self.joined):
                return False
            return not any(nm in self.in_flight for nm in names)

    def cycled(self, progress: bool | None, others_more: bool | None = False) -> None:
        """A caller's agreed step counts as a cycle of the set. `progress` None: the step said no,
        and the cycle goes on into negotiate_first, which tells what it achieved."""
        self.cycles += 1
        self.last_cycle = self.last_beat = time.monotonic()
        if progress is not None:
            self.progress = progress
            if others_more is not None:
                self.others_more = others_more

    def negotiate_first(self, reqs: list[Request], tl) -> None:
        """The agreed step said no on every member: `reqs` go first into the queue and on into
        this cycle's negotiation, exactly as a queued cycle goes on (_cycle)."""
        with self.cond:
            self.held.accepting = False  # until the negotiation is over (_reopen)
            for r in reqs:
                self.in_flight[r.name] = r
            self.queue[:0] = reqs
            batch = self.queue[:SLOTS]
            del self.queue[:SLOTS]
            more = bool(self.queue)
        for r in batch:  # from here a failure of the set completes them with its error
            self.mine[r.nhash] = r
        try:
            self.progress, self.others_more = self._negotiate(batch, more, tl, False)
        except BaseException as e:  # noqa: BLE001
            self.fail_with(e)

    def negotiate_list(self, key: int) -> bool:
        """A pending list's cycle across hosts (no agreed step): a negotiation whose message
        carries the list's key. Whether every member announced the same key."""
        self.progress, self.others_more = self._negotiate([], False, None, False, list_key=key)
        return self.list_agreed

    def wake(self) -> None:
        """Tells the loop to look again (a pending list to time, a poll)."""
        with self.cond:
            self.cond.notify_all()

    def reopen(self) -> None:
        with self.cond:
            self._reopen()

    def fail_with(self, e: BaseException) -> HorovodInternalError:
        """Fails the set with `e` as Horovod's error (what a cycle raised); returns that error."""
        err = e if isinstance(e, HorovodInternalError) else HorovodInternalError(str(e))
        self._fail(err)
        return err

    def _fail(self, error: BaseException, stopping: bool = False) -> None:
        with self.cond:
            if not stopping and self.failed is None:
                self.failed = error
            reqs = list(self.mine.values()) + self.queue + ([self.join_req] if self.join_req else [])
            held = self.held.take_all()  # and holds no more
            self.mine.clear()
            self.queue.clear()
            self.in_flight.clear()
            self.join_req = None
        for r in reqs:
            r.handle.part_done(r, error)
        for lst in held:
            lst.fail(str(error))
        if not stopping and not self.peer_left:
            log.warning("hvd: process set %d failed: %s", self.entry.id, error)

    def _cycle(self, batch: list[Request], more: bool, beat: bool = False) -> tuple[bool, bool]:
        """One cycle: the agreed step where the set has it, then the negotiation if it said no.
        `beat`: a heartbeat, which does not count as use of the set (plan)."""
        self.cycles += 1
        self.last_beat = time.monotonic()
        if not beat:
            self.last_cycle = self.last_beat
        tl = timeline.ACTIVE[0] if STATE.rank == 0 else None
        if tl is not None:
            tl.mark_cycle_start()
        joining = self.join_req is not None and self.me not in self.joined
        waiting = bool(self.mine)
        for r in batch:  # from here a failure of the set completes them with its error (_fail)
            self.mine[r.nhash] = r
        if self.agreed_ok:
            # Every member opens every cycle with the agreed op, so all stay in step whatever
            # each offers; any member's "no" sends all of them to the negotiation below.
            offer_ok = tl is None and not joining and not self.joined and not more and not waiting and not self.table
            if agreed.offer(self, batch[0] if offer_ok and len(batch) == 1 else None):
                self.loop.note_active()  # (every member offered the op: every member has work)
                return True, False
        return self._negotiate(batch, more, tl, joining)

    def _negotiate(self, batch: list[Request], more: bool, tl, joining: bool, list_key: int = 0) -> tuple[bool, bool]:
        """The cycle's negotiation: announce `batch`, gather every member's announcements, run
        what is ready. Returns (progress, some member has more queued). `list_key`: the key of
        the pending list this member runs in the cycle (a set across hosts, agreed.flush);
        `list_agreed` then says whether every member announced the same."""
        recs = [r.record() for r in batch]
        if joining:
            recs.append(self.join_req.record())
        m = self.msg_arr
        m[0] = len(recs)
        m[1] = ((MORE if more else 0) | (STALLED if self.stalls.stalled else 0) | (LEAVING if self.leaving else 0)
                | (ACTIVE if recs or self.loop.busy() else 0))
        m[2] = list_key
        if recs:
            m[HEADER:HEADER + len(recs) * FIELDS] = array("q", [x for rec in recs for x in rec])
        if self.size > 1:
            all_gather_single(self.gathered, self.msg, group=self.group)
            g = self.gathered_arr
        else:
            g = m
        self.rounds += 1
        width = self.width
        announced = 0
        flags = []
        self.list_agreed = list_key != 0 and all(g[member * width + 2] == list_key for member in range(self.size))
        for member in range(self.size):
            base = member * width
            n = g[base]
            flags.append(g[base + 1])
            if not n:
                continue
            announced += n
            for i in range(n):
                at = base + HEADER + i * FIELDS
                rec = g[at:at + FIELDS].tolist()
                if rec[2] & 0xFF == JOIN:
                    self.joined.setdefault(member, self.rounds)
                    continue
                entry = self.table.get(rec[0])
                if entry is None:
                    entry = self.table[rec[0]] = Announced()
                    if tl is not None:
                        mine = self.mine.get(rec[0])
                        if mine is not None:
                            tl.negotiate_start(mine.name, mine.desc[0])
                entry.recs[member] = rec
                if tl is not None and rec[0] in self.mine:
                    tl.negotiate_rank_ready(self.mine[rec[0]].name, member)
        if self.agreed_ok is None:  # the set's first cycle (it made the group's CPU engine)
            self._agree_settings()
        others_more = any(f & MORE for f in flags)
        if any(f & ACTIVE for f in flags):
            self.loop.note_active()
        if any(f & LEAVING for f in flags) and not self.leaving:  # a member shut Horovod down: all stop
            self.peer_left = True  # (an orderly end: nothing to warn of unless an op is refused)
            err = HorovodInternalError(SHUT_DOWN)
            err.peer_lost = False  # it left in order: the next init needs no shrink
            raise err
        if any(f & STALLED for f in flags):  # some member saw a stall past the shutdown time: all stop
            err = HorovodInternalError(f"{SHUT_DOWN} (a request waited on other ranks for longer than "
                                       f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.stalls.shutdown_after})")
            err.peer_lost = False  # every member is there: the next init needs no shrink
            raise err
        self.stalls.inspect(self)
        needed = self.size - len(self.joined)
        # Ready: announced by every member that has not joined. While a member has joined, an op
        # that cannot run with a joined rank is ready (as Horovod's error) on whoever announced it:
        # the others need not announce it under the same name (an unnamed op's number counts the
        # ops each rank issued, and the joined rank issued fewer).
        ready = [(h, e) for h, e in self.table.items()
                 if needed > 0 and (len(e.recs.keys() - self.joined.keys()) >= needed
                                    or (self.joined and _kind_of(e) in JOIN_UNSUPPORTED))]
        for h, _ in ready:
            del self.table[h]
        if ready:
            execute.run(self, ready, tl)
        if self.joined and len(self.joined) == self.size:
            self._finish_join()
            return True, others_more
        return bool(ready) or announced > 0, others_more

    def _agree_settings(self) -> None:
        """Once per set, in its first negotiation (every member runs it): what each member would
        otherwise decide alone. Fusion is the set's rank 0's threshold on every member, as
        Horovod's coordinator fuses for all ranks (a member whose HOROVOD_FUSION_THRESHOLD
        differs says so); the agreed step is used only where every member has it."""
        self.backend = self.group._get_backend(torch.device("cpu"))
        mine = torch.tensor([self.fusion_threshold, int(bool(self.backend._agreed_available))], dtype=torch.int64)
        every = torch.empty(2 * self.size, dtype=torch.int64)
        all_gather_single(every, mine, group=self.group)
        pairs = every.view(self.size, 2).tolist()
        threshold = pairs[0][0]
        if threshold != self.fusion_threshold:
            log.warning("hvd: HOROVOD_FUSION_THRESHOLD is %d on this rank (%d of process set %d) and %d on the "
                        "set's rank 0 (%d): every rank fuses with rank 0's, as Horovod's coordinator does",
                        self.fusion_threshold, STATE.rank, self.entry.id, threshold, self.entry.ranks[0])
            self.fusion_threshold = threshold
            self.held.threshold = threshold
        self.agreed_ok = all(p[1] for p in pairs)

    def _finish_join(self) -> None:
        last_cycle = max(self.joined.values())
        last = max(m for m, c in self.joined.items() if c == last_cycle)
        self.joined.clear()
        req = self.join_req
        self.join_req = None
        if req is not None:
            req.result = self.entry.ranks[last]
            req.handle.part_done(req)

    def complete(self, req: Request, error: BaseException | None = None) -> None:
        """Called by execute for each of this rank's requests, once its result is in place."""
        self.mine.pop(req.nhash, None)
        with self.cond:
            self.in_flight.pop(req.name, None)
        req.handle.part_done(req, error)


_CONTROLLERS: dict[int, SetController] = {}  # this rank's sets by id (the loop keeps it: loop.py)
THREAD_INIT: list = []  # callables the loop's thread runs first (the CUDA double's tests)


def set_timeline(tl) -> None:
    """Turns the timeline on (a Timeline) or off (None). While it is on, no set holds ops
    (agreed.py): each op is a request, so that the timeline shows it."""
    timeline.ACTIVE[0] = tl
    for c in list(_CONTROLLERS.values()):
        with c.cond:
            c._reopen()


def controller_for(entry) -> SetController:
    c = entry.controller
    if c is None:
        raise HorovodInternalError(SHUT_DOWN)
    return c
