"""WholeMemory communicators without torch.distributed's default group: the seed API's start-up
(init_lib, get_unique_id on one rank, the id passed on by the script, create_communicator on
every rank). A communicator is a myccl process group made directly on a store, so every function
of this package that takes a group takes it, and so does every torch.distributed collective.

The unique id names a TCPStore that the process which made it serves (one per process, until its
finalize_lib) and a random token under which one communicator meets: a list of 16 int64, the
layout below, defined here only.
"""

from __future__ import annotations

import hashlib
import operator
import os
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from .. import _C

__all__ = ["Communicator", "init_lib", "finalize_lib", "get_unique_id", "create_communicator",
           "destroy_communicator", "get_rank", "get_size", "barrier", "broadcast_unique_id_array",
           "broadcast_unique_id_array_by_continuous_group", "create_global_communicator",
           "create_intra_node_communicator"]

# The id: 128 bytes, handed out as 16 int64 (what the seed API's ids are). magic and version,
# the token, a hash of the maker's host identity, the store's port, how many addresses follow,
# the maker's pid (for messages), then the addresses, each a family byte (4 or 6) and its bytes.
_MAGIC = b"MYCCLWM\x01"
_HEAD = struct.Struct("<8s16s8sHBxI")
_ID_BYTES = 128
_ID_WORDS = _ID_BYTES // 8
_ADDR_BYTES = _ID_BYTES - _HEAD.size

_lock = threading.Lock()
_initialized = False
_server = None  # this process's TCPStore serving the ids it made
_live: list = []  # the communicators made here and not yet destroyed, in creation order


def _fail(op: str, rank, text: str, exc=ValueError):
    """The project's error form: the op, the rank (where there is one) and what is wrong."""
    raise exc(f"myccl: {op}{'' if rank is None else f' (rank {rank})'}: {text}")


class Communicator(dist.ProcessGroup):
    """A WholeMemory communicator: a torch ProcessGroup running myccl, made by create_communicator
    without a default group. ``rank()`` and ``size()`` are its own."""

    def __init__(self, store, rank: int, size: int, backend, name: str):
        super().__init__(store, rank, size)
        kind = dist.ProcessGroup.BackendType.CUSTOM
        self._set_default_backend(kind)
        for device in ("cpu", "cuda"):  # one myccl backend serves both, as for init_process_group
            self._register_backend(torch.device(device), kind, backend)
        self._set_group_name(name)
        self._set_group_desc("wholememory communicator")
        self.destroyed = False  # (by destroy_communicator or finalize_lib)

    def __repr__(self) -> str:
        state = ", destroyed" if self.destroyed else ""
        return f"Communicator({self.group_name}, rank={self.rank()}, size={self.size()}{state})"


def _host_hash() -> bytes:
    from ..config import parse_env

    return hashlib.sha256(_C.host_identity(parse_env()["host_id"]).encode()).digest()[:8]


def _ifname_matches(spec: str, name: str) -> bool:
    """MYCCL_SOCKET_IFNAME's rule (NCCL's): prefixes, '=' exact names, '^' excludes."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    hit = any((name == item) if exact else name.startswith(item) for item in spec.split(",") if item)
    return hit != exclude


def _interface_addresses() -> list[tuple[str, bytes, bool]]:
    """(interface, packed address, loopback) of every interface that is up: IPv4 first."""
    import fcntl

    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s, 0x8913, req), 16)[0]  # SIOCGIFFLAGS
                if flags & 0x1:  # IFF_UP
                    addr = fcntl.ioctl(s, 0x8915, req)[20:24]  # SIOCGIFADDR
                    out.append((name, addr, bool(flags & 0x8)))  # IFF_LOOPBACK
            except OSError:
                continue
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, _, scope, _, name = line.split()
                if int(scope, 16) in (0x00, 0x10):  # global or host; a link-local one needs a scope id
                    out.append((name, bytes.fromhex(hexaddr), int(scope, 16) == 0x10))
    except OSError:
        pass
    return out


def _route_to(host: str) -> bytes | None:
    """The local address that routes to ``host`` (no packet is sent)."""
    try:
        for fam, _, _, _, addr in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                return socket.inet_pton(fam, s.getsockname()[0])
    except OSError:
        return None
    return None


def _advertised() -> list[bytes]:
    """Where other hosts reach this process's store, best first: MYCCL_SOCKET_IFNAME's interfaces
    when it is set, else the route to MASTER_ADDR (when set) and then every interface; loopback
    only when there is nothing else (ranks on this host connect over loopback anyway)."""
    from ..config import parse_env

    spec = parse_env()["socket_ifname"]
    found = _interface_addresses()
    if spec:
        addrs = [a for name, a, _ in found if _ifname_matches(spec, name)]
    else:
        addrs = [a for _, a, lo in found if not lo]
        master = os.environ.get("MASTER_ADDR", "")
        first = _route_to(master) if master else None
        if first is not None and not socket.inet_ntop(socket.AF_INET if len(first) == 4 else socket.AF_INET6,
                                                      first).startswith(("127.", "::1")):
            addrs = [first] + [a for a in addrs if a != first]
    return addrs or [socket.inet_aton("127.0.0.1")]


def _encode(token: bytes, port: int) -> list[int]:
    body = b""
    count = 0
    for a in _advertised():
        entry = bytes([4 if len(a) == 4 else 6]) + a
        if len(body) + len(entry) > _ADDR_BYTES:
            break
        body += entry
        count += 1
    raw = _HEAD.pack(_MAGIC, token, _host_hash(), port, count, os.getpid()) + body
    return list(struct.unpack(f"<{_ID_WORDS}q", raw.ljust(_ID_BYTES, b"\0")))


def _id_bytes(op: str, rank, unique_id) -> bytes:
    """The id's 128 bytes from any of its forms: the list of 16 ints, an int64 tensor of 16 (or a
    uint8 tensor of 128), or 128 bytes."""
    want = "the unique id from get_unique_id(): a list of 16 ints (or them as a tensor, or 128 bytes)"
    if isinstance(unique_id, torch.Tensor):
        if unique_id.dtype == torch.int64 and unique_id.numel() == _ID_WORDS:
            unique_id = unique_id.detach().cpu().view(-1).tolist()
        elif unique_id.dtype == torch.uint8 and unique_id.numel() == _ID_BYTES:
            unique_id = bytes(unique_id.detach().cpu().view(-1).tolist())
        else:
            _fail(op, rank, f"unique_id must be {want}; got a {unique_id.dtype} tensor of {unique_id.numel()} "
                  "elements", TypeError)
    if isinstance(unique_id, (bytes, bytearray, memoryview)):
        raw = bytes(unique_id)
        if len(raw) != _ID_BYTES:
            _fail(op, rank, f"unique_id must be {want}; got {len(raw)} bytes")
        return raw
    if not isinstance(unique_id, (list, tuple)):
        _fail(op, rank, f"unique_id must be {want}; got {type(unique_id).__name__}", TypeError)
    if len(unique_id) != _ID_WORDS:
        _fail(op, rank, f"unique_id must be {want}; got a {type(unique_id).__name__} of {len(unique_id)}")
    try:
        return struct.pack(f"<{_ID_WORDS}q", *(operator.index(w) for w in unique_id))
    except (TypeError, struct.error) as e:
        _fail(op, rank, f"unique_id must be {want}; its words are not all int64 ({e})", TypeError)


def _decode(op: str, rank, unique_id):
    raw = _id_bytes(op, rank, unique_id)
    magic, token, host, port, count, pid = _HEAD.unpack_from(raw)
    if magic != _MAGIC:
        _fail(op, rank, f"unique_id is not one from get_unique_id() (it starts {raw[:8]!r})")
    addrs, at = [], _HEAD.size
    for _ in range(count):
        fam = raw[at] if at < _ID_BYTES else 0
        n = {4: 4, 6: 16}.get(fam, 0)
        if not n or at + 1 + n > _ID_BYTES:
            _fail(op, rank, f"unique_id is damaged: address {len(addrs)} of {count} is not readable")
        addrs.append(socket.inet_ntop(socket.AF_INET if fam == 4 else socket.AF_INET6, raw[at + 1:at + 1 + n]))
        at += 1 + n
    return token, host, port, pid, addrs


def _check_init(op: str, rank) -> None:
    if not _initialized:
        _fail(op, rank, "the library is not initialized: call init_lib() first (again after finalize_lib())",
              RuntimeError)


def init_lib() -> None:
    """Makes the library ready for get_unique_id and create_communicator; again after finalize_lib.
    Calling it while initialized does nothing. Whole-memory tensors on torch.distributed groups
    need no init_lib."""
    global _initialized
    with _lock:
        _initialized = True


def finalize_lib() -> None:
    """Destroys every communicator made by this process and not yet destroyed (each collectively,
    in creation order, as destroy_communicator), then stops serving the ids this process made.
    Then init_lib starts over. Does nothing when not initialized. Tensors keep their memory while
    referenced; collective accesses through a destroyed communicator fail."""
    global _initialized, _server
    errors = []
    for comm in list(_live):
        try:
            destroy_communicator(comm)
        except Exception as e:  # noqa: BLE001 (destroy them all, then report the first failure)
            errors.append(e)
    with _lock:
        _server = None  # the last reference: the listening socket closes
        _initialized = False
    if errors:
        raise errors[0]


def get_unique_id() -> list[int]:
    """A new id for one communicator, on any process (usually rank 0 of the future communicator):
    16 ints that the script passes to every rank its own way (a file, a broadcast, a store). This
    process serves the ranks' meeting for it: it must run until they have destroyed the
    communicator (its finalize_lib stops the serving)."""
    global _server
    _check_init("get_unique_id", None)
    token = secrets.token_bytes(16)
    with _lock:
        if _server is None:
            _server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        _server.set(f"myccl-wm/{token.hex()}/made", str(os.getpid()))
        port = _server.port
    return _encode(token, port)


def _default_timeout(timeout) -> timedelta:
    if timeout is None:
        return default_pg_timeout
    if isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


def _connect(op: str, rank, token: bytes, host: bytes, port: int, pid: int, addrs: list[str], deadline: float):
    """The maker's store (its waits bounded by the deadline) and the id's prefix of it: over
    loopback from the maker's host, else at the first of the maker's addresses that accepts."""
    same_host = host == _host_hash()
    candidates = ["127.0.0.1"] if same_host else addrs
    where = ", ".join(f"{a}:{port}" for a in candidates)
    chosen, why = None, "no address"
    if len(candidates) == 1:
        chosen = candidates[0]
    else:
        for a in candidates:
            try:
                socket.create_connection((a, port), timeout=max(0.1, min(3.0, deadline - time.monotonic()))).close()
                chosen = a
                break
            except OSError as e:
                why = str(e)
    if chosen is not None:
        try:
            store = dist.TCPStore(chosen, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except Exception as e:  # noqa: BLE001 (torch raises several kinds)
            chosen, why = None, str(e).splitlines()[0]
    if chosen is None:
        _fail(op, rank, f"cannot reach the process that made the unique id (pid {pid}) at {where}: {why}. "
              "It must run, and not have called finalize_lib, until the communicator is made", RuntimeError)
    prefix = dist.PrefixStore(f"myccl-wm/{token.hex()}", store)  # keys "<prefix>/<key>"
    if not prefix.check(["made"]):
        _fail(op, rank, f"the store at {chosen}:{port} does not know this unique id (the process that made it "
              "ended or called finalize_lib, and another took its port)", RuntimeError)
    return store, prefix


def _index_arg(op: str, rank, name: str, value) -> int:
    if isinstance(value, bool):
        _fail(op, rank, f"{name} must be an int, got {value!r}", TypeError)
    try:
        return operator.index(value)
    except TypeError:
        _fail(op, rank, f"{name} must be an int, got {type(value).__name__} {value!r}", TypeError)


def _await(op: str, rank, store, keys: list[str], names: list[int], deadline: float, pid: int) -> None:
    """Until every key exists; a rank's posted error ends the wait on every rank."""
    pause = 0.002
    while True:
        try:
            error = store.get("error").decode() if store.check(["error"]) else None
            done = store.check(keys)
        except Exception as e:  # noqa: BLE001 (torch raises several kinds)
            _fail(op, rank, f"lost the connection to the process that made the unique id (pid {pid}) while "
                  f"waiting for the other ranks: {str(e).splitlines()[0]}", RuntimeError)
        if error is not None:
            _fail(op, rank, f"no communicator was made: {error}", RuntimeError)
        if done:
            return
        if time.monotonic() > deadline:
            missing = [n for k, n in zip(keys, names) if not store.check([k])]
            _fail(op, rank, f"Timed out waiting for rank(s) {missing} to join", RuntimeError)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def create_communicator(size: int, unique_id, rank: int, *, timeout=None, options=None) -> Communicator:
    """Collective over the ``size`` processes that pass the same ``unique_id``, each its own
    ``rank`` in [0, size). Returns the communicator. ``timeout`` (a timedelta or seconds; default
    torch's default process-group timeout) bounds the meeting and is the communicator's op
    timeout; ``options`` is a c10d_ext.Options for its myccl backend. Bad arguments raise on the
    rank that passed them and, where the id could be read, end the meeting on every rank."""
    op = "create_communicator"
    shown = rank if type(rank) is int else repr(rank)
    _check_init(op, shown)
    token, host, port, pid, addrs = _decode(op, shown, unique_id)
    timeout = _default_timeout(timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    problem = None
    try:
        size = _index_arg(op, shown, "size", size)
        rank = _index_arg(op, shown, "rank", rank)
        if size < 1:
            _fail(op, rank, f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            _fail(op, rank, f"rank {rank} is out of range for size {size} (ranks are 0 to {size - 1})")
    except (TypeError, ValueError) as e:
        problem = e
    tcp, store = _connect(op, shown if problem else rank, token, host, port, pid, addrs, deadline)
    if problem is not None:
        store.compare_set("error", "", f"a process passed bad arguments: {problem}")
        raise problem
    if store.add(f"joined/{rank}", 1) > 1:
        text = (f"rank {rank} joined this unique id twice (two processes passed rank {rank}, or the id was used "
                "before: an id makes one communicator; get a new one from get_unique_id())")
        store.compare_set("error", "", text)
        _fail(op, rank, text)
    agreed = store.compare_set("size", "", str(size)).decode()
    if agreed != str(size):
        text = f"rank {rank} passed size {size}, a rank that joined before it passed size {agreed}"
        store.compare_set("error", "", text)
        _fail(op, rank, text)
    store.set(f"ready/{rank}", "1")
    _await(op, rank, store, [f"ready/{r}" for r in range(size)], list(range(size)), deadline, pid)
    tcp.set_timeout(timeout)  # the communicator's own waits on the store (shared memory, NCCL ids)
    return _make(store, rank, size, f"wholememory-{token.hex()[:12]}", timeout, options)


def _make(store, rank: int, size: int, name: str, timeout: timedelta, options) -> Communicator:
    from ..backend import create_backend

    pg_store = dist.PrefixStore("pg", store)
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store = dist.PrefixStore("cpu", pg_store)
    opts.group_rank, opts.group_size, opts.timeout = rank, size, timeout
    opts.group_id, opts.global_ranks_in_group = name, list(range(size))
    comm = Communicator(pg_store, rank, size, create_backend(opts, options), name)
    with _lock:
        _live.append(comm)
    return comm


def check_communicator(op: str, comm) -> dist.ProcessGroup:
    """``comm`` as a group: a communicator not yet destroyed, or any torch ProcessGroup."""
    if isinstance(comm, Communicator) and comm.destroyed:
        _fail(op, comm.rank(), f"communicator {comm.group_name} was destroyed (by destroy_communicator or finalize_lib)")
    if not isinstance(comm, dist.ProcessGroup):
        rank = dist.get_rank() if dist.is_initialized() else None
        _fail(op, rank, f"expected a communicator (from create_communicator) or a process group, got "
              f"{type(comm).__name__} {comm!r}", TypeError)
    return comm


def resolve_group(op: str, group) -> dist.ProcessGroup:
    """What every function taking a group does with it: None is the default group."""
    if group is None:
        if not dist.is_initialized():
            _fail(op, None, "no process group: pass a communicator (init_lib, get_unique_id, create_communicator) "
                  "or call dist.init_process_group('myccl') first", RuntimeError)
        return dist.group.WORLD
    return check_communicator(op, group)


def backend_name(group) -> str:
    """The backend's name ("myccl" for a communicator, which torch's registry does not hold)."""
    if isinstance(group, Communicator):
        return "myccl"
    return dist.get_backend(group)


def destroy_communicator(comm) -> None:
    """Collective over the communicator: a barrier (bounded by its timeout), then its backend shuts
    down on every rank. Raises when the communicator was destroyed already, or (after shutting
    down) when the barrier failed."""
    op = "destroy_communicator"
    check_communicator(op, comm)
    if not isinstance(comm, Communicator):
        _fail(op, comm.rank(), "only communicators from create_communicator are destroyed here; a torch group "
              "goes with dist.destroy_process_group", TypeError)
    try:
        comm.barrier().wait()
    finally:
        comm.shutdown()
        comm.destroyed = True
        with _lock:
            if comm in _live:
                _live.remove(comm)


def get_rank(comm) -> int:
    """This process's rank in the communicator."""
    return check_communicator("get_rank", comm).rank()


def get_size(comm) -> int:
    """How many ranks the communicator has."""
    return check_communicator("get_size", comm).size()


def barrier(comm) -> None:
    """Collective: returns once every rank of the communicator has called it (or raises on its
    timeout)."""
    check_communicator("barrier", comm).barrier().wait()


def _default_group(op: str):
    if not dist.is_initialized():
        _fail(op, None, "passes the unique id over torch.distributed's default group: call "
              "dist.init_process_group first, or pass the id yourself (get_unique_id on one rank, "
              "create_communicator on all)", RuntimeError)


def broadcast_unique_id_array(unique_id_array, root_rank: int) -> list[int]:
    """Collective over the default group: root_rank's id to every rank."""
    _default_group("broadcast_unique_id_array")
    box = [list(unique_id_array) if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def broadcast_unique_id_array_by_continuous_group(unique_id_array, group_root_rank: int, group_size: int):
    """Collective over the default group, cut in blocks of group_size consecutive ranks: each
    block's rank group_root_rank (within the block) passes its id to the rest of its block."""
    op = "broadcast_unique_id_array_by_continuous_group"
    _default_group(op)
    world, me = dist.get_world_size(), dist.get_rank()
    problem = None
    if not (isinstance(group_size, int) and group_size >= 1 and world % group_size == 0):
        problem = f"group_size {group_size!r} must be >= 1 and divide the world size {world}"
    elif not (isinstance(group_root_rank, int) and 0 <= group_root_rank < group_size):
        problem = f"group_root_rank {group_root_rank!r} is out of range for group_size {group_size}"
    root = me // group_size * group_size + group_root_rank if problem is None else -1
    mine = list(unique_id_array) if me == root and unique_id_array is not None else None
    got = _agree(op, problem, mine)
    if got[root] is None:
        _fail(op, me, f"block root rank {root} passed no unique id", RuntimeError)
    return got[root]


def create_global_communicator(world_rank: int, world_size: int, *, timeout=None, options=None) -> Communicator:
    """Collective over the default group: one communicator over all its ranks (rank 0 makes the id
    and broadcasts it over the default group)."""
    op = "create_global_communicator"
    _check_args(op, world_rank, world_size, world_size)
    uid = get_unique_id() if world_rank == 0 else None
    uid = broadcast_unique_id_array(uid, 0)
    return create_communicator(world_size, uid, world_rank, timeout=timeout, options=options)


def create_intra_node_communicator(world_rank: int, world_size: int, local_size: int, *, timeout=None,
                                   options=None) -> Communicator:
    """Collective over the default group: one communicator per block of local_size consecutive
    ranks (the ranks of one node when ranks are numbered node by node), each rank's rank in it
    world_rank % local_size."""
    op = "create_intra_node_communicator"
    _check_args(op, world_rank, world_size, local_size)
    uid = get_unique_id() if world_rank % local_size == 0 else None
    uid = broadcast_unique_id_array_by_continuous_group(uid, 0, local_size)
    return create_communicator(local_size, uid, world_rank % local_size, timeout=timeout, options=options)


def _check_args(op: str, world_rank, world_size, local_size) -> None:
    """The arguments against the default group, agreed on by every rank (so none waits in a
    broadcast the others skip)."""
    _default_group(op)
    me, world = dist.get_rank(), dist.get_world_size()
    problem = None
    if not _initialized:
        problem = "the library is not initialized: call init_lib() first (again after finalize_lib())"
    elif world_rank != me:
        problem = f"world_rank {world_rank!r} is not this process's rank in the default group ({me})"
    elif world_size != world:
        problem = f"world_size {world_size!r} is not the default group's size ({world})"
    elif not (isinstance(local_size, int) and local_size >= 1 and world % local_size == 0):
        problem = f"local_size {local_size!r} must be >= 1 and divide the world size {world}"
    _agree(op, problem)


def _agree(op: str, problem: str | None, value=None) -> list:
    """One all_gather over the default group: every rank raises if any rank's arguments were bad
    (the bad one with its problem, the others naming it), else every rank's ``value``."""
    me = dist.get_rank()
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (problem, value))
    bad = next(((r, p) for r, (p, _) in enumerate(got) if p is not None), None)
    if bad is not None:
        _fail(op, me, bad[1] if bad[0] == me else f"rank {bad[0]} passed bad arguments: {bad[1]}")
    return [v for _, v in got]
