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

Needs torch >= 2.14 (the reconfigure API), a default group that Horovod made itself (from the
launcher's variables; a script's own default group is left alone and joiners are not admitted),
and an elastic loop that commits (where admission happens). The store keys live under
``hvd/elastic/`` in the job's store.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

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
    store.set(f"who/{me}", os.environ.get("MYCCL_HVD_WORKER_ID", ""))  # the elastic launcher's name for it
    gen, members = json.loads(store.get(f"admit/{me}"))  # waits for the job's next commit
    make_world(gen, members, f"j{me}")


def admit() -> tuple[int, list[str]] | None:
    """On the job's rank 0, at a commit: the new generation when processes are waiting to join
    (their admission is written to the store), else None. Cheap when nobody waits: one store
    round trip."""
    s = STATE
    if s.job_store is None or not s.made_default or s.size != dist.get_world_size() or not _can_reconfigure():
        return None
    store = _elastic_store()
    waiting = store.add("joiners", 0)
    admitted = store.add("admitted", 0)
    if waiting <= admitted:
        return None
    gen = store.add("generation", 1)
    members = [f"r{r}" for r in range(s.size)] + [f"j{j}" for j in range(admitted + 1, waiting + 1)]
    store.add("admitted", waiting - admitted)
    text = json.dumps([gen, members])
    for j in range(admitted + 1, waiting + 1):
        store.set(f"admit/{j}", text)
    return gen, members


def make_world(gen: int, members: list[str], me: str) -> None:
    """Makes generation `gen`'s default group on this member (`me` in `members`): a group in the
    reconfigure regime, its handle published, then reconfigured with every member's handle."""
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


__all__ = ["admit", "join_running_job", "make_world", "wants_to_join"]
