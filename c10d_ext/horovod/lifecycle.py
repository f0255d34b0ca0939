"""hvd.init and hvd.shutdown, on a myccl process group.

Horovod's world is a myccl group of its own (never the default group itself), so the collectives
its background threads issue can never interleave with the ones the script issues through
``torch.distributed``. ``init`` starts from whatever launched the job:

* a default process group that already exists (the script or a framework made it): used as is;
* torchrun / torch.distributed.run: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
* horovodrun's variables: ``HOROVOD_RANK``, ``HOROVOD_SIZE`` and the rendezvous
  ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT`` (rank 0 serves a TCPStore there);
* mpirun and srun: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` (Open MPI), ``MV2_COMM_WORLD_RANK`` / ``_SIZE``
  (MVAPICH), ``PMI_RANK`` / ``PMI_SIZE`` (MPICH, Intel MPI), ``PMIX_RANK`` (PMIx), ``SLURM_PROCID`` /
  ``SLURM_NTASKS`` (a task of an srun step), with the rendezvous from the ``HOROVOD_GLOO_RENDEZVOUS_*``
  pair, ``MASTER_ADDR`` / ``MASTER_PORT``, or Slurm's job (launch_env.py);
* nothing: one process, as Horovod runs without a launcher.

After a collective failed because a rank was lost, ``shutdown(); init()`` (what elastic training
does) goes on with the survivors: they agree through ``c10d_ext.survivors`` and shrink the default
group with torch's ``shrink_group`` (torch 2.14+), renumbered in their old order.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import launch_env, loop, process_sets as ps_mod
from ._torch import all_gather_single
from .basics import STATE, _rendezvous, _timeout
from .exceptions import HorovodInternalError


def _make_default_group() -> None:
    """The default group from the launcher's variables (see the module's docstring); after a
    reset, on the job's store with the world as it was (or as a join made it)."""
    import c10d_ext  # noqa: F401  (registers "myccl")

    s = STATE
    if s.job_store is not None and s.world is not None:
        s.incarnation += 1
        rank, size = s.world
        dist.init_process_group("myccl", store=dist.PrefixStore(f"hvd/world/{s.generation}/{s.incarnation}",
                                                                 s.job_store), rank=rank, world_size=size)
        return
    if os.environ.get("RANK") is not None and os.environ.get("MASTER_ADDR"):
        dist.init_process_group("myccl")  # torchrun's env://
        s.job_store = _raw_store(dist.distributed_c10d._get_default_store())
        return
    launch = launch_env.detect(os.environ)
    if launch is None or launch.size == 1:
        store = dist.HashStore()
        dist.init_process_group("myccl", store=store, rank=0, world_size=1)
        return
    rank, size = launch.rank, launch.size
    addr, port = _rendezvous()
    if not addr or port is None:
        raise ValueError(launch_env.no_rendezvous_message(launch))
    store = dist.TCPStore(addr, port, size, is_master=(rank == 0), timeout=_timeout())
    dist.init_process_group("myccl", store=store, rank=rank, world_size=size)
    s.job_store = store


def _world_timeout() -> timedelta | None:
    """The default group's op timeout (what init_process_group or torchrun was given): Horovod's
    groups wait on a peer as long as the job's own collectives do. None: torch's default."""
    try:
        t = dist.group.WORLD._get_backend(torch.device("cpu")).timeout
    except Exception:  # noqa: BLE001 - not a myccl default group
        t = getattr(getattr(dist.group.WORLD, "options", None), "_timeout", None)
    return t if isinstance(t, timedelta) else None


def _raw_store(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _topology(group, ranks: list[int]) -> None:
    """local/cross ranks as Horovod defines them, from myccl's view of which ranks share a host
    (hosts numbered by their lowest rank): cross_rank is this host's index among the hosts that
    run a process with this local rank, cross_size how many such hosts there are."""
    import c10d_ext

    s = STATE
    if s.size == 1:
        s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.homogeneous = 0, 1, 0, 1, True
        return
    mine = torch.tensor([c10d_ext.cross_rank(group), c10d_ext.local_rank(group)], dtype=torch.int64)
    every = torch.empty(s.size * 2, dtype=torch.int64)
    all_gather_single(every, mine, group=group)
    pairs = every.view(s.size, 2).tolist()
    host = pairs[s.rank][0]
    per_host: dict[int, int] = {}
    for h, _ in pairs:
        per_host[h] = per_host.get(h, 0) + 1
    s.local_rank = pairs[s.rank][1]
    s.local_size = per_host[host]
    hosts_with = sorted({h for h, lr in pairs if lr == s.local_rank})
    s.cross_rank = hosts_with.index(host)
    s.cross_size = len(hosts_with)
    s.homogeneous = len(set(per_host.values())) == 1


def _shrink_after_loss() -> None:
    """The survivors of a lost rank agree on who is left and shrink the default group."""
    import c10d_ext

    s = STATE
    if not hasattr(dist, "shrink_group"):
        raise HorovodInternalError(
            f"Horovod: a rank was lost and going on without it needs torch's shrink_group "
            f"(torch 2.14 or newer); this is torch {torch.__version__}"
        )
    alive = c10d_ext.survivors(group=s.failed_group)  # hvd ranks, the same list on every survivor
    gone = [s.torch_ranks[r] for r in range(len(s.torch_ranks)) if r not in alive]
    if gone:
        dist.shrink_group(gone, shrink_flags=getattr(dist, "SHRINK_ABORT", 0))


def init(comm=None, process_sets=None) -> None:
    s = STATE
    with s.lock:
        if s.initialized:
            return
        launch_env.warn_ignored_tuning()
        if comm is not None and not isinstance(comm, (list, tuple)):
            if type(comm).__module__.startswith("mpi4py"):
                raise ValueError(
                    "Horovod has not been built with MPI support. Ensure MPI is installed and "
                    "reinstall Horovod with HOROVOD_WITH_MPI=1 to debug the build error."
                )
            raise ValueError(
                "Invalid type of argument comm. Expected list of rank integers or mpi4py.MPI.Comm "
                "object."
            )
        if isinstance(process_sets, str):
            if process_sets.lower() != "dynamic":
                raise ValueError(f"Invalid value of argument process_sets: {process_sets!r}")
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
            process_sets = None
        if s.lost_rank and (not dist.is_initialized() or dist.group.WORLD is not s.failed_default):
            s.lost_rank = False  # the job made a new default group itself: nothing to shrink
        if s.lost_rank:
            _shrink_after_loss()
            s.lost_rank = False
            s.failed_group = None
        if not dist.is_initialized():
            from .elastic import join

            if s.join is not None:  # admitted at the last commit: the new generation's world
                gen, members = s.join
                s.join = None
                join.make_world(gen, members, f"r{s.rank}")
            elif join.wants_to_join():
                join.join_running_job()
            else:
                _make_default_group()
            s.made_default = True
        import c10d_ext  # noqa: F401

        world = dist.get_world_size()
        ranks = sorted(set(comm)) if comm else list(range(world))
        if any(r < 0 or r >= world for r in ranks):
            raise ValueError(f"Horovod initialization failed: comm ranks {ranks} outside 0..{world - 1}")
        me = dist.get_rank()
        if me not in ranks:
            raise ValueError(f"Horovod initialization failed: this process (rank {me}) is not in comm {ranks}")
        s.torch_ranks = ranks
        s.rank = ranks.index(me)
        s.size = len(ranks)
        s.timeout = _timeout()
        s.group_timeout = _world_timeout()
        from .elastic import join

        join.publish_member()  # (before the first collective: rank 0's next commit finds every name)
        local = len(ranks) != world
        s.group = dist.new_group(ranks, backend="myccl", use_local_synchronization=local, timeout=s.group_timeout)
        s.admin = dist.new_group(ranks, backend="myccl", use_local_synchronization=local, timeout=s.group_timeout)
        _topology(s.admin, ranks)
        if os.environ.get("HOROVOD_ELASTIC") == "1":
            launch_env.export_topology(os.environ, s.rank, s.size, s.local_rank, s.local_size, s.cross_rank,
                                       s.cross_size)
        s.initialized = True
        ps_mod._init_sets(process_sets)
        loop.start_all(ps_mod._TABLE.values())
        if not s.atexit:
            atexit.register(shutdown)
            s.atexit = True


def shutdown() -> None:
    s = STATE
    with s.lock:
        if not s.initialized:
            return
        failed = loop.stop_all()
        s.lost_rank = s.lost_rank or failed
        if s.lost_rank:
            s.failed_group = s.group
            s.failed_default = dist.group.WORLD
        ps_mod._drop_sets(destroy=not s.lost_rank)
        for g in (s.group, s.admin):
            if g is not None and not s.lost_rank:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 - already torn down
                    pass
        s.group = s.admin = None
        s.initialized = False
        if s.made_default and not s.lost_rank and dist.is_initialized():
            s.world = (dist.get_rank(), dist.get_world_size())
            dist.destroy_process_group()
            s.made_default = False
