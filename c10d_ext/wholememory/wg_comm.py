"""pylibwholegraph.torch's start-up and communicators on myccl: init, init_torch_env(_and_create_wm_comm),
finalize, WholeMemoryCommunicator and the functions that make, split and destroy them.

A WholeMemoryCommunicator wraps a torch ProcessGroup (``wmb_comm``): a communicator made here is the
seed layer's ``Communicator`` (a myccl group made from a unique id that the default group carries),
and one wrapped by hand may be any group. The memory types and locations are named here once, for
``support_type_location`` and for wg_tensor.py.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from . import comm as comm_mod
from . import device as device_mod

__all__ = ["init", "init_torch_env", "init_torch_env_and_create_wm_comm", "finalize", "WholeMemoryCommunicator",
           "create_group_communicator", "split_communicator", "destroy_communicator", "get_global_communicator",
           "get_local_node_communicator", "get_local_device_communicator", "get_local_mnnvl_communicator"]

MEMORY_TYPES = ("continuous", "chunked", "distributed", "hierarchy")
LOCATIONS = ("cuda", "cpu")
_LOG_LEVELS = {"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG,
               "trace": logging.DEBUG}
_BACKENDS = ("nccl", "nvshmem")

log = logging.getLogger("c10d_ext.wholememory")


def fail(op: str, rank, text: str, exc=ValueError):
    """The project's error form: the op, the rank (where there is one) and what is wrong."""
    raise exc(f"myccl: {op}{'' if rank is None else f' (rank {rank})'}: {text}")


def _world_rank():
    return dist.get_rank() if dist.is_initialized() else None


def check_memory_type(op: str, rank, value) -> str:
    """A memory type name, checked as pylibwholegraph checks it (ValueError naming the choices)."""
    if value not in MEMORY_TYPES:
        fail(op, rank, f"WholeMemory type {value!r} not supported, should be (continuous, chunked, distributed, "
             "hierarchy)")
    return value


def check_location(op: str, rank, value) -> str:
    if value not in LOCATIONS:
        fail(op, rank, f"WholeMemory location {value!r} not supported, should be (cuda, cpu)")
    return value


# -- the world as init / init_torch_env set it (what get_local_node_communicator cuts by) --------------

_initialized = False
_world = {"world_rank": 0, "world_size": 1, "local_rank": 0, "local_size": 1}
_global_comms: dict = {}  # distributed backend name -> WholeMemoryCommunicator
_local_node = None
_local_device = None


def _set_world_info(world_rank: int, world_size: int, local_rank: int, local_size: int) -> None:
    _world.update(world_rank=world_rank, world_size=world_size, local_rank=local_rank, local_size=local_size)


def _reset_communicators() -> None:
    global _local_node, _local_device
    _global_comms.clear()
    _local_node = _local_device = None
    _set_world_info(0, 1, 0, 1)


def _check_world_args(op: str, world_rank, world_size, local_rank, local_size, wm_log_level) -> None:
    for name, v in (("world_rank", world_rank), ("world_size", world_size), ("local_rank", local_rank),
                    ("local_size", local_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            fail(op, world_rank if isinstance(world_rank, int) else None, f"{name} must be an int >= 0, got {v!r}",
                 TypeError if not isinstance(v, int) else ValueError)
    if world_size < 1 or local_size < 1 or world_rank >= world_size or local_rank >= local_size:
        fail(op, world_rank, f"world_rank {world_rank} / world_size {world_size}, local_rank {local_rank} / "
             f"local_size {local_size}: each rank must be below its size and each size >= 1")
    if wm_log_level not in _LOG_LEVELS:
        fail(op, world_rank, f"WholeMemory log level {wm_log_level!r} not supported, should be (error, warn, info, "
             "debug, trace)")


def init(world_rank: int, world_size: int, local_rank: int, local_size: int, wm_log_level="info"):
    """Readies the library (the seed layer's init_lib) and records the world: which ranks share a
    node (blocks of local_size consecutive ranks) for get_local_node_communicator. Starts no
    process group."""
    global _initialized
    _check_world_args("init", world_rank, world_size, local_rank, local_size, wm_log_level)
    comm_mod.init_lib()
    log.setLevel(_LOG_LEVELS[wm_log_level])
    _set_world_info(world_rank, world_size, local_rank, local_size)
    _initialized = True


def init_torch_env(world_rank: int, world_size: int, local_rank: int, local_size: int, wm_log_level="info"):
    """As pylibwholegraph: RANK and WORLD_SIZE into the environment, MASTER_ADDR / MASTER_PORT
    defaulted (localhost, 12335) with a warning from rank 0, one intra-op thread, the CUDA device
    local_rank selected where there is CUDA, then torch.distributed's default group with
    init_method="env://" on myccl (CPU tensors over its transports, CUDA tensors over NCCL). A
    default group that already exists is kept when its rank and size are these."""
    op = "init_torch_env"
    _check_world_args(op, world_rank, world_size, local_rank, local_size, wm_log_level)
    os.environ["RANK"] = str(world_rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    for key, default in (("MASTER_ADDR", "localhost"), ("MASTER_PORT", "12335")):
        if key not in os.environ:
            if world_rank == 0:
                print(f"[WARNING] {key} not set, resetting to {default}")
            os.environ[key] = default
    init(world_rank, world_size, local_rank, local_size, wm_log_level)
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (world_rank, world_size):
            fail(op, world_rank, f"torch.distributed's default group exists with rank {dist.get_rank()} of "
                 f"{dist.get_world_size()}, not rank {world_rank} of {world_size}", RuntimeError)
        return
    import c10d_ext  # noqa: F401 (registers myccl)

    dist.init_process_group(backend="myccl", init_method="env://")


def init_torch_env_and_create_wm_comm(world_rank: int, world_size: int, local_rank: int, local_size: int,
                                      distributed_backend_type="nccl", wm_log_level="info"):
    """init_torch_env, then (global communicator, local node communicator)."""
    init_torch_env(world_rank, world_size, local_rank, local_size, wm_log_level)
    global_comm = get_global_communicator(distributed_backend_type)
    local_comm = get_local_node_communicator()
    return global_comm, local_comm


def finalize():
    """Destroys every communicator this process made (the seed layer's finalize_lib: collective,
    in the order they were made), forgets the cached ones and the world, then destroys
    torch.distributed's default group where there is one. Tensors keep their memory while
    referenced."""
    global _initialized
    try:
        comm_mod.finalize_lib()
    finally:
        _reset_communicators()
        _initialized = False
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the communicator --------------------------------------------------------------------------------


class WholeMemoryCommunicator:
    """A WholeMemory communicator: ``wmb_comm`` is a torch ProcessGroup (a communicator from
    create_group_communicator, or any group wrapped by hand), usable wherever the seed layer
    takes a group. Make them with create_group_communicator, get_global_communicator,
    get_local_node_communicator, get_local_device_communicator or split_communicator."""

    def __init__(self, wmb_comm):
        if not isinstance(wmb_comm, dist.ProcessGroup):
            fail("WholeMemoryCommunicator", _world_rank(), "expects a torch ProcessGroup or a communicator from "
                 f"create_communicator, got {type(wmb_comm).__name__}", TypeError)
        super().__init__()
        self.wmb_comm = wmb_comm

    def _group(self, op: str) -> dist.ProcessGroup:
        g = self.wmb_comm
        if g is None or (isinstance(g, comm_mod.Communicator) and g.destroyed):
            fail(op, None if g is None else g.rank(),
                 "this WholeMemoryCommunicator was destroyed (destroy_communicator or finalize)", RuntimeError)
        return g

    def get_rank(self) -> int:
        """This process's rank in the communicator."""
        return self._group("get_rank").rank()

    def get_size(self) -> int:
        """How many ranks the communicator has."""
        return self._group("get_size").size()

    def get_clique_info(self):
        """(is_in_clique, clique_first_rank, clique_rank, clique_rank_num, clique_id, clique_num): a
        clique is a multi-node NVLink domain, which myccl does not form, so never in one."""
        self._group("get_clique_info")
        return False, -1, -1, 0, 0, 0

    def barrier(self) -> None:
        """Collective: returns once every rank has called it (bounded by the group's timeout)."""
        comm_mod.barrier(self._group("barrier"))

    def host_count(self) -> int | None:
        """How many hosts the communicator's ranks are on; None for a group not running myccl."""
        from .. import _myccl_backend

        try:
            return max(_myccl_backend(self._group("host_count")).host_of_rank) + 1
        except ValueError:
            return None

    def support_type_location(self, memory_type: str, memory_location: str) -> bool:
        """Whether a tensor of this memory type and location can be made on this communicator, as
        this rank sees it: continuous and chunked need a myccl group on one host (cuda: and a
        CUDA device with virtual memory, real or the test double); distributed needs nothing on
        cpu and a CUDA device on cuda. hierarchy is not offered."""
        op = "support_type_location"
        rank = self.get_rank()
        mt = check_memory_type(op, rank, memory_type)
        ml = check_location(op, rank, memory_location)
        if mt == "hierarchy":
            return False
        if mt == "distributed":
            return ml == "cpu" or torch.cuda.is_available()
        if self.host_count() != 1:
            return False
        return ml == "cpu" or device_mod.current_device() is not None

    def destroy(self) -> None:
        """destroy_communicator(self)."""
        destroy_communicator(self)

    @property
    def distributed_backend(self) -> str:
        """The backend of distributed memory's exchanges: "nccl" (myccl's: its own transports on
        CPU, NCCL on CUDA). NVSHMEM is not built."""
        self._group("distributed_backend")
        return "nccl"

    @distributed_backend.setter
    def distributed_backend(self, value) -> None:
        _check_backend("distributed_backend", self.get_rank(), value)

    def __repr__(self) -> str:
        if self.wmb_comm is None:
            return "WholeMemoryCommunicator(destroyed)"
        return f"WholeMemoryCommunicator(rank={self.wmb_comm.rank()}, size={self.wmb_comm.size()})"


def _check_backend(op: str, rank, value) -> None:
    if value not in _BACKENDS:
        fail(op, rank, f"WholeMemory distributed backend {value!r} not supported, should be (nccl, nvshmem)")
    if value == "nvshmem":
        fail(op, rank, "the nvshmem distributed backend is not built: myccl moves distributed memory's rows "
             "itself (distributed_backend 'nccl')", NotImplementedError)


# -- making communicators ----------------------------------------------------------------------------


def _require_init(op: str) -> None:
    if not _initialized:
        fail(op, _world_rank(), "WholeMemory is not initialized: call init(...) or init_torch_env(...) first",
             RuntimeError)


def _timeout_of(group):
    """The group's own timeout, for the communicators made from it (None: torch's default)."""
    from .. import _myccl_backend

    try:
        return _myccl_backend(group).timeout
    except Exception:  # noqa: BLE001 (another backend: the default)
        return None


def _gather_problems(op: str, group, problem: str | None, value):
    """One all_gather_object over ``group``: every rank raises if any rank's arguments were bad (the
    bad one with its problem, the others naming it); else every rank's ``value``."""
    me = group.rank()
    got = [None] * group.size()
    dist.all_gather_object(got, (problem, value), group=group)
    bad = next(((r, p) for r, (p, _) in enumerate(got) if p is not None), None)
    if bad is not None:
        fail(op, me, bad[1] if bad[0] == me else f"rank {bad[0]} passed bad arguments: {bad[1]}")
    return [v for _, v in got]


def create_group_communicator(group_size: int = -1, comm_stride: int = 1) -> WholeMemoryCommunicator:
    """Collective over torch.distributed's default group: cuts the world in groups of group_size
    ranks (-1: one group of all), each group's ranks comm_stride apart within blocks of
    group_size * comm_stride consecutive ranks (24 ranks, group_size 4, comm_stride 2: [0, 2, 4, 6],
    [1, 3, 5, 7], [8, 10, 12, 14], ...). Returns this rank's communicator."""
    op = "create_group_communicator"
    _require_init(op)
    if not dist.is_initialized():
        fail(op, None, "needs torch.distributed's default group: call init_torch_env(...) or "
             "dist.init_process_group first", RuntimeError)
    world, me = dist.get_world_size(), dist.get_rank()
    problem, uid = None, None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not (group_size == -1 or group_size >= 1):
        problem = f"group_size must be -1 or an int >= 1, got {group_size!r}"
    elif isinstance(comm_stride, bool) or not isinstance(comm_stride, int) or comm_stride < 1:
        problem = f"comm_stride must be an int >= 1, got {comm_stride!r}"
    else:
        size = world if group_size == -1 else group_size
        if world % (size * comm_stride):
            problem = (f"group_size {size} x comm_stride {comm_stride} = {size * comm_stride} does not divide the "
                       f"world size {world}")
    if problem is None:
        block = size * comm_stride
        inner = me % block
        if inner < comm_stride:  # the first rank of its group: it makes the group's id
            uid = comm_mod.get_unique_id()
    got = _gather_problems(op, dist.group.WORLD, problem, (group_size, comm_stride, uid))
    if any(g[:2] != (group_size, comm_stride) for g in got):
        other = next(r for r, g in enumerate(got) if g[:2] != (group_size, comm_stride))
        fail(op, me, f"ranks disagree: this rank passed group_size {group_size}, comm_stride {comm_stride}; rank "
             f"{other} passed {got[other][0]}, {got[other][1]}")
    root = me // block * block + inner % comm_stride
    comm = comm_mod.create_communicator(size, got[root][2], inner // comm_stride,
                                        timeout=_timeout_of(dist.group.WORLD))
    return WholeMemoryCommunicator(comm)


def split_communicator(comm: WholeMemoryCommunicator, color: int, key: int = 0):
    """Collective over ``comm``: the ranks that pass one color (>= 0) form a new communicator,
    ordered by key, then by rank in ``comm``. Every rank of ``comm`` calls; a rank with a negative
    color takes part and gets None."""
    op = "split_communicator"
    if not isinstance(comm, WholeMemoryCommunicator):
        fail(op, _world_rank(), f"comm must be a WholeMemoryCommunicator, got {type(comm).__name__}", TypeError)
    group = comm._group(op)
    problem, uid = None, None
    if isinstance(color, bool) or isinstance(key, bool) or not isinstance(color, int) or not isinstance(key, int):
        problem = f"color and key must be int, got color {color!r} and key {key!r}"
    elif color >= 0:
        comm_mod.init_lib()  # (a communicator exists: the library is in use)
        uid = comm_mod.get_unique_id()
    try:
        got = _gather_problems(op, group, problem, (color, key, uid))
    except ValueError as e:
        raise (TypeError(str(e)) if problem is not None else e) from None
    if color < 0:
        return None
    members = sorted((k, r) for r, (c, k, _) in enumerate(got) if c == color)
    ranks = [r for _, r in members]
    new = comm_mod.create_communicator(len(ranks), got[ranks[0]][2], ranks.index(group.rank()),
                                       timeout=_timeout_of(group))
    return WholeMemoryCommunicator(new)


def destroy_communicator(wm_comm) -> None:
    """Destroys a WholeMemoryCommunicator (collective over it, as the seed layer's
    destroy_communicator, where it made the group; a group wrapped by hand is only let go) and
    forgets it; None or one destroyed already: nothing. A seed-layer Communicator passed directly
    is destroyed as the seed layer does."""
    global _local_node, _local_device
    if wm_comm is None:
        return
    if not isinstance(wm_comm, WholeMemoryCommunicator):
        comm_mod.destroy_communicator(wm_comm)
        return
    group = wm_comm.wmb_comm
    if group is None:
        return
    wm_comm.wmb_comm = None
    for name, c in list(_global_comms.items()):
        if c is wm_comm or c.wmb_comm is None:
            del _global_comms[name]
    if _local_node is wm_comm:
        _local_node = None
    if _local_device is wm_comm:
        _local_device = None
    if isinstance(group, comm_mod.Communicator) and not group.destroyed:
        comm_mod.destroy_communicator(group)


def get_global_communicator(distributed_backend="nccl") -> WholeMemoryCommunicator:
    """The communicator of every rank of the default group (made on first use, collectively)."""
    global _local_node, _local_device
    _check_backend("get_global_communicator", _world_rank(), distributed_backend)
    if distributed_backend not in _global_comms:
        comm = create_group_communicator()
        _global_comms[distributed_backend] = comm
        if _local_node is None and _world["local_size"] == _world["world_size"]:
            _local_node = comm
        if _local_device is None and _world["world_size"] == 1:
            _local_device = comm
    return _global_comms[distributed_backend]


def get_local_node_communicator() -> WholeMemoryCommunicator:
    """The communicator of this rank's node: its block of local_size consecutive ranks (made on
    first use, collectively over the default group)."""
    global _local_node, _local_device
    if _local_node is None:
        _local_node = create_group_communicator(_world["local_size"])
        if _world["local_size"] == _world["world_size"]:
            _global_comms.setdefault("nccl", _local_node)
        if _world["local_size"] == 1 and _local_device is None:
            _local_device = _local_node
    return _local_node


def get_local_device_communicator() -> WholeMemoryCommunicator:
    """A communicator of this rank alone (made on first use, collectively over the default group)."""
    global _local_node, _local_device
    if _local_device is None:
        _local_device = create_group_communicator(1)
        if _world["local_size"] == 1 and _local_node is None:
            _local_node = _local_device
        if _world["world_size"] == 1:
            _global_comms.setdefault("nccl", _local_device)
    return _local_device


def get_local_mnnvl_communicator():
    """The communicator of this rank's multi-node NVLink domain: there is none here (RuntimeError,
    after making the global communicator, as pylibwholegraph does)."""
    g = get_global_communicator()
    if not g.get_clique_info()[0]:
        fail("get_local_mnnvl_communicator", g.get_rank(), "the gpu does not belong to any mnnvl domain, can not "
             "create local_mnnvl_communicator", RuntimeError)
