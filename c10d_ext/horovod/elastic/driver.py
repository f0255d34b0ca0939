"""horovodrun's elastic mode for c10d_ext.horovod: the launcher as Horovod's elastic driver.

    python -m c10d_ext.horovod.run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py

The launcher hosts the job's store (a TCPStore server) and starts every worker itself with
torchrun's variables pointing at that store (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) and HOROVOD_ELASTIC=1, so a worker's
``hvd.init()`` makes its default group on that store as under torchrun. Each second it runs the
discovery script (``<host>[:<slots>]`` lines, ``--slots-per-host`` for lines without slots) or
keeps the fixed ``-H`` / ``-hostfile`` list (at least two hosts, as Horovod requires), and then:

* a slot that appeared (a new host, more slots, a blacklisted host's cooldown over) gets a new
  worker while the job runs fewer than ``--max-np``: it starts with ``HOROVOD_ELASTIC_JOIN=1``,
  registers in the job's store, and the workers admit it at their next ``state.commit()``
  (``join.py``), the point where Horovod's driver notification takes effect;
* a worker that fails (non-zero status) blacklists its host, for good or for Horovod's cooldown
  (``--blacklist-cooldown-range``); the other workers lose a peer, restore their last commit and
  go on without it (the survivors' path of ``hvd.elastic.run``);
* a host gone from the discovery (or a slot: a host printed with fewer slots) has its workers
  stop at the job's next ``state.commit()``, as Horovod's driver has them: the launcher writes a
  leave request per worker in the job's store, the commit raises ``HostsUpdatedInterrupt`` on
  every rank (hosts removed: no sync), and in the reset those workers exit with status 0 while
  the others make the smaller world (join.py) and go on from the state they committed. A worker
  that never reaches another commit runs on until the job ends. Removing every worker's host stops
  the job with Horovod's message;
* fewer than ``--min-np`` workers left and no slot for another within ``--elastic-timeout``, more
  changes of the world than ``--reset-limit``, or every host that runs a worker blacklisted: the
  job is stopped with Horovod's message.

The job ends when its workers have. It succeeded when one worker exited with status 0 and every
worker still running then did too (Horovod's rule: the first success ends the job; failures that
the others survived before it do not count); otherwise the launcher exits with the first failing
worker's status and Horovod's message. A started worker that was never admitted is terminated.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .. import spawn
from ..run_args import get_host_assignments, parse_hosts, set_env_from_args

DISCOVER_HOSTS_FREQUENCY_SECS = 1.0
ELASTIC_TIMEOUT_SECS = 600
COOLDOWN_LIMITS = (1, 3600)  # Horovod's bounds for --blacklist-cooldown-range
RESET_LIMIT_EXCEEDED_MESSAGE = "Horovod was shutdown because number of resets during elastic job exceeded limit: {}"
NO_HOSTS_REMAINING_MESSAGE = "No hosts from previous set remaining, unable to broadcast state."
CHANGE_WINDOW_S = 2.0  # failures this close together are one change of the world, as one reset


class HostState:
    """A host's blacklisting, with Horovod's cooldown: lower * 2^n plus up to `lower` at random,
    within the range; without a range a blacklisted host stays so."""

    def __init__(self, cooldown_range=None):
        self.blacklisted, self.count, self.until = False, 0, 0.0
        self.range = tuple(cooldown_range) if cooldown_range else None

    def blacklist(self, now: float) -> None:
        self.blacklisted = True
        if self.range is None or self.until > now:
            return
        self.count += 1
        lower, upper = self.range
        delay = lower * (1 << self.count) + random.uniform(0, 1) * lower
        self.until = now + max(lower, min(upper, delay))

    def available(self, now: float) -> bool:
        if self.blacklisted and self.range is not None and 0 < self.until <= now:
            self.blacklisted, self.until = False, 0.0  # resurrected
        return not self.blacklisted


def check_cooldown_range(cooldown_range) -> None:
    lower, upper = cooldown_range
    if lower < COOLDOWN_LIMITS[0]:
        raise ValueError(f"Provided cooldown lower limit: {lower} cannot be lower than default cooldown lower "
                         f"limit: {COOLDOWN_LIMITS[0]}")
    if upper > COOLDOWN_LIMITS[1]:
        raise ValueError(f"Provided cooldown upper limit: {upper} cannot be higher than default cooldown upper "
                         f"limit: {COOLDOWN_LIMITS[1]}")


def parse_discovery_output(text: str, default_slots) -> dict:
    """The script's '<host>[:<slots>]' lines -> {host: slots}, in the order printed."""
    out = {}
    for line in text.strip().split("\n"):
        line = line.strip()
        if not line:
            continue  # nothing available yet
        host, _, slots = line.partition(":")
        if slots:
            out[host] = int(slots)
        elif default_slots is None:
            raise ValueError(f"the host discovery script printed '{line}' without slots and --slots-per-host "
                             "is not set")
        else:
            out[host] = default_slots
    return out


def discover(args) -> dict:
    if args.host_discovery_script is None:
        return dict(parse_hosts(args.hosts))
    res = subprocess.run(args.host_discovery_script, shell=True, stdout=subprocess.PIPE, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"Failed to execute discovery script: {args.host_discovery_script}. "
                           f"Exit code: {res.returncode}")
    return parse_discovery_output(res.stdout.decode(), args.slots)


class Worker:
    __slots__ = ("host", "slot", "tag", "wid", "proc", "joiner", "code", "removed", "leaving", "survived")

    def __init__(self, host, slot, tag, wid, joiner):
        self.host, self.slot, self.tag, self.wid, self.joiner = host, slot, tag, wid, joiner
        self.proc, self.code = None, None
        self.removed = False  # no longer the job's: its host went away, or never admitted (its status is ignored)
        self.leaving = False  # asked to leave at the job's next commit (its host went away)
        self.survived = False  # failed before any worker succeeded: the others went on

    @property
    def name(self) -> str:
        return f"{self.host}[{self.slot}]"


def _driver_addr(hosts, local) -> str:
    """This machine's address as the hosts reach it (127.0.0.1 when they all are this machine)."""
    for host, is_local in zip(hosts, local):
        if not is_local:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.connect((host, 9))  # no packet: only the route's source address
                    return s.getsockname()[0]
            except OSError:
                pass
    return "127.0.0.1"


class ElasticDriver:
    def __init__(self, args, environ=None):
        if args.cooldown_range:
            check_cooldown_range(args.cooldown_range)
        if args.host_discovery_script is None:
            if not args.hosts:
                raise ValueError("One of --host-discovery-script, --hosts, or --hostnames must be provided")
            if len(dict(parse_hosts(args.hosts))) < 2:
                raise ValueError("Cannot run in fault tolerance mode with fewer than 2 hosts.")
        self.args = args
        self.min_np = args.min_num_proc or args.num_proc
        self.max_np = args.max_num_proc
        self.timeout = args.elastic_timeout or int(os.getenv("HOROVOD_ELASTIC_TIMEOUT", ELASTIC_TIMEOUT_SECS))
        self.env = set_env_from_args(dict(os.environ if environ is None else environ), args)
        self.env.update(PYTHONUNBUFFERED="1", HOROVOD_ELASTIC="1", TORCHELASTIC_USE_AGENT_STORE="True",
                        TORCHELASTIC_RESTART_COUNT="0")
        self.hosts: dict = {}  # host -> slots, as last discovered (order kept)
        self.states: dict = {}  # host -> HostState
        self.workers: list[Worker] = []
        self.threads: list = []
        self.changes: list[float] = []  # when the world lost workers (joins are counted in the store)
        self.first_success = None
        self.failures: list[Worker] = []  # in the order seen
        self.files = None  # (tag, stream) -> file, with --output-filename
        self.error = None  # (message, exit code) that stopped the job
        self.store = self.port = self.addr = None
        self.next_id = 0
        self.leaves = 0  # leave requests written
        self.said_no_join = False

    # ---- hosts -----------------------------------------------------------------------------
    def _state(self, host) -> HostState:
        if host not in self.states:
            self.states[host] = HostState(self.args.cooldown_range)
        return self.states[host]

    def _free_slots(self, now: float) -> list:
        """(host, slot) pairs of available hosts that no running worker holds, in host order."""
        held = {(w.host, w.slot) for w in self.workers if w.code is None}
        return [(h, s) for h, n in self.hosts.items() if self._state(h).available(now)
                for s in range(n) if (h, s) not in held]

    def _discover(self, first: bool) -> None:
        try:
            found = discover(self.args)
        except BaseException as e:  # noqa: BLE001
            if first:
                raise
            print(f"WARNING: {e}", file=sys.stderr, flush=True)  # transient: retried next second
            return
        for w in self.workers:  # a host that went away: its workers leave at the next commit
            if w.code is None and w.slot >= found.get(w.host, 0) and not w.removed:
                self._ask_to_leave(w)
        self.hosts = found

    def _ask_to_leave(self, w: Worker) -> None:
        from . import join

        w.removed = w.leaving = True
        self.leaves += 1
        store = dist.PrefixStore(join.PREFIX, self.store)
        store.set(f"leave/{self.leaves}", w.wid)
        store.add("leaves", 1)
        store.add("changes", 1)  # (last: rank 0 reads the request when it sees this move)
        print(f"Host {w.host} is no longer available: {w.name} leaves the job at its next commit.",
              file=sys.stderr, flush=True)

    # ---- workers ---------------------------------------------------------------------------
    def _start(self, host, slot, rank, joiner, info=None) -> None:
        """A worker on host[slot]: a rank of the first world (`info` its SlotInfo) or a joiner."""
        self.next_id += 1
        w = Worker(host, slot, str(rank), f"w{self.next_id}", joiner)
        env = dict(self.env, MASTER_ADDR=self.addr, MASTER_PORT=str(self.port), HOROVOD_HOSTNAME=host,
                   MYCCL_HVD_TAG=w.tag, MYCCL_HVD_WORKER_ID=w.wid)
        if joiner:  # its place is known once admitted (hvd.init then sets HOROVOD_RANK, ...)
            env["HOROVOD_ELASTIC_JOIN"] = "1"
        else:
            env.update(RANK=str(rank), WORLD_SIZE=str(info.size), LOCAL_RANK=str(slot),
                       LOCAL_WORLD_SIZE=str(info.local_size), HOROVOD_RANK=str(info.rank),
                       HOROVOD_SIZE=str(info.size), HOROVOD_LOCAL_RANK=str(info.local_rank),
                       HOROVOD_LOCAL_SIZE=str(info.local_size), HOROVOD_CROSS_RANK=str(info.cross_rank),
                       HOROVOD_CROSS_SIZE=str(info.cross_size))
        argv = [sys.executable, spawn.RUN_PY, "--_worker"] + (["--timestamp"] if self.args.prefix_output_with_timestamp
                                                              else []) + ["--"] + list(self.args.command)
        stdin = None
        if not spawn.is_local_host(host):
            launch = spawn.HostLaunch(host, 0, 1, [rank], False, argv, env)
            argv = spawn.remote_argv(host, spawn._command_line(launch), self.args.ssh_port,
                                     self.args.ssh_identity_file)
            env, stdin = dict(os.environ), subprocess.DEVNULL
        if self.args.verbose:
            print(f"[{host}] " + " ".join(shlex.quote(a) for a in argv), flush=True)
        files = self.files
        if files is not None:
            for n in ("stdout", "stderr"):
                d = os.path.join(self.args.output_filename, f"rank.{w.tag}")
                os.makedirs(d, exist_ok=True)
                files[(int(w.tag), n)] = open(os.path.join(d, n), "ab")
        pipe = subprocess.PIPE if files is not None else None
        w.proc = subprocess.Popen(argv, env=env, stdin=stdin, stdout=pipe, stderr=pipe, start_new_session=True)
        for src, dst in ((w.proc.stdout, sys.stdout.buffer), (w.proc.stderr, sys.stderr.buffer)):
            if src is not None:
                self.threads.append(threading.Thread(target=spawn._pump, args=(src, dst, files), daemon=True))
                self.threads[-1].start()
        self.workers.append(w)

    @staticmethod
    def _signal(w: Worker, sig) -> None:
        if w.proc is not None and w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _admitted(self) -> set:
        """The ids of the joiners the job has admitted (join.py writes who registered)."""
        from . import join

        store = dist.PrefixStore(join.PREFIX, self.store)
        out = set()
        for j in range(1, store.add("admitted", 0) + 1):
            if store.check([f"who/{j}"]):
                out.add(store.get(f"who/{j}").decode())
        return out

    # ---- the job ---------------------------------------------------------------------------
    def run(self) -> int:
        now = time.monotonic()
        self._discover(first=True)
        end = now + self.timeout
        while len(self._free_slots(time.monotonic())) < self.args.num_proc:
            if time.monotonic() > end:
                raise RuntimeError("Timed out waiting for minimum number of slots to become available. Please check "
                                   f"that you have enough resources to run at least {self.args.num_proc} Horovod "
                                   "processes.")
            time.sleep(DISCOVER_HOSTS_FREQUENCY_SECS)
            self._discover(first=False)
        names = list(self.hosts)
        self.addr = _driver_addr(names, [spawn.is_local_host(h) for h in names])
        self.store = dist.TCPStore(self.addr, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(60, self.timeout)))
        self.port = self.store.port
        self.files = {} if self.args.output_filename else None
        free = self._free_slots(time.monotonic())[:self.max_np]
        per_host = [(h, sum(1 for x, _ in free if x == h)) for h in names]
        infos = get_host_assignments([(h, n) for h, n in per_host if n], len(free), len(free))
        for rank, ((host, slot), info) in enumerate(zip(free, infos)):
            self._start(host, slot, rank, joiner=False, info=info)
        try:
            return self._watch()
        finally:
            for w in self.workers:
                self._signal(w, signal.SIGTERM)
            for w in self.workers:
                try:
                    w.proc.wait(timeout=spawn.TERMINATE_GRACE_S)
                except subprocess.TimeoutExpired:
                    self._signal(w, signal.SIGKILL)
                    w.proc.wait()
            for t in self.threads:
                t.join(timeout=10)
            for f in (self.files or {}).values():
                f.close()

    def _watch(self) -> int:
        next_discovery, short_since = time.monotonic() + DISCOVER_HOSTS_FREQUENCY_SECS, None
        while True:
            now = time.monotonic()
            for w in self.workers:
                if w.code is None and w.proc.poll() is not None:
                    self._ended(w, now)
            admitted = self._admitted() if any(w.joiner for w in self.workers) else set()  # (store I/O)
            # in the job: every worker started as a rank, and the joiners it admitted
            running = [w for w in self.workers if w.code is None and (not w.joiner or w.wid in admitted)]
            waiting = [w for w in self.workers if w.code is None and w.joiner and w.wid not in admitted]
            if not running:
                for w in waiting:
                    w.removed = True
                    self._signal(w, signal.SIGTERM)
                return self._result()
            if self.error is None and self.first_success is None and self.failures and all(
                    self._state(w.host).blacklisted for w in running):
                self.error = (self._failure_message(self.failures[0]), self.failures[0].code)  # (Horovod's rule)
            if self.error is None and self.first_success is None and all(w.leaving for w in running):
                self.error = (NO_HOSTS_REMAINING_MESSAGE, 1)  # nobody would be left to hand the state on
            if self.error is None:
                self._check_limits(running, now)
            if self.error is not None:
                return self._stop()
            if now >= next_discovery:
                self._discover(first=False)
                next_discovery = now + DISCOVER_HOSTS_FREQUENCY_SECS
                if self.first_success is None:
                    self._grow(len(running) + len(waiting), now)
            if len(running) + len(waiting) < self.min_np:
                short_since = short_since or now
                if now - short_since > self.timeout:
                    self.error = ("Timed out waiting for minimum number of slots to become available. Please check "
                                  f"that you have enough resources to run at least {self.min_np} Horovod processes.", 1)
            else:
                short_since = None
            time.sleep(0.05)

    def _ended(self, w: Worker, now: float) -> None:
        code = w.proc.returncode
        w.code = code if code >= 0 else 128 - code
        if w.removed:
            if not w.leaving:  # (a departure at a commit is a generation: the store counts it)
                self.changes.append(now)
            return
        if w.code == 0:
            self.first_success = self.first_success or now
            return
        self.failures.append(w)
        if self.first_success is None:  # survived by the others: its host is blacklisted
            w.survived = True
            self._state(w.host).blacklist(time.time())
            self.changes.append(now)
            print(f"Process {w.name} exit with status code {w.code}; blacklisting host {w.host}.",
                  file=sys.stderr, flush=True)

    def _grow(self, count: int, now: float) -> None:
        """New workers (joiners) on free slots, up to --max-np."""
        from . import join

        if not join._can_reconfigure():  # a joiner would only fail (and blacklist its host)
            if self._free_slots(now) and not self.said_no_join:
                self.said_no_join = True
                print("WARNING: new slots were discovered, but workers join a running job through torch's "
                      "reconfigure API (torch 2.14 or newer); none is started", file=sys.stderr, flush=True)
            return
        for host, slot in self._free_slots(now):
            if self.max_np is not None and count >= self.max_np:
                return
            self._start(host, slot, count, joiner=True)
            count += 1

    def _check_limits(self, running, now: float) -> None:
        limit = self.args.reset_limit
        if limit is None:
            return
        from . import join

        losses, last = 0, None
        for t in self.changes:  # failures close together are one change of the world
            if last is None or t - last > CHANGE_WINDOW_S:
                losses += 1
            last = t
        if losses + dist.PrefixStore(join.PREFIX, self.store).add("generation", 0) > limit:
            self.error = (RESET_LIMIT_EXCEEDED_MESSAGE.format(limit), 1)

    def _stop(self) -> int:
        message, code = self.error
        print(message, file=sys.stderr, flush=True)
        return code

    def _result(self) -> int:
        failed = [w for w in self.failures if not (self.first_success is not None and w.survived)]
        if not failed:
            return 0
        print(self._failure_message(failed[0]), file=sys.stderr, flush=True)
        return failed[0].code

    @staticmethod
    def _failure_message(w: Worker) -> str:
        return ("Horovod detected that one or more processes exited with non-zero status, thus causing the job to "
                f"be terminated. The first process to do so was:\nProcess name: {w.name}\nExit code: {w.code}\n")


def launch_elastic(args, environ=None) -> int:
    """The elastic launch of run.py's command line: 0, or the status the job ended with."""
    return ElasticDriver(args, environ).run()
