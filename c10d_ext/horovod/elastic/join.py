"""A new process joining a running elastic job, through torch's reconfigure regime.

Horovod's elastic driver discovers a new host, tells the workers, and they reset into a larger
world at their next ``state.commit()``. Here there is no driver: a process started with the job's
rendezvous variables (``MASTER_ADDR`` / ``MASTER_PORT``, or ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` /
``_PORT``) and ``HOROVOD_ELASTIC_JOIN=1`` registers in the job's store from its ``hvd.init()`` and
waits there. At the next commit the job's rank 0 admits every registered process (a new
generation: the old ranks in their order, then the new ones in the order they came), and the
commit raises ``HostsUpdatedInterrupt`` on every rank alike (hosts added: the state is synced
after the reset). The reset's ``init()`` then makes the world of that generation on every member,
old and new: each makes a default group of backend "myccl" in torch's reconfigure regime
(``enable_reconfigure=True``, its rank and size already known), publishes its reconfigure
handle, and all reconfigure with the handles in rank order. The state's sync then brings the new
processes to rank 0's committed state, and training goes on.

Leaving works the same way, for the launcher's elastic mode (driver.py): when a host leaves the
discovery, the driver writes a leave request naming each of its workers (``leave/<n>``; every
worker publishes its name under its rank, ``member/<rank>``, at each init). At the next commit
rank 0 makes a generation without them (and without a requested joiner), the commit raises
``HostsUpdatedInterrupt`` everywhere (hosts removed only: no sync, as Horovod), and in the reset's
``init()`` a process that is not a member of the new generation prints that it was removed and
exits with status 0; the others make the new world as above.

Needs torch >= 2.14 (the reconfigure API), a default group that Horovod made itself (from the
launcher's variables; a script's own default group is left alone and joiners are not admitted),
and an elastic loop that commits (where admission happens). The store keys live under
``hvd/elastic/`` in the job's store.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ... import config
from ..basics import STATE, _rendezvous, _timeout
from ..exceptions import HorovodInternalError

PREFIX = "hvd/elastic"


def _elastic_store():
    return dist.PrefixStore(PREFIX, STATE.job_store)


def _can_reconfigure() -> bool:
    return hasattr(dist, "_reconfigure")


def _needs_reconfigure() -> None:
    if not _can_reconfigure():
        raise HorovodInternalError(
            f"Horovod: joining a running job needs torch's reconfigure API (torch 2.14 or newer); "
            f"this is torch {torch.__version__}")


def wants_to_join() -> bool:
    """Whether this process's first init joins a running job (HOROVOD_ELASTIC_JOIN=1)."""
    return os.environ.get("HOROVOD_ELASTIC_JOIN", "0") not in ("", "0") and STATE.job_store is None


def join_running_job() -> None:
    """This process's first init: register in the job's store, wait to be admitted (at the job's
    next commit), then make the generation's world with the others."""
    _needs_reconfigure()
    addr, port = _rendezvous()
    if not addr or port is None:
        raise ValueError("Horovod initialization failed: HOROVOD_ELASTIC_JOIN=1 needs the running job's "
                         "rendezvous address: set MASTER_ADDR and MASTER_PORT (or "
                         "HOROVOD_GLOO_RENDEZVOUS_ADDR and HOROVOD_GLOO_RENDEZVOUS_PORT).")
    STATE.job_store = dist.TCPStore(addr, port, is_master=False, timeout=_timeout())
    store = _elastic_store()
    me = store.add("joiners", 1)  # 1, 2, ... in the order joiners came
    store.set(f"who/{me}", config.value("MYCCL_HVD_WORKER_ID"))  # the elastic launcher's name for it
    store.add("changes", 1)  # (after its keys: rank 0 reads them when it sees the count move)
    gen, members = json.loads(store.get(f"admit/{me}"))  # waits for the job's next commit
    make_world(gen, members, f"j{me}")


_seen = [-1]  # the "changes" count this process's last admit() saw (a hint: the counters decide)


def publish_member() -> None:
    """Names this process (the elastic launcher's worker id) under its rank, for rank 0's
    admissions; called at every init, before its first collective."""
    wid = config.value("MYCCL_HVD_WORKER_ID")
    if wid and STATE.job_store is not None and STATE.made_default:
        _elastic_store().set(f"member/{STATE.rank}", wid)


def admit() -> tuple[int, list[str]] | None:
    """On the job's rank 0, at a commit: the new generation when processes are waiting to join or
    the launcher asked members to leave (the admissions are written to the store), else None.
    Cheap when nothing changed: one store round trip."""
    s = STATE
    if s.job_store is None or not s.made_default or s.size != dist.get_world_size() or not _can_reconfigure():
        return None
    store = _elastic_store()
    changes = store.add("changes", 0)  # bumped by every joiner and leave request, after its own keys
    if changes == _seen[0]:
        return None
    _seen[0] = changes
    waiting, admitted, leaves, handled = (store.add(k, 0) for k in ("joiners", "admitted", "leaves", "leaves_handled"))
    if waiting <= admitted and leaves <= handled:
        return None
    gone = {store.get(f"leave/{k}").decode() for k in range(1, leaves + 1)}
    store.add("leaves_handled", leaves - handled)
    new = list(range(admitted + 1, waiting + 1))
    joiners = [j for j in new if store.get(f"who/{j}").decode() not in gone]
    names = [store.get(f"member/{r}").decode() if store.check([f"member/{r}"]) else "" for r in range(s.size)]
    stay = [r for r in range(s.size) if names[r] not in gone] or list(range(s.size))  # (never nobody)
    if len(stay) == s.size and not joiners:
        members, gen = [], 0  # nothing changes; a refused joiner learns it is not a member
    else:
        gen = store.add("generation", 1)
        members = [f"r{r}" for r in stay] + [f"j{j}" for j in joiners]
    if new:
        store.add("admitted", waiting - admitted)
        text = json.dumps([gen, members])
        for j in new:
            store.set(f"admit/{j}", text)
    return (gen, members) if members else None


def make_world(gen: int, members: list[str], me: str) -> None:
    """Makes generation `gen`'s default group on this member (`me` in `members`): a group in the
    reconfigure regime, its handle published, then reconfigured with every member's handle."""
    if me not in members:
        _leave()
    _needs_reconfigure()
    s = STATE
    rank, size = members.index(me), len(members)
    store = dist.PrefixStore(f"gen/{gen}", _elastic_store())
    timeout = _timeout()
    dist.init_process_group("myccl", store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                            timeout=timeout, enable_reconfigure=True)
    store.set(f"handle/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"handle/{r}").decode() for r in range(size)]
    dist._reconfigure(gen, handles, timeout=timeout).wait()
    s.world = (rank, size)
    s.generation, s.incarnation = gen, 0  # newcomers and old ranks count resets alike from here


def _leave() -> None:
    """This process is not in the job's new generation: its host left the elastic launcher's
    discovery. It ends here, cleanly (Horovod's worker fails its reset with the same words)."""
    host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
    wid = config.value("MYCCL_HVD_WORKER_ID")
    print(f"Horovod: {host} ({wid or 'this worker'}) has been removed from elastic job; exiting", file=sys.stderr,
          flush=True)
    raise SystemExit(0)


__all__ = ["admit", "join_running_job", "make_world", "publish_member", "wants_to_join"]
