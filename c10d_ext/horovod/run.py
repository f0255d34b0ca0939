"""horovodrun for c10d_ext.horovod, on torch's elastic agent (torch.distributed.run).

    python -m c10d_ext.horovod.run -np 4 [-H h1:2,h2:2 | -hostfile FILE] [horovodrun flags] python train.py ...

horovodrun's (0.28.1) flags; the same worker environment (HOROVOD_FUSION_THRESHOLD, ...). Ranks go
to hosts as horovodrun assigns them (host by host, filling slots; exactly -np ranks). Each host
with ranks runs one ``torch.distributed.run`` (static rendezvous: --nnodes, --node-rank,
--nproc-per-node, the first host as --master-addr, a free --master-port), which gives the workers
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT. This machine's hosts run as children; others
through ``ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no [-p PORT] [-i FILE] HOST CMD``
or the prefix in MYCCL_HVD_RSH (shell words, ``{host}`` replaced; a word ``{command}`` gets the
command line as one argument, else ``/bin/sh -c <command line>`` is appended), e.g.
``MYCCL_HVD_RSH='ip netns exec {host}'``. Remotely: ``cd <cwd> ; exec env <environment> <python>
<this file> --_agent ...`` (same Python, file and directory on every host, as with horovodrun).

Worker output lines are tagged ``[<rank>]<stdout>:`` / ``[<rank>]<stderr>:`` (after the time with
--prefix-output-with-timestamp) as in horovodrun's Gloo mode; --output-filename DIR also writes
them to DIR/rank.<rank>/{stdout,stderr}. Exit status: 0, or the first failing worker's (128+N for
signal N) after the others are terminated. ``run(func, ...)`` is horovod.run (results by rank;
the working directory must be shared by the hosts).
"""

import argparse
import collections
import itertools
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings

__all__ = ["SlotInfo", "parse_hosts", "parse_host_files", "get_host_assignments",
           "make_parser", "parse_args", "set_env_from_args", "launch_job", "run_commandline", "main", "run"]

RUN_PY = os.path.abspath(__file__)
HOROVOD_VERSION = "0.28.1"
RSH_ENV = "MYCCL_HVD_RSH"
SSH_COMMAND_PREFIX = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
LOG_LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]
TERMINATE_GRACE_S = 30.0  # torch's agent stops its workers with SIGTERM, then SIGKILL after 30 s
_HOST_RE = re.compile(r"^[\w.-]+:[0-9]+$")
_IGNORED_ENV = [re.compile(r) for r in (r"BASH_FUNC_.*", r"OLDPWD$", r".*CUDA_VISIBLE_DEVICES$")]
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAG = re.compile(rb"\[(\d+)\]<(stdout|stderr)>:")


# ----------------------------------------------------------------------------------- hosts
SlotInfo = collections.namedtuple("SlotInfo", "hostname rank local_rank cross_rank size local_size cross_size")


def parse_hosts(hosts: str) -> list:
    """'h1:2,h2:4' -> [('h1', 2), ('h2', 4)] in the given order, with horovodrun's format check."""
    if not all(_HOST_RE.match(item.strip()) for item in hosts.split(",")):
        raise ValueError("Invalid host input, please make sure it has format as : worker-0:2,worker-1:2.")
    return [(item.strip().split(":")[0], int(item.strip().split(":")[1])) for item in hosts.split(",")]


def parse_host_files(filename: str) -> str:
    """A hostfile of '<host> slots=<n>' lines -> 'host:n,...' (blank and # lines skipped)."""
    out = []
    with open(filename) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            out.append(f"{line.split()[0]}:{line.split('=')[1].strip()}")
    return ",".join(out)


def get_host_assignments(hosts, min_num_proc: int, max_num_proc=None) -> list:
    """Ranks host by host in order, filling each host's slots (at most max_num_proc ranks);
    local_rank is the index on the host, cross_rank the host's index among the hosts that have
    that local_rank, cross_size how many hosts have it."""
    host_ranks, cross = [], collections.defaultdict(dict)
    rank = 0
    for name, slots in hosts:
        ranks = []
        for local_rank in range(slots):
            if rank == max_num_proc:
                break
            ranks.append(rank)
            rank += 1
            cross[local_rank][name] = len(cross[local_rank])
        host_ranks.append((name, ranks))
    if rank < min_num_proc:
        raise ValueError(f"Requested more processes ({min_num_proc}) than there are available slots ({rank})")
    return [SlotInfo(hostname=name, rank=r, local_rank=lr, cross_rank=cross[lr][name], size=rank,
                     local_size=len(ranks), cross_size=len(cross[lr]))
            for name, ranks in host_ranks for lr, r in enumerate(ranks)]


# ----------------------------------------------------------------------------------- flags
class _Const(argparse._StoreConstAction):
    """store_const (default None: unset flags export nothing), optionally deprecated."""

    def __init__(self, *a, deprecated_by=None, **kw):
        super().__init__(*a, **kw)
        self.deprecated_by = deprecated_by

    def __call__(self, parser, ns, values, option_string=None):
        if self.deprecated_by:
            warnings.warn(f"Argument {'|'.join(self.option_strings)} has been replaced by {self.deprecated_by} "
                          f"and will be removed in v0.21.0", DeprecationWarning)
        super().__call__(parser, ns, values, option_string)


class _Nics(argparse.Action):
    """--network-interfaces a,b and (deprecated) repeated --network-interface a: a set."""

    def __call__(self, parser, ns, values, option_string=None):
        items = [values]
        if "," in values:
            if option_string == "--network-interface":
                warnings.warn("Providing multiple interfaces via --network-interface is deprecated. Please use "
                              "--network-interfaces instead, or use multiple --network-interface arguments with a "
                              "single network interface each.", DeprecationWarning)
            items = values.split(",")
        setattr(ns, self.dest, (getattr(ns, self.dest, None) or set()) | {i for i in items if i})


def _version() -> str:
    mod = sys.modules.get("c10d_ext.horovod")
    return getattr(mod, "__version__", HOROVOD_VERSION)


_STORE_FLAGS = {  # group -> (flag, type, help): values exported to the workers when given
    "tuneable parameter arguments": [
        ("--fusion-threshold-mb", int, "fusion buffer size in MB; 0 disables fusion (default: 128)"),
        ("--cycle-time-ms", float, "delay between coordination cycles (default: 1)"),
        ("--cache-capacity", int, "response cache entries (default: 1024)")],
    "autotune arguments": [
        ("--autotune-log-file", str, "CSV log of the autotune samples"),
        ("--autotune-warmup-samples", int, "(default: 3)"), ("--autotune-steps-per-sample", int, "(default: 10)"),
        ("--autotune-bayes-opt-max-samples", int, "(default: 20)"),
        ("--autotune-gaussian-process-noise", float, "in [0, 1] (default: 0.8)")],
    "timeline arguments": [("--timeline-filename", str, "rank 0 writes its timeline (Chrome trace) here")],
    "stall check arguments": [("--stall-check-warning-time-seconds", int, "(default: 60)"),
                              ("--stall-check-shutdown-time-seconds", int, "(default: 0)")],
    "library arguments": [("--num-nccl-streams", int, "(exported)"), ("--thread-affinity", int, "(exported)"),
                          ("--gloo-timeout-seconds", int, "(default: 30)")],
    "logging arguments": [("--log-level", LOG_LEVELS, "(default: WARNING)")],
}
_BOOL_FLAGS = {  # group -> (on flag, off flag, dest, help; the off flag's help is hidden)
    "tuneable parameter arguments": [
        ("--hierarchical-allreduce", "--no-hierarchical-allreduce", "hierarchical_allreduce", "two-level allreduce"),
        ("--hierarchical-allgather", "--no-hierarchical-allgather", "hierarchical_allgather", "two-level allgather"),
        ("--torus-allreduce", "--no-torus-allreduce", "torus_allreduce", "2D torus allreduce")],
    "autotune arguments": [("--autotune", "--no-autotune", "autotune", "autotune the tunable parameters")],
    "timeline arguments": [("--timeline-mark-cycles", "--no-timeline-mark-cycles", "timeline_mark_cycles",
                            "mark cycles in the timeline")],
    "stall check arguments": [("--no-stall-check", "--stall-check", "no_stall_check", "disable the stall check")],
    "library arguments": [("--mpi-threads-disable", "--no-mpi-threads-disable", "mpi_threads_disable",
                           "request MPI_THREAD_SINGLE (exported)")],
}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m c10d_ext.horovod.run",
                                description="horovodrun for c10d_ext.horovod, on torch.distributed.run")
    p.add_argument("-v", "--version", action="version", version=_version(), help="print the Horovod API version")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, help="total number of worker processes")
    p.add_argument("-cb", "--check-build", dest="check_build", action="store_true", help="print the build and exit")
    p.add_argument("--disable-cache", dest="disable_cache", action="store_true", help="accepted (nothing cached)")
    p.add_argument("--start-timeout", dest="start_timeout", type=int,
                   help="seconds for every host to join the rendezvous (default: HOROVOD_START_TIMEOUT or 30)")
    p.add_argument("--network-interfaces", dest="nics", action=_Nics, help='interfaces to use, e.g. "eth0,eth1"')
    p.add_argument("--network-interface", dest="nics", action=_Nics, help="an interface (deprecated; repeatable)")
    p.add_argument("--output-filename", dest="output_filename",
                   help="also write each rank's output to <dir>/rank.<rank>/{stdout,stderr}")
    p.add_argument("--verbose", dest="verbose", action="store_true", help="print the commands that are run")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    p.add_argument("--config-file", dest="config_file", help="YAML (or JSON) parameters; flags override them")
    g = p.add_argument_group("SSH arguments")
    g.add_argument("-p", "--ssh-port", dest="ssh_port", type=int, help="ssh port of every host")
    g.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file", help="ssh private key file")
    groups = {}
    for title in list(_STORE_FLAGS) + ["elastic arguments (not supported)"]:
        groups[title] = p.add_argument_group(title)
    for title, flags in _STORE_FLAGS.items():
        for flag, kind, text in flags:
            choices = kind if isinstance(kind, list) else None
            groups[title].add_argument(flag, action="store", type=None if choices else kind, choices=choices, help=text)
    for title, flags in _BOOL_FLAGS.items():
        for on, off, dest, text in flags:
            x = groups[title].add_mutually_exclusive_group()
            x.add_argument(on, dest=dest, action=_Const, const=True, default=None, help=text)
            x.add_argument(off, dest=dest, action=_Const, const=False, default=None, help=argparse.SUPPRESS)
    g = groups["elastic arguments (not supported)"]
    for flags, dest in ((("--min-np", "--min-num-proc"), "min_num_proc"), (("--max-np", "--max-num-proc"),
                        "max_num_proc"), (("--slots-per-host",), "slots"), (("--elastic-timeout",), "elastic_timeout"),
                        (("--reset-limit",), "reset_limit")):
        g.add_argument(*flags, dest=dest, type=int, help=argparse.SUPPRESS)
    g.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2, help=argparse.SUPPRESS)
    g = groups["library arguments"]
    g.add_argument("--mpi-args", dest="mpi_args", help="accepted and ignored (no mpirun here)")
    g.add_argument("--tcp", dest="tcp_flag", action="store_true", help="TCP only (exports NCCL_IB_DISABLE=1)")
    g.add_argument("--binding-args", dest="binding_args", help="accepted and ignored (no mpirun here)")
    x = groups["logging arguments"].add_mutually_exclusive_group()
    for flags, const, hidden, dep in ((("--log-with-timestamp",), True, True, None),
                                      (("--log-without-timestamp",), False, False, None),
                                      (("--log-hide-timestamp",), False, True, "--log-without-timestamp"),
                                      (("--no-log-hide-timestamp",), True, True, "--log-with-timestamp")):
        x.add_argument(*flags, dest="log_with_timestamp", action=_Const, const=const, default=None, deprecated_by=dep,
                       help=argparse.SUPPRESS if hidden else "hide the time in Horovod's log lines")
    x.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", dest="prefix_output_with_timestamp",
                   action="store_true", help="start every output line with the time")
    x = p.add_argument_group("host arguments").add_mutually_exclusive_group()
    x.add_argument("-H", "--hosts", dest="hosts", help="host:slots,... (default: localhost:<np>)")
    x.add_argument("-hostfile", "--hostfile", dest="hostfile", help="file of '<host> slots=<n>' lines")
    x.add_argument("--host-discovery-script", action="store", help=argparse.SUPPRESS)
    x = p.add_argument_group("controller arguments (accepted; the workers use myccl)").add_mutually_exclusive_group()
    for flag in ("gloo", "mpi", "jsrun"):
        x.add_argument(f"--{flag}", dest=f"use_{flag}", action="store_true", help="accepted")
    return p


_CONFIG_KEYS = {
    "params": [(k, k) for k in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
                                "hierarchical_allgather", "torus_allreduce")],
    "autotune": [(k, "autotune_" + k) for k in ("log_file", "warmup_samples", "steps_per_sample",
                                                "bayes_opt_max_samples", "gaussian_process_noise")],
    "timeline": [("filename", "timeline_filename"), ("mark_cycles", "timeline_mark_cycles")],
    "stall_check": [("warning_time_seconds", "stall_check_warning_time_seconds"),
                    ("shutdown_time_seconds", "stall_check_shutdown_time_seconds")],
    "library_options": [(k, k) for k in ("mpi_threads_disable", "num_nccl_streams", "thread_affinity",
                                         "gloo_timeout_seconds")],
    "logging": [("level", "log_level"), ("with_timestamp", "log_with_timestamp")],
}


def set_args_from_config(args, config: dict) -> None:
    """horovodrun's --config-file sections; flags given on the command line (not None) win."""
    controller = config.get("controller")
    if controller and not args.use_gloo and not args.use_mpi:
        if controller.lower() not in ("gloo", "mpi"):
            raise ValueError(f"No such controller supported: {controller}")
        setattr(args, "use_" + controller.lower(), True)
    for section, keys in _CONFIG_KEYS.items():
        values = config.get(section)
        if not values:
            continue
        for key, dest in keys:
            if getattr(args, dest) is None and values.get(key) is not None:
                setattr(args, dest, values[key])
    if config.get("autotune") and args.autotune is None:
        args.autotune = config["autotune"].get("enabled", False)
    if config.get("stall_check") and args.no_stall_check is None:
        args.no_stall_check = not config["stall_check"].get("enabled", True)


def validate_config_args(args) -> None:
    for name in ("fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "autotune_warmup_samples",
                 "autotune_steps_per_sample", "autotune_bayes_opt_max_samples", "stall_check_warning_time_seconds",
                 "stall_check_shutdown_time_seconds", "num_nccl_streams", "thread_affinity", "gloo_timeout_seconds"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    noise = args.autotune_gaussian_process_noise
    if noise is not None and not 0 <= noise <= 1:
        raise ValueError(f"autotune_gaussian_process_noise={noise} must be in [0, 1]")


def _load_config(path: str) -> dict:
    """YAML with PyYAML; without it, JSON (a subset of YAML)."""
    with open(path) as f:
        text = f.read()
    try:
        import yaml  # type: ignore
    except ImportError:
        import json
        return json.loads(text) or {}
    return yaml.safe_load(text) or {}


def parse_args(argv=None):
    """Parses horovodrun's command line; fills hosts from --hostfile or localhost:<np>."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        set_args_from_config(args, _load_config(args.config_file))
    validate_config_args(args)
    if args.check_build:
        return args
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if args.min_num_proc is not None or args.host_discovery_script is not None:
        parser.error("elastic mode (--min-np / --host-discovery-script) is not supported by this launcher; "
                     "use hvd.elastic inside a fixed-size job")
    if not args.hosts:
        args.hosts = parse_host_files(args.hostfile) if args.hostfile else f"localhost:{args.num_proc}"
    if not args.command:
        parser.error("no command to run")
    return args


def set_env_from_args(env: dict, args) -> dict:
    """The worker environment horovodrun exports for these flags (only flags that were set)."""
    def put(key, value, fn=None):
        if value is not None:
            env[key] = str(fn(value) if fn else value)

    flag = (lambda v: 1 if v else 0)
    put("HOROVOD_FUSION_THRESHOLD", args.fusion_threshold_mb, lambda v: v * 1024 * 1024)
    put("HOROVOD_CYCLE_TIME", args.cycle_time_ms)
    put("HOROVOD_CACHE_CAPACITY", args.cache_capacity)
    put("HOROVOD_HIERARCHICAL_ALLREDUCE", args.hierarchical_allreduce, flag)
    put("HOROVOD_HIERARCHICAL_ALLGATHER", args.hierarchical_allgather, flag)
    put("HOROVOD_TORUS_ALLREDUCE", args.torus_allreduce, flag)
    if args.autotune:
        put("HOROVOD_AUTOTUNE", args.autotune, flag)
        put("HOROVOD_AUTOTUNE_LOG", args.autotune_log_file)
        put("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", args.autotune_warmup_samples)
        put("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", args.autotune_steps_per_sample)
        put("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", args.autotune_bayes_opt_max_samples)
        put("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", args.autotune_gaussian_process_noise)
    if args.timeline_filename:
        put("HOROVOD_TIMELINE", args.timeline_filename)
        put("HOROVOD_TIMELINE_MARK_CYCLES", args.timeline_mark_cycles, flag)
    put("HOROVOD_STALL_CHECK_DISABLE", args.no_stall_check, flag)
    put("HOROVOD_STALL_CHECK_TIME_SECONDS", args.stall_check_warning_time_seconds)
    put("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", args.stall_check_shutdown_time_seconds)
    put("HOROVOD_MPI_THREADS_DISABLE", args.mpi_threads_disable, flag)
    put("HOROVOD_NUM_NCCL_STREAMS", args.num_nccl_streams)
    put("NCCL_IB_DISABLE", 1 if args.tcp_flag else None)
    put("HOROVOD_THREAD_AFFINITY", args.thread_affinity)
    put("HOROVOD_GLOO_TIMEOUT_SECONDS", args.gloo_timeout_seconds)
    put("HOROVOD_LOG_LEVEL", args.log_level)
    put("HOROVOD_LOG_HIDE_TIME", args.log_with_timestamp, lambda v: 0 if v else 1)
    if args.nics:
        nics = sorted(args.nics)
        env["HOROVOD_GLOO_IFACE"] = nics[0]
        env["NCCL_SOCKET_IFNAME"] = ",".join(nics)
        env["MYCCL_SOCKET_IFNAME"] = "=" + ",".join(nics)  # exact names, as horovodrun means them
    return env


# ----------------------------------------------------------------------------------- launching
def is_local_host(name: str) -> bool:
    """Whether `name` is this machine: a loopback name, our host name, or an address of ours."""
    if name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        addr = sockaddr[0]
        if addr.startswith("127.") or addr == "::1":
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))  # only addresses of this machine can be bound
            return True
        except OSError:
            pass
    return False


def _master_addr(hosts: list, local: list) -> str:
    """The first host, as every host can reach it (this machine's address towards the others
    when the first host is a loopback name for this machine)."""
    if not local[0]:
        return hosts[0]
    if all(local):
        return "127.0.0.1"
    for host in [hosts[0]] + [h for h, is_local in zip(hosts, local) if not is_local]:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # no packet: just the route's source address
                if not s.getsockname()[0].startswith("127."):
                    return hosts[0] if host == hosts[0] else s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostname()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _exportable(env: dict) -> dict:
    return {k: v for k, v in env.items()
            if _ENV_NAME.match(k) and not any(r.match(k) for r in _IGNORED_ENV)}


def remote_argv(host: str, command_line: str, ssh_port=None, ssh_identity_file=None) -> list:
    """The argv that runs the shell command line `command_line` on `host`."""
    from ..config import parse_env

    template = parse_env()["hvd_rsh"]
    if template:
        words = [w.replace("{host}", host) for w in shlex.split(template)]
        if "{command}" in words:
            return [command_line if w == "{command}" else w for w in words]
        return words + ["/bin/sh", "-c", command_line]
    return (SSH_COMMAND_PREFIX + (["-p", str(ssh_port)] if ssh_port is not None else [])
            + (["-i", ssh_identity_file] if ssh_identity_file is not None else []) + [host, command_line])


HostLaunch = collections.namedtuple("HostLaunch", "host node_rank nproc ranks local argv env")


def plan_launch(args, environ=None) -> list:
    """One HostLaunch per host that gets ranks: its torch.distributed.run (through --_agent)."""
    environ = dict(os.environ if environ is None else environ)
    slots = get_host_assignments(parse_hosts(args.hosts), args.num_proc, args.num_proc)
    # one torchrun "node" per -H entry that gets ranks (torch numbers ranks node after node as well)
    groups = [(h, [s.rank for s in g]) for h, g in itertools.groupby(slots, key=lambda s: s.hostname)]
    names = [h for h, _ in groups]
    local = [is_local_host(h) for h in names]
    master = _master_addr(names, local)
    port = _free_port()
    timeout = args.start_timeout or int(os.getenv("HOROVOD_START_TIMEOUT", "30"))
    run_id = uuid.uuid4().hex[:12]
    base = set_env_from_args(dict(environ), args)
    base["PYTHONUNBUFFERED"] = "1"
    worker = [sys.executable, RUN_PY, "--_worker"] + (["--timestamp"] if args.prefix_output_with_timestamp else [])
    out = []
    for node_rank, (host, ranks) in enumerate(groups):
        argv = [sys.executable, RUN_PY, "--_agent", "--nnodes", str(len(names)), "--node-rank", str(node_rank),
                "--nproc-per-node", str(len(ranks)), "--master-addr", master, "--master-port", str(port),
                "--rdzv-id", run_id, "--rdzv-conf", f"timeout={timeout}", "--max-restarts", "0",
                "--no-python"] + worker + ["--"] + list(args.command)
        env = dict(base, HOROVOD_HOSTNAME=host)
        out.append(HostLaunch(host, node_rank, len(ranks), ranks, local[node_rank], argv, env))
    return out


def _command_line(h: HostLaunch) -> str:
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(_exportable(h.env).items()))
    return (f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 ; exec env {exports} "
            + " ".join(shlex.quote(a) for a in h.argv))


def _pump(src, dst, files: dict):
    """Copies an agent's output to ours, and each tagged line to its rank's file."""
    for line in iter(src.readline, b""):
        dst.write(line)
        dst.flush()
        m = _TAG.search(line[:200])
        if m and files is not None:
            f = files.get((int(m.group(1)), m.group(2).decode()))
            if f is not None:
                f.write(line)
                f.flush()
    src.close()


def _signal_all(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # each agent leads a session of its own
            except (ProcessLookupError, PermissionError):
                pass


def launch_job(args, environ=None) -> int:
    """Starts every host's agent, waits for all; returns 0 or the first failing worker's status."""
    plan = plan_launch(args, environ)
    files, threads, procs, first, deadline = None, [], [], None, None
    if args.output_filename:  # <dir>/rank.<rank zero-padded to the width of num_proc - 1>/{stdout,stderr}
        width, files = len(str(max(args.num_proc - 1, 1))), {}
        for rank in range(args.num_proc):
            d = os.path.join(args.output_filename, f"rank.{str(rank).zfill(width)}")
            os.makedirs(d, exist_ok=True)
            files.update({(rank, n): open(os.path.join(d, n), "wb") for n in ("stdout", "stderr")})
    pipe = subprocess.PIPE if files is not None else None
    try:
        for h in plan:
            argv, env, stdin = h.argv, h.env, None
            if not h.local:
                argv = remote_argv(h.host, _command_line(h), args.ssh_port, args.ssh_identity_file)
                env, stdin = dict(os.environ), subprocess.DEVNULL
            if args.verbose:
                print(f"[{h.host}] " + " ".join(shlex.quote(a) for a in argv), flush=True)
            procs.append(subprocess.Popen(argv, env=env, stdin=stdin, stdout=pipe, stderr=pipe,
                                          start_new_session=True))
            for src, dst in ((procs[-1].stdout, sys.stdout.buffer), (procs[-1].stderr, sys.stderr.buffer)):
                if src is not None:
                    threads.append(threading.Thread(target=_pump, args=(src, dst, files), daemon=True))
                    threads[-1].start()
        while True:
            running = [p.poll() is None for p in procs]
            failed = [(h, p.returncode) for h, p in zip(plan, procs) if p.returncode not in (None, 0)]
            if failed and first is None:
                first = failed[0]
                if any(running):
                    print(f"Terminating remaining workers after failure of Process {first[0].host} "
                          f"(ranks {first[0].ranks[0]}-{first[0].ranks[-1]}).", flush=True)
                    _signal_all(procs, signal.SIGTERM)
                    deadline = time.monotonic() + TERMINATE_GRACE_S
            if not any(running):
                break
            if deadline is not None and time.monotonic() > deadline:
                _signal_all(procs, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)
    finally:
        _signal_all(procs, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_all([p], signal.SIGKILL)
                p.wait()
        for t in threads:
            t.join(timeout=10)
        for f in (files or {}).values():
            f.close()
    if first is None:
        return 0
    code = first[1] if first[1] > 0 else 128 - first[1]
    print("Horovod detected that one or more processes exited with non-zero status, thus causing the job to be "
          f"terminated. The first process to do so was:\nProcess name: {first[0].host}\nExit code: {code}\n",
          file=sys.stderr, flush=True)
    return code


def check_build(verbose: bool = False) -> str:
    try:
        import c10d_ext.horovod as hvd
    except Exception:  # noqa: BLE001
        hvd = None

    def mark(name):
        try:
            return "X" if getattr(hvd, name)() else " "
        except Exception:  # noqa: BLE001
            return " "
    rows = [("Available Frameworks", [(" ", "TensorFlow"), ("X" if hvd else " ", "PyTorch"), (" ", "MXNet")]),
            ("Available Controllers", [(mark("mpi_built"), "MPI"), (mark("gloo_built"), "Gloo")]),
            ("Available Tensor Operations", [(mark(f"{n.lower()}_built"), n) for n in ("NCCL", "DDL", "CCL", "MPI",
                                                                                     "Gloo")])]
    text = f"Horovod v{_version()}:\n" + "".join(f"\n{title}:\n" + "".join(f"    [{m}] {n}\n" for m, n in items)
                                                 for title, items in rows)
    return ("\n" if verbose else "") + text.rstrip("\n")


def run_commandline(argv=None) -> int:
    args = parse_args(argv)
    if args.check_build:
        print(check_build(args.verbose))
        return 0
    if args.log_level:
        logging.addLevelName(logging.NOTSET, "TRACE")
        logging.basicConfig(level=logging.getLevelName(args.log_level) if args.log_level != "FATAL" else 50)
    return launch_job(args)


class _Interrupted(BaseException):
    pass


def main(argv=None) -> None:
    def on_signal(signum, frame):
        raise _Interrupted(signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    try:
        sys.exit(run_commandline(argv))
    except (_Interrupted, KeyboardInterrupt) as e:
        sys.exit(128 + (e.args[0] if isinstance(e, _Interrupted) else signal.SIGINT))
    except ValueError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


# ----------------------------------------------------------------------------------- horovod.run
def run(func, args=(), kwargs=None, num_proc=1, min_num_proc=None, max_num_proc=None, slots=None,
        reset_limit=None, cooldown_range=None, hosts=None, hostfile=None, host_discovery_script=None,
        start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None, output_filename=None,
        verbose=None, use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None,
        network_interfaces=None, executable=None, np=None, min_np=None, max_np=None):
    """horovod.run: runs func(*args, **kwargs) on num_proc ranks; returns the results by rank."""
    import pickle
    import shutil
    import tempfile

    for old, new in (("network_interface", "network_interfaces"), ("np", "num_proc"),
                     ("min_np", "min_num_proc"), ("max_np", "max_num_proc")):
        if locals()[old] is not None:
            warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning)
    network_interfaces = network_interface.split(",") if network_interface else network_interfaces
    num_proc = np if np is not None else num_proc
    min_num_proc = min_np if min_np is not None else min_num_proc
    if min_num_proc is not None or host_discovery_script is not None:
        raise ValueError("elastic mode (min_num_proc / host_discovery_script) is not supported by this launcher")
    argv = ["-np", str(num_proc)]
    for flag, value in (("-H", hosts), ("-hostfile", hostfile), ("--start-timeout", start_timeout),
                        ("-p", ssh_port), ("-i", ssh_identity_file), ("--output-filename", output_filename),
                        ("--mpi-args", mpi_args)):
        if value is not None:
            argv += [flag, str(value)]
    if network_interfaces:
        argv += ["--network-interfaces", ",".join(network_interfaces)]
    argv += ["--verbose"] if verbose else []
    argv += ["--gloo"] if use_gloo else (["--mpi"] if use_mpi else [])
    work = tempfile.mkdtemp(prefix="hvdrun-", dir=os.getcwd())
    try:
        main_mod = sys.modules.get("__main__")
        spec = {"main_path": getattr(main_mod, "__file__", None), "sys_path": [p for p in sys.path if p],
                "payload": pickle.dumps((func, tuple(args), dict(kwargs or {})))}
        with open(os.path.join(work, "func.pkl"), "wb") as f:
            pickle.dump(spec, f)
        cli = parse_args(argv + [executable or sys.executable, RUN_PY, "--_func", work])
        code = launch_job(cli)
        if code != 0:
            raise RuntimeError(f"Horovod detected that one or more processes exited with non-zero status "
                               f"(exit code {code})")
        results = []
        for rank in range(num_proc):
            with open(os.path.join(work, f"result.{rank}"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------------- on the hosts
def _agent_main(argv) -> int:
    """One host's torch.distributed.run; exits with the first failed worker's status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args, run as torchrun

    try:
        torchrun(torchrun_args(argv))
    except ChildFailedError as e:
        for rank, failure in sorted(e.failures.items(), key=lambda kv: kv[1].timestamp):
            code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
            print(f"Process {rank} exit with status code {code}.", flush=True)
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else (128 - code if code < 0 else 1)
    except Exception as e:  # noqa: BLE001
        if "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower():
            print("Timed out waiting for all hosts to join the rendezvous. Please check connectivity between "
                  "servers. You may need to increase the --start-timeout parameter if you have too many servers.",
                  file=sys.stderr, flush=True)
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _copy_tagged(fd: int, dst, tag: bytes, timestamp: bool) -> None:
    """Copies fd to dst, each line (ended by \\n or \\r) prefixed with the rank tag."""
    pending, chunk = b"", b"?"
    while chunk:
        chunk = os.read(fd, 65536)
        parts = re.split(rb"(\r|\n)", pending + chunk)
        lines = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)] + ([parts[-1]] if not chunk else [])
        pending = parts[-1]
        for line in filter(None, lines):
            dst.write((time.asctime().encode() if timestamp else b"") + tag + line)
        dst.flush()
    os.close(fd)


def _worker_main(argv) -> int:
    """Runs one rank's command, tagging its output lines [rank]<stdout>: / [rank]<stderr>:."""
    timestamp = bool(argv) and argv[0] == "--timestamp"
    argv = argv[1:] if timestamp else argv
    argv = argv[1:] if argv and argv[0] == "--" else argv
    rank = os.environ.get("RANK", "0").encode()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: proc.poll() is None and proc.send_signal(signum))
    threads = [threading.Thread(target=_copy_tagged, args=(src.fileno(), dst, b"[" + rank + b"]<" + name + b">:",
                                                           timestamp), daemon=True)
               for src, dst, name in ((proc.stdout, sys.stdout.buffer, b"stdout"),
                                      (proc.stderr, sys.stderr.buffer, b"stderr"))]
    for t in threads:
        t.start()
    rc = proc.wait()
    for t in threads:
        t.join(timeout=30)
    if rc < 0:  # die of the same signal, so the agent sees what the worker saw
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


def _func_main(argv) -> int:
    """A rank of run(): loads the function (and the launching script as __main__), runs it and
    writes result.<rank>."""
    import pickle
    import runpy
    import traceback
    import types

    work = argv[0]
    with open(os.path.join(work, "func.pkl"), "rb") as f:
        spec = pickle.load(f)
    sys.path[:0] = [p for p in spec["sys_path"] if p not in sys.path]
    if spec["main_path"]:
        main_mod = types.ModuleType("__mp_main__")
        main_mod.__dict__.update(runpy.run_path(spec["main_path"], run_name="__mp_main__"))
        sys.modules["__main__"] = sys.modules["__mp_main__"] = main_mod
    rank = int(os.environ.get("RANK", "0"))
    try:
        func, args, kwargs = pickle.loads(spec["payload"])
        result = func(*args, **kwargs)
    except BaseException:
        traceback.print_exc()
        return 1
    tmp = os.path.join(work, f".result.{rank}")
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, os.path.join(work, f"result.{rank}"))
    return 0


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(RUN_PY):
        del sys.path[0]  # run as a file: this package's modules must not shadow others
    _helpers = {"--_agent": _agent_main, "--_worker": _worker_main, "--_func": _func_main}
    if len(sys.argv) > 1 and sys.argv[1] in _helpers:
        sys.exit(_helpers[sys.argv[1]](sys.argv[2:]))
    main()
