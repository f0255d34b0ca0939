"""Multi-process test harness: a World is N real processes (spawned once, reused by many
tests) that run a test function on every rank and send back each rank's result.

Every call has a timeout: a hang kills the world and fails the test within seconds, and the
next test gets a fresh world. A test function runs as fn(ctx, *args) where ctx carries the
rank, the world size and helpers to create process groups on a store private to that call.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

TESTS = os.path.dirname(os.path.abspath(__file__))  # the harness and every shared helper module
ROOT = os.path.dirname(TESTS)


def layer_dirs() -> list[str]:
    """The folders of tests/ that hold test files (one per layer: backend, cuda, ddp, ...). A test
    function runs on a worker by its module's name, so every layer is on the worker's path (test
    file names are unique across the layers)."""
    return sorted(e.path for e in os.scandir(TESTS)
                  if e.is_dir() and any(f.startswith("test_") and f.endswith(".py") for f in os.listdir(e.path)))


class RankError(AssertionError):
    pass


class Logged(logging.Handler):
    """`with Logged("c10d_ext.horovod") as messages:` keeps what that logger says meanwhile."""

    def __init__(self, logger: str):
        super().__init__()
        self.logger = logger
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger(self.logger).addHandler(self)
        return self.messages

    def __exit__(self, *exc):
        logging.getLogger(self.logger).removeHandler(self)


def free_port() -> int:
    """A local TCP port nobody listens on now (tests' and benchmarks' stores and masters)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks sharing one GPU: NCCL refuses two ranks of one communicator on one device of one host, so
# each rank poses as a host of its own ("{rank}" becomes the rank, see World) and talks over
# loopback sockets, without the intra-host transports that assume distinct devices. The CUDA
# tests' shared-GPU worlds and the benchmarks' ranks that outnumber their GPUs both use it.
SHARED_GPU = {
    "NCCL_HOSTID": "host{rank}",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_DEBUG": "WARN",
}


class Ctx:
    """What a test function sees on each rank."""

    def __init__(self, rank: int, size: int, store_port: int, call_id: int):
        self.rank = rank
        self.size = size
        self.store_port = store_port
        self.call_id = call_id
        self._store = None

    def store(self, suffix: str = ""):
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(
                "127.0.0.1", self.store_port, is_master=False, timeout=timedelta(seconds=60)
            )
        return dist.PrefixStore(f"call{self.call_id}/{suffix}", self._store)

    def init(self, backend: str = "myccl", timeout: float = 60.0, **kwargs):
        """init_process_group on a store private to this call."""
        import torch.distributed as dist

        import c10d_ext  # noqa: F401

        dist.init_process_group(
            backend,
            store=self.store("default"),
            rank=self.rank,
            world_size=self.size,
            timeout=timedelta(seconds=timeout),
            **kwargs,
        )
        return dist.group.WORLD

    def init_env(self, master_port: int, backend: str = "myccl", timeout: float = 60.0, **kwargs):
        """init_process_group(init_method="env://") the way torchrun sets it up: MASTER_ADDR,
        MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK in the environment (restored afterwards).
        The parent picks master_port with free_port() and passes it as an argument."""
        import torch.distributed as dist

        import c10d_ext  # noqa: F401

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "RANK": str(self.rank),
               "WORLD_SIZE": str(self.size), "LOCAL_RANK": str(self.rank)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout), **kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return dist.group.WORLD


def one_thread(body):
    """Tiny models on few cores: intra-op threads only contend with the peer processes. The
    worlds are shared with other test files, so the setting is put back afterwards."""
    import functools

    @functools.wraps(body)
    def wrapper(ctx, *args):
        import torch

        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return body(ctx, *args)
        finally:
            torch.set_num_threads(old)

    return wrapper


class Report:
    """Collects a rank's checks; the parent asserts that no rank reported a failure."""

    def __init__(self, ctx):
        self.rank = ctx.rank
        self.checks = 0
        self.failures: list[str] = []

    def check(self, ok: bool, what: str) -> bool:
        self.checks += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")
        return bool(ok)

    def fail(self, what: str) -> None:
        self.check(False, what)

    def expect_value_error(self, fn, what: str) -> None:
        """fn() must raise a ValueError that names myccl (or torch's "does not support")."""
        self.checks += 1
        try:
            fn()
        except ValueError as e:
            if "myccl" not in str(e) and "does not support" not in str(e):
                self.failures.append(f"rank {self.rank}: {what}: error does not name myccl: {e}")
            return
        except Exception as e:  # noqa: BLE001
            self.failures.append(f"rank {self.rank}: {what}: expected ValueError, got {type(e).__name__}: {e}")
            return
        self.failures.append(f"rank {self.rank}: {what}: expected ValueError, nothing raised")

    def result(self):
        return self.checks, self.failures


def open_sockets() -> int:
    """How many sockets this process has open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def seq_number(pg=None) -> int:
    """The group's collective sequence number, as torch reports it. Before 2.14 torch's
    ProcessGroup answers only for gloo and nccl ("does not yet support sequence numbers"), so
    there ask the backend, which is what torch 2.14 and later do themselves."""
    import torch
    import torch.distributed as dist

    pg = pg if pg is not None else dist.group.WORLD
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14):
        return pg._get_sequence_number_for_group()
    return pg._get_backend(torch.device("cpu"))._get_sequence_number_for_group()


def work_exception(work):
    """Work.exception(). torch 2.11 and 2.12 cannot convert its return value in their binding
    (gloo's Work fails alike: "Unable to convert function return value"), so there the answer
    comes from the work's future, which holds the same error."""
    try:
        return work.exception()
    except TypeError as e:
        if "Unable to convert function return value" not in str(e):
            raise
    fut = work.get_future()
    if not fut.done():
        return None
    try:
        fut.value()
        return None
    except Exception as err:  # noqa: BLE001
        return err


def assert_reports(results) -> None:
    """results: per-rank (checks, failures) from Report.result()."""
    failures = [f for _, fails in results for f in fails]
    checks = sum(c for c, _ in results)
    assert checks > 0, "no checks ran"
    assert not failures, f"{len(failures)} of {checks} checks failed:\n" + "\n".join(failures[:60])


def _worker(rank: int, size: int, store_port: int, conn, env: dict) -> None:
    # "{rank}" in a world env value becomes this process's rank (e.g. NCCL_HOSTID=host{rank}),
    # set before torch or NCCL read anything.
    os.environ.update({k: str(v).replace("{rank}", str(rank)) for k, v in env.items()})
    sys.path[:0] = [TESTS, *layer_dirs(), ROOT]
    import torch  # noqa: F401 (import once, up front)
    import torch.distributed as dist

    import c10d_ext  # noqa: F401

    if os.environ.get("MYCCL_TEST_CUDA_DOUBLE") == "1":
        import cuda_double  # the CUDA engine on the strict host double, CPU tensors standing for CUDA

        cuda_double.install()
    conn.send(("ready", None, None))  # the parent starts the first call once every rank is here
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        call_id, module, name, args, call_env = msg
        saved = {k: os.environ.get(k) for k in call_env}
        os.environ.update(call_env)
        try:
            fn = getattr(importlib.import_module(module), name)
            result = fn(Ctx(rank, size, store_port, call_id), *args)
            reply = ("ok", result)
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            reply = ("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass
        # torch names groups by a per-process counter: a call in which some ranks created (or
        # tried to create) more groups than others leaves the ranks' counters apart, and every
        # later group of this world would wait for names its peers never use. The parent
        # compares the counters and replaces such a world.
        groups = dist.distributed_c10d._world.group_count
        try:
            conn.send(reply + (groups,))
        except Exception as e:  # unpicklable result
            conn.send(("err", f"result not picklable: {e}", groups))


class World:
    """`env` is set in every rank's process at start; "{rank}" in a value is replaced by the
    rank, for settings that must differ per process before any library reads them."""

    def __init__(self, size: int, env: dict | None = None):
        import torch.distributed as dist

        self.size = size
        self.env = dict(env or {})
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.store_port = self._store.port
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker, args=(r, size, self.store_port, child, self.env), daemon=True
            )
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.calls = 0
        self.broken = False
        self.ready = False

    def _await_ready(self, timeout: float) -> None:
        """Before a new world's first call, every rank has imported torch and c10d_ext: a rank
        that takes seconds longer to start (a loaded machine) must not eat a test's short group
        timeout in init."""
        if self.ready:
            return
        deadline = time.monotonic() + max(timeout, 120)
        for r, c in enumerate(self.conns):
            while not c.poll(0.05):
                if not self.procs[r].is_alive() or time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"world of {self.size}: rank {r} did not start")
            status, _, _ = c.recv()
            assert status == "ready", status
        self.ready = True

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable, *args: Any, timeout: float = 90.0, env: dict | None = None,
            expect_dead: tuple[int, ...] = ()) -> list[Any]:
        """Runs fn(ctx, *args) on every rank; returns the per-rank results.

        Raises RankError with every failing rank's traceback, or TimeoutError (and kills the
        world) if some rank does not answer within `timeout` seconds. Ranks in `expect_dead`
        may die (fault-injection tests); their result is None.
        """
        self._await_ready(timeout)
        self.calls += 1
        msg = (self.calls, fn.__module__, fn.__name__, args, dict(env or {}))
        for c in self.conns:
            c.send(msg)
        results: list[Any] = [None] * self.size
        groups: dict[int, int] = {}
        pending = set(range(self.size))
        errors = []
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"{fn.__name__}: ranks {sorted(pending)} did not finish within {timeout} s "
                    f"(finished: {sorted(set(range(self.size)) - pending)}); errors so far: {errors}"
                )
            for r in sorted(pending):
                c = self.conns[r]
                if c.poll(0.01):
                    try:
                        status, value, groups[r] = c.recv()
                    except EOFError:
                        status, value = "dead", None
                    pending.discard(r)
                    if status == "ok":
                        results[r] = value
                    elif status == "dead":
                        if r not in expect_dead:
                            errors.append(f"rank {r}: process died (exit code {self.procs[r].exitcode})")
                        self.broken = True
                    else:
                        errors.append(f"rank {r}: {value}")
                elif not self.procs[r].is_alive():
                    pending.discard(r)
                    self.broken = True
                    if r not in expect_dead:
                        errors.append(f"rank {r}: process died (exit code {self.procs[r].exitcode})")
        if len(set(groups.values())) > 1:
            self.broken = True  # group counters apart: the next test gets a fresh world
        if errors:
            raise RankError("\n".join(errors))
        return results

    def kill(self) -> None:
        self.broken = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()


class WorldPool:
    """Keeps one live World per size and environment; replaces worlds that broke. At most
    MAX_PROCS pooled processes (each ~0.5 GB once torch is loaded): the least recently used worlds
    go first, else the two xdist workers' pools, with every size and environment the suite uses,
    outgrow the machine's memory and the kernel's OOM killer picks a test's processes."""

    MAX_PROCS = 12

    def __init__(self):
        self.worlds: dict[tuple, World] = {}  # least recently used first

    def get(self, size: int, env: dict | None = None) -> World:
        key = (size, tuple(sorted((env or {}).items())))
        w = self.worlds.pop(key, None)
        if w is None or not w.alive():
            if w is not None:
                w.kill()
            while self.worlds and sum(x.size for x in self.worlds.values()) + size > self.MAX_PROCS:
                self.worlds.pop(next(iter(self.worlds))).kill()  # idle between calls: nothing to lose
            w = World(size, env)
        self.worlds[key] = w
        return w

    def close(self) -> None:
        # Ask every world to exit first, then wait: process exit (~3 s of torch teardown each)
        # overlaps instead of adding up.
        for w in self.worlds.values():
            for c in w.conns:
                try:
                    c.send(None)
                except Exception:  # noqa: BLE001
                    pass
        for w in self.worlds.values():
            w.close()
        self.worlds.clear()


def join_or_kill(procs, deadline_s: float) -> list[int]:
    """Waits for spawned processes until `deadline_s` from now; kills the ones still running and
    returns their indices (the caller asserts there are none)."""
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return hung
