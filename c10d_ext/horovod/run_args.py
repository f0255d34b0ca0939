"""horovodrun's command line for c10d_ext.horovod's launcher (run.py): its flags, config file and
the worker environment they export, and its host lists and rank assignment (horovodrun 0.28.1's)."""

import argparse
import collections
import re
import sys
import warnings

HOROVOD_VERSION = "0.28.1"
LOG_LEVELS = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"]
_HOST_RE = re.compile(r"^[\w.-]+:[0-9]+$")


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
    for title in list(_STORE_FLAGS) + ["elastic arguments"]:
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
    g = groups["elastic arguments"]
    for flags, dest, text in (
            (("--min-np", "--min-num-proc"), "min_num_proc", "fewest workers to go on with (default: -np)"),
            (("--max-np", "--max-num-proc"), "max_num_proc", "most workers to run (default: no limit)"),
            (("--slots-per-host",), "slots", "slots of a discovered host that prints no ':<slots>'"),
            (("--elastic-timeout",), "elastic_timeout",
             "seconds to wait for enough slots (default: HOROVOD_ELASTIC_TIMEOUT or 600)"),
            (("--reset-limit",), "reset_limit", "most changes of the world before the job is stopped")):
        g.add_argument(*flags, dest=dest, type=int, help=text)
    g.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2,
                   help="seconds (min, max) a failed host stays blacklisted (default: for good)")
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
    x.add_argument("--host-discovery-script", dest="host_discovery_script",
                   help="elastic: a command printing the available '<host>[:<slots>]' lines")
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
    if is_elastic(args):  # (elastic/driver.py)
        args.num_proc = args.num_proc if args.num_proc is not None else args.min_num_proc
        if args.num_proc is None:
            parser.error("the following arguments are required: -np/--num-proc")
        if args.hostfile and not args.hosts:
            args.hosts = parse_host_files(args.hostfile)
        if not args.command:
            parser.error("no command to run")
        return args
    if args.num_proc is None:
        parser.error("the following arguments are required: -np/--num-proc")
    if not args.hosts:
        args.hosts = parse_host_files(args.hostfile) if args.hostfile else f"localhost:{args.num_proc}"
    if not args.command:
        parser.error("no command to run")
    return args


def is_elastic(args) -> bool:
    """horovodrun's test: a discovery script or a minimum number of processes."""
    return args.host_discovery_script is not None or args.min_num_proc is not None


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
