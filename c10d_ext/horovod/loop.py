"""Horovod's background loop on myccl: one thread per process runs the cycles of every process
set this rank is a member of (controller.SetController holds each set's state and its cycle).

The loop has two modes, the same on every rank at every point, because both follow from the table
of registered sets, which every rank holds, and the table changes only at an agreed point:

* **free**, while the job has at most one set of two or more members (a job without
  ``process_sets``): nothing can be ordered differently between ranks, so each set cycles when it
  has work; a caller waiting on an op runs the cycle on its own thread, and asynchronous
  allreduces are held for one agreed step (agreed.py).
* **lockstep**, once two sets of two or more members exist: every *iteration* runs exactly one
  cycle of each of this rank's sets, in set-id order, as Horovod's background thread does. The
  n-th iteration of every rank then holds the n-th cycle of each of its sets, so the data
  collectives of all sets start in one order on every rank: NCCL needs that order for two
  communicators that share ranks. Only the loop runs cycles, and nothing is held.

An idle member still takes part in its sets' cycles: in free mode through a heartbeat cycle once a
second (HEARTBEAT_SECONDS), in lockstep mode through an iteration at every cycle time while some
member of one of its sets has work or had work within AWAKE_SECONDS (the ACTIVE flag of the
negotiation's message says so), and at the heartbeat otherwise. So a rank busy outside Horovod
never leaves a peer's cycle waiting on it past the group's timeout.

Adding or removing a set takes effect inside a cycle of the global set (a barrier request whose
completion applies it), so that every rank changes its list of sets, and perhaps its mode, between
the same two cycles of the global set.
"""

from __future__ import annotations

import math
import threading
import time

import torch

from . import agreed, controller as C
from .exceptions import SHUT_DOWN, HorovodInternalError
from .records import BARRIER, Handle, Request


class EngineLoop(threading.Thread):
    def __init__(self, lockstep: bool):
        super().__init__(name="hvd-loop", daemon=True)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # every set's cond: a submit wakes the loop
        self.driver = threading.Lock()  # held by whoever runs a cycle, of any set
        self.sets: list[C.SetController] = []  # this rank's sets, by id
        self.lockstep = lockstep
        self.mode = 0  # counts changes of the set list (attach, detach)
        self.stopping = False
        self.asleep = False  # nobody looks at any set until told (SetController.asleep)
        self.last_iteration = -math.inf
        self.active_until = 0.0  # lockstep: iterate at cycle time until then (note_active)
        self.urgent = False  # lockstep: a synchronous op's caller waits, so the next iteration runs at once
        self.cycle_time = C._cycle_seconds()

    @property
    def free(self) -> bool:
        """Whether a caller may run a cycle on its own thread (free mode)."""
        return not self.lockstep

    def busy(self) -> bool:
        """Whether some set of this process has work (a hint for the peers: the ACTIVE flag)."""
        return any(c._has_work() for c in self.sets)

    def note_active(self) -> None:
        self.active_until = time.monotonic() + agreed.AWAKE_SECONDS

    # ---- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        # Grad mode is per thread: the data ops here must never record autograd history (the
        # ops' autograd Functions wrap the caller's side).
        for fn in C.THREAD_INIT:
            fn()
        with torch.no_grad():
            while True:
                job, mode = self._next()
                if job is None:
                    break
                with self.driver:
                    # A caller's cycle may have changed the mode (a set added or removed) while this
                    # thread waited for the driver: a job chosen for the other mode must not run.
                    if mode == self.mode:
                        job()
            with self.driver:
                self._leave()

    def _next(self):
        """Waits for what runs next: a set's cycle (free), an iteration (lockstep), None: stop;
        with the mode it was chosen in."""
        with self.cond:
            while not self.stopping:
                now = time.monotonic()
                job, wake, sleeping = (self._next_lockstep if self.lockstep else self._next_free)(now)
                if job is not None:
                    return job, self.mode
                self.asleep = sleeping
                # (a timed pending list begun before `asleep` was set was not told: agreed.added)
                if sleeping and any(agreed.pending_due(c) != math.inf for c in self.sets):
                    self.asleep = False
                    continue
                self.cond.wait(None if wake == math.inf else max(0.0, wake - now))
                self.asleep = False
        return None, self.mode

    def _next_free(self, now: float):
        wake, sleeping = math.inf, True
        for c in self.sets:
            if c.failed is not None or c.stopping:
                continue
            at, what = c.plan(now)
            if what in (C.STEP, C.BEAT) and at <= now:
                beat = what == C.BEAT
                return (lambda: c.step(beat=beat)), 0.0, False
            if what != C.SLEEP:
                sleeping = False
            wake = min(wake, at)
        return None, wake, sleeping

    def _next_lockstep(self, now: float):
        if self.busy():
            self.note_active()
        awake = now < self.active_until
        at = self.last_iteration + (self.cycle_time if awake else C.HEARTBEAT_SECONDS)
        if now >= at or self.urgent:
            return self._iterate, 0.0, False
        return None, at, not awake

    def _iterate(self) -> None:
        """One cycle of each of this rank's sets, in set-id order. A set added or removed during
        the iteration (in the global set's cycle) counts from the next one, on every rank."""
        self.last_iteration = time.monotonic()
        self.urgent = False
        for c in list(self.sets):
            c.cycle_once()

    def _leave(self) -> None:
        """hvd.shutdown on this rank: one last cycle of each set, in set-id order (the order of the
        peers' iterations), tells the others; then every op still waiting fails as shut down."""
        for c in list(self.sets):
            c.leave()
            if c.failed is None:
                c._fail(HorovodInternalError(SHUT_DOWN), stopping=True)

    # ---- the table -----------------------------------------------------------------------------
    def attach(self, ctrl, lockstep: bool) -> None:
        with self.cond:
            if ctrl is not None:
                self.sets.append(ctrl)
                self.sets.sort(key=lambda c: c.entry.id)
            self._mode(lockstep)

    def detach(self, ctrl, lockstep: bool) -> None:
        with self.cond:
            if ctrl is not None and ctrl in self.sets:
                self.sets.remove(ctrl)
                ctrl.stopping = True
            self._mode(lockstep)

    def _mode(self, lockstep: bool) -> None:
        self.lockstep = lockstep
        self.mode += 1
        for c in self.sets:
            c._reopen()
        self.cond.notify_all()


_LOOP: list = [None]  # the process's EngineLoop while Horovod is initialized


def _lockstep(entries) -> bool:
    """The mode every rank derives from the set table: two sets of two or more members."""
    return sum(1 for e in entries if len(e.ranks) > 1) >= 2


def _adopt(c) -> None:
    """Makes controller `c` the one its set's ops reach (_forget undoes it)."""
    c.entry.controller = c
    C._CONTROLLERS[c.entry.id] = c


def start_all(entries) -> None:
    """Starts the loop with every set of `entries` (process_sets' table) this rank is in."""
    entries = list(entries)
    loop = EngineLoop(_lockstep(entries))
    for e in sorted(entries, key=lambda e: e.id):
        if e.group is not None:
            c = C.SetController(e, loop)
            _adopt(c)
            loop.sets.append(c)
    _LOOP[0] = loop
    loop.start()


def _forget(c) -> None:
    c.entry.controller = None
    c.held.close()
    if C._CONTROLLERS.get(c.entry.id) is c:
        del C._CONTROLLERS[c.entry.id]
    if agreed.OWNERS.get(c.entry.id) is c:
        del agreed.OWNERS[c.entry.id]


def _abort(group) -> None:
    try:
        backend = group._get_backend(torch.device("cpu"))
        if hasattr(backend, "abort"):
            backend.abort()
    except Exception:  # noqa: BLE001
        pass


def stop_all(grace: float = 5.0) -> bool:
    """Stops the loop (its last cycles tell the peers); returns whether any set had failed (a lost
    or broken peer)."""
    loop = _LOOP[0]
    _LOOP[0] = None
    if loop is None:
        return False
    with loop.cond:
        loop.stopping = True
        for c in loop.sets:
            c.stopping = True
            c.held.accepting = False
        loop.cond.notify_all()
    loop.join(grace)
    if loop.is_alive():  # blocked in a collective whose peers are gone: unblock it
        for c in loop.sets:
            _abort(c.group)
        loop.join(grace)
        for c in loop.sets:
            c.failed = c.failed or HorovodInternalError(SHUT_DOWN)
    failed = False
    for c in loop.sets:
        _forget(c)
        failed = failed or (c.failed is not None and getattr(c.failed, "peer_lost", True))
    return failed


class _Change(Handle):
    """A barrier of the global set whose completion, inside that set's cycle, changes the loop."""

    __slots__ = ("apply",)

    def part_done(self, req: Request, error: BaseException | None = None) -> None:
        if error is None and self.error is None:
            self.apply()
        super().part_done(req, error)


def _at_agreed_point(apply, what: str) -> None:
    """Runs `apply` between the same two cycles of the global set on every rank (every rank
    calls it: adding and removing a set are collective)."""
    g = C._CONTROLLERS.get(0)
    if g is None or g.size == 1:  # (no peer: nothing to agree with)
        apply()
        return
    req = Request(BARRIER, f"process_set.{what}", None)
    h = _Change([req], None)
    h.apply = apply
    g.submit([req])
    g.drive(h)
    while not h.event.wait(0.1):
        pass
    if h.error is not None:
        raise HorovodInternalError(str(h.error))


def add_set(entry, entries) -> None:
    """Puts a newly registered set into the loop at the agreed point (collective)."""
    loop = _LOOP[0]
    c = C.SetController(entry, loop) if entry.group is not None else None
    lockstep = _lockstep(entries)

    def apply():
        if c is not None:
            _adopt(c)
        loop.attach(c, lockstep)

    _at_agreed_point(apply, f"add.{entry.id}")


def remove_set(entry, remaining) -> None:
    """Takes a set out of the loop at the agreed point (collective); its waiting ops fail as
    shut down."""
    loop = _LOOP[0]
    c = entry.controller
    _at_agreed_point(lambda: loop.detach(c, _lockstep(remaining)), f"remove.{entry.id}")
    if c is not None:
        c._fail(HorovodInternalError(SHUT_DOWN), stopping=True)
        _forget(c)
