"""horovodrun for c10d_ext.horovod, on torch's elastic agent (torch.distributed.run).

    python -m c10d_ext.horovod.run -np 4 [-H h1:2,h2:2 | -hostfile FILE] [horovodrun flags] python train.py ...

horovodrun's (0.28.1) flags; the same worker environment (HOROVOD_FUSION_THRESHOLD, ...). Ranks go
to hosts as horovodrun assigns them (host by host, filling slots; exactly -np ranks). Each host
with ranks runs one ``torch.distributed.run`` (static rendezvous: --nnodes, --node-rank,
--nproc-per-node, the first host as --master-addr, a free --master-port), which gives the workers
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT. Each worker also gets horovodrun's HOROVOD_RANK,
_SIZE, _LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE and HOROVOD_HOSTNAME (its -H name): the
launcher hands each host's agent its rows of the rank table, and the worker wrapper picks its row by
LOCAL_RANK (checked against RANK) before it starts the command. This machine's hosts run as children; others
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

The flags and host lists are in run_args.py; with --min-np or --host-discovery-script the job runs
under Horovod's elastic driver instead (elastic/driver.py).
"""

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

if __package__:  # (run as a file on the hosts, --_agent and --_worker need none of it)
    from .run_args import (SlotInfo, _version, get_host_assignments, is_elastic, make_parser,  # noqa: F401
                           parse_args, parse_host_files, parse_hosts, set_env_from_args)
    from .spawn import (RSH_ENV, RUN_PY, TERMINATE_GRACE_S, HostLaunch, _command_line, _pump,  # noqa: F401
                        is_local_host, remote_argv)


def _config():
    """c10d_ext.config, the reader of every MYCCL_* variable. Run as a file (--_agent, --_worker)
    this module has no package: config.py is then loaded from its file, without importing
    c10d_ext (and torch) into the worker wrapper."""
    if __package__:
        from .. import config

        return config
    mod = sys.modules.get("_c10d_ext_config")
    if mod is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config.py")
        spec = importlib.util.spec_from_file_location("_c10d_ext_config", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # (dataclasses look their module up while the class is made)
        spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------- launching
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


# The rank table of one host's workers, for its agent's worker wrapper: torch's agent knows each
# worker's RANK and LOCAL_RANK, and horovodrun also gives HOROVOD_LOCAL_SIZE and the cross ranks.
SLOTS_ENV = "MYCCL_HVD_SLOTS"
SLOT_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
             "HOROVOD_CROSS_SIZE")


def encode_slots(host_slots) -> str:
    """'rank,size,local_rank,local_size,cross_rank,cross_size' per worker of a host, ';' between."""
    return ";".join(",".join(str(v) for v in (s.rank, s.size, s.local_rank, s.local_size, s.cross_rank,
                                               s.cross_size)) for s in host_slots)


def slot_env(env) -> dict:
    """horovodrun's per-worker variables for the worker whose torch agent variables are in `env`
    (its position on the host is LOCAL_RANK); {} without a rank table."""
    table = _config().value(SLOTS_ENV, env)
    if not table:
        return {}
    rows = [row.split(",") for row in table.split(";")]
    local = int(env.get("LOCAL_RANK", "0"))
    row = dict(zip(SLOT_VARS, rows[local]))
    if env.get("RANK") is not None and env["RANK"] != row["HOROVOD_RANK"]:
        raise RuntimeError(f"horovodrun's rank table gives local worker {local} rank {row['HOROVOD_RANK']}, "
                           f"but torch's agent gave it RANK={env['RANK']}")
    return row


def plan_launch(args, environ=None) -> list:
    """One HostLaunch per host that gets ranks: its torch.distributed.run (through --_agent)."""
    environ = dict(os.environ if environ is None else environ)
    slots = get_host_assignments(parse_hosts(args.hosts), args.num_proc, args.num_proc)
    # one torchrun "node" per -H entry that gets ranks (torch numbers ranks node after node as well)
    groups = [(h, list(g)) for h, g in itertools.groupby(slots, key=lambda s: s.hostname)]
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
    for node_rank, (host, host_slots) in enumerate(groups):
        ranks = [s.rank for s in host_slots]
        argv = [sys.executable, RUN_PY, "--_agent", "--nnodes", str(len(names)), "--node-rank", str(node_rank),
                "--nproc-per-node", str(len(ranks)), "--master-addr", master, "--master-port", str(port),
                "--rdzv-id", run_id, "--rdzv-conf", f"timeout={timeout}", "--max-restarts", "0",
                "--no-python"] + worker + ["--"] + list(args.command)
        env = dict(base, HOROVOD_HOSTNAME=host)
        env[SLOTS_ENV] = encode_slots(host_slots)
        out.append(HostLaunch(host, node_rank, len(ranks), ranks, local[node_rank], argv, env))
    return out


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
    if is_elastic(args):
        from .elastic.driver import launch_elastic

        return launch_elastic(args)
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
        raise ValueError("elastic mode (min_num_proc / host_discovery_script) of horovod.run(func) is not supported "
                         "by this launcher; run a script with `python -m c10d_ext.horovod.run --min-np ...`")
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
    rank = (_config().value("MYCCL_HVD_TAG") or os.environ.get("RANK", "0")).encode()  # (elastic: its first rank)
    env = dict(os.environ, **slot_env(os.environ))
    env.pop(SLOTS_ENV, None)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
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
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # run as a file: this package's modules must not shadow others
    _helpers = {"--_agent": _agent_main, "--_worker": _worker_main, "--_func": _func_main}
    if len(sys.argv) > 1 and sys.argv[1] in _helpers:
        sys.exit(_helpers[sys.argv[1]](sys.argv[2:]))
    main()
