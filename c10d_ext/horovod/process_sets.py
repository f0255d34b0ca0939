"""Horovod's process sets: ``ProcessSet``, ``global_process_set``, ``add_process_set`` and
``remove_process_set``. Each registered set is a myccl group of its own with its own controller
(negotiation, fusion and name space are per set, as in Horovod), whose cycles the process's
engine loop runs (loop.py)."""

from __future__ import annotations

import os
from typing import Sequence

import torch.distributed as dist

from . import loop
from .basics import STATE, _check
from ._torch import all_gather_single


class ProcessSet:
    """A subset of Horovod's ranks that collectives can run on (``process_set=`` of every op)."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            ranks = None
        if ranks is None or not all(isinstance(r, int) for r in ranks):
            if type(ranks_or_comm).__module__.startswith("mpi4py"):
                raise ValueError(
                    "Apparently you tried to build a ProcessSet from an MPI communicator, but "
                    "Horovod has not been built with MPI support. Ensure MPI is installed and "
                    "reinstall Horovod with HOROVOD_WITH_MPI=1 to debug the build error."
                )
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object"
            )
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def _entry(self):
        _check()
        entry = _TABLE.get(self.process_set_id)
        if entry is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return entry

    def size(self):
        if self.process_set_id is None:
            return None
        return len(self._entry().ranks)

    def rank(self):
        if self.process_set_id is None:
            return None
        entry = self._entry()
        if STATE.rank not in entry.ranks:
            raise ValueError("Process is not part of provided process set.")
        return entry.ranks.index(STATE.rank)

    def included(self):
        if self.ranks is None:
            return None
        return STATE.rank in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


class _Entry:
    __slots__ = ("id", "ranks", "group", "controller")

    def __init__(self, psid: int, ranks: list[int], group):
        self.id = psid
        self.ranks = ranks
        self.group = group  # None where this rank is not a member
        self.controller = None


_TABLE: dict[int, _Entry] = {}

global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _dynamic() -> bool:
    try:
        return int(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0")) > 0
    except ValueError:
        return False


def _new_group(ranks: list[int]):
    """A myccl group of the hvd ranks `ranks`; every hvd rank calls it (Horovod's registration
    is collective too). Returns None on the ranks outside."""
    torch_ranks = [STATE.torch_ranks[r] for r in ranks]
    local = len(STATE.torch_ranks) != dist.get_world_size()
    if local and STATE.rank not in ranks:
        return None
    group = dist.new_group(torch_ranks, backend="myccl", use_local_synchronization=local, timeout=STATE.group_timeout)
    return group if STATE.rank in ranks else None


def _register(ps: ProcessSet, psid: int) -> None:
    bad = [r for r in ps.ranks if r < 0 or r >= STATE.size]
    if bad:
        raise ValueError(f"Tried to register process set with invalid rank: {bad[0]}")
    if len(set(ps.ranks)) != len(ps.ranks):
        dup = next(r for r in ps.ranks if ps.ranks.count(r) > 1)
        raise ValueError(f"Tried to register process set with duplicate rank: {dup}")
    _TABLE[psid] = _Entry(psid, list(ps.ranks), _new_group(ps.ranks))
    ps.process_set_id = psid


def _init_sets(process_sets) -> None:
    _TABLE.clear()
    global_process_set.ranks = list(range(STATE.size))
    global_process_set.process_set_id = 0
    _TABLE[0] = _Entry(0, list(range(STATE.size)), STATE.group)
    seen = [tuple(global_process_set.ranks)]
    for idx, ps in enumerate(process_sets or []):
        if not isinstance(ps, ProcessSet):
            ps = ProcessSet(ps)
        if tuple(ps.ranks) in seen:
            ps._invalidate()
            raise ValueError(
                f"Horovod could not be initialized because process_sets entry number {idx} is a duplicate: {ps}"
            )
        seen.append(tuple(ps.ranks))
        _register(ps, len(_TABLE))


def _drop_sets(destroy: bool) -> None:
    for psid, entry in list(_TABLE.items()):
        if psid != 0 and entry.group is not None and destroy:
            try:
                dist.destroy_process_group(entry.group)
            except Exception:  # noqa: BLE001
                pass
    _TABLE.clear()


def _lookup(process_set: ProcessSet, op: str) -> _Entry:
    """The set an op runs on, with Horovod's enqueue-time checks (ValueError)."""
    entry = _TABLE.get(process_set.process_set_id) if process_set.process_set_id is not None else None
    if entry is None:
        raise ValueError(f"{op}: Process set provided does not exist, or has not been registered.")
    if STATE.rank not in entry.ranks:
        raise ValueError(f"{op}: Rank {STATE.rank} is not a member of the provided process set.")
    return entry


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Registers a process set after init (collective: every Horovod process calls it with the
    same ranks). Needs HOROVOD_DYNAMIC_PROCESS_SETS=1 or ``init(process_sets="dynamic")``."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.mpi_comm is not None:
        raise NotImplementedError(
            "Dynamically adding process sets defined by an MPI communicator is not implemented. "
            "Please build the process set via a list of ranks."
        )
    _check()
    if not _dynamic():
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod initialization."
        )
    if any(e.ranks == process_set.ranks for e in _TABLE.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    _agree(process_set.ranks, "register process set")
    psid = next(i for i in range(1, len(_TABLE) + 2) if i not in _TABLE)  # ids are recycled
    _register(process_set, psid)
    try:
        loop.add_set(_TABLE[psid], _TABLE.values())
    except BaseException:
        entry = _TABLE.pop(psid)
        process_set._invalidate()
        if entry.group is not None:
            dist.destroy_process_group(entry.group)
        raise
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a set (collective). False for the global set or an unregistered one."""
    psid = process_set.process_set_id
    if psid is None or psid == 0:
        return False
    process_set._invalidate()
    _check()
    if not _dynamic():
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod initialization."
        )
    entry = _TABLE.get(psid)
    if entry is None:
        return False
    _agree(entry.ranks, "remove process set")
    loop.remove_set(entry, [e for e in _TABLE.values() if e is not entry])
    del _TABLE[psid]
    if entry.group is not None:
        dist.destroy_process_group(entry.group)
    return True


def _agree(ranks: list[int], what: str) -> None:
    """Every rank must name the same ranks (Horovod's registration check), over the admin group."""
    import torch

    if STATE.size == 1:
        return
    mine = torch.tensor([len(ranks), hash(tuple(ranks)) & 0x7FFFFFFFFFFF], dtype=torch.int64)
    every = torch.empty(2 * STATE.size, dtype=torch.int64)
    all_gather_single(every, mine, group=STATE.admin)
    pairs = every.view(-1, 2).tolist()
    if len({p[0] for p in pairs}) > 1:
        raise ValueError(f"Attempted to {what} with mismatching size on different ranks")
    if len({p[1] for p in pairs}) > 1:
        raise ValueError(f"Attempted to {what} with mismatching values on different ranks")
