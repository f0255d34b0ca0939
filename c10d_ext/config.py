"""Every MYCCL_* environment variable, parsed and validated in one place.

C++ never reads the environment: the backend creator turns these values (overridden by any
field set on ``c10d_ext.Options``) into one ``_C.Config`` per process group. A variable's
``Options`` field is its name without ``MYCCL_``, in lower case. Python code reads a variable
through ``value()`` or ``parse_env()``, never through ``os.environ`` (tests/project/test_config.py checks).
``python -m c10d_ext.info`` prints this table with the values in effect, and docs/CONFIG.md is
generated from it (``python scripts/gen_config_doc.py``; a test checks that it is current), with
the variables c10d_ext's launchers set for the processes they start and those the build reads
(``BUILD_VARS``, read by setup.py, which cannot import the package it builds).

This module imports nothing of c10d_ext at import time (only a C++ default needs ``_C``): the
Horovod launcher's worker wrapper loads it from its file without the package (horovod/run.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


class _CppDefault:
    """A field's default is the one C++ declares (MYCCL_CONFIG_FIELDS in Config.hpp)."""

    def __repr__(self) -> str:
        return "<C++ default>"


CPP = _CppDefault()


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    meaning: str
    cpp: bool = True  # False: read by the Python side only (not a per-group option)
    python_default: Any = CPP  # only for cpp=False variables
    show: Callable[[Any], str] = str  # a parsed value in the words users write
    public: bool = True  # False: a testing knob, left out of Options' docs, CONFIG.md and info
    set_by: str = ""  # who sets it for the processes it starts (not users): its own table in CONFIG.md

    @property
    def field(self) -> str:
        """The attribute of _C.Config and c10d_ext.Options: the name without MYCCL_, lower case."""
        return self.name[len("MYCCL_"):].lower()

    @property
    def default(self) -> Any:
        if self.python_default is not CPP:
            return self.python_default
        from . import _C

        return getattr(_C.Config(), self.field)


def _show_bool(v: Any) -> str:
    return "1" if v else "0"


def _show_auto_bool(v: Any) -> str:
    return "auto" if v == -1 else _show_bool(v)


def _show_bytes(v: Any) -> str:
    for suffix, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v and v % m == 0:
            return f"{v // m}{suffix}"
    return str(v)


def _show_stream_bytes(v: Any) -> str:
    return {-1: "auto", 0: "off"}.get(v) or _show_bytes(v)


def _show_debug(v: Any) -> str:
    return "DETAIL" if v else "OFF"


def _show_str(v: Any) -> str:
    return v if v else "(unset)"


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 0/1/true/false")


def _auto_bool(s: str) -> int:
    """auto -> -1 (C++ decides), else a boolean as 1/0."""
    if s.strip().lower() in ("auto", "-1"):
        return -1
    try:
        return int(_bool(s))
    except ValueError:
        raise ValueError("expected auto, 0/1 or true/false") from None


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(s: str) -> int:
        v = int(s.strip(), 0)
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"expected an integer in [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    return parse


def _bytes(s: str) -> int:
    t = s.strip().upper()
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix + "B") or t.endswith(suffix):
            t = t[: -len(suffix + "B")] if t.endswith(suffix + "B") else t[:-1]
            mult = m
            break
    v = int(t) * mult
    if v <= 0:
        raise ValueError("expected a positive size such as 65536, 64K or 4M")
    return v


def _stream_bytes(s: str) -> int:
    v = s.strip().lower()
    if v in ("auto", "-1"):
        return -1
    if v in ("off", "0"):
        return 0
    return _bytes(s)


def _choice(*options: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        v = s.strip().lower()
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return v

    return parse


def _debug(s: str) -> bool:
    v = s.strip().upper()
    if v in ("", "OFF", "0", "FALSE", "INFO", "WARN"):
        return False
    if v in ("DETAIL", "1", "TRUE"):
        return True
    raise ValueError("expected OFF, INFO or DETAIL")


def _str(s: str) -> str:
    return s.strip()


VARS: list[Var] = [
    Var("MYCCL_TRANSPORT", _choice("auto", "tcp", "shm"),
        "auto: shared memory between ranks of one host, TCP across hosts; tcp: TCP everywhere; "
        "shm: shared memory only (error if a peer is on another host)"),
    Var("MYCCL_SOCKET_IFNAME", _str,
        "interfaces for TCP, NCCL style: 'eth0', 'eth,ib' (prefixes), '=eth0' (exact), '^docker,lo' "
        "(exclude). Default: the interface that routes to MASTER_ADDR (loopback if all ranks share a host)", show=_show_str),
    Var("MYCCL_HOST_ID", _str,
        "overrides this process's host identity (ranks with equal identities use shared memory)", show=_show_str),
    Var("MYCCL_HIERARCHICAL", _auto_bool,
        "groups spanning hosts where some host holds several ranks: two levels, shared memory inside "
        "each host and TCP between hosts (1), every rank over TCP (0), or whichever the link measured "
        "at the group's first such op favours (auto: two levels unless the link carries a host's bytes "
        "faster than its ranks exchange them through shared memory; c10d_ext.link_model() says what "
        "was measured and chosen)", show=_show_auto_bool),
    Var("MYCCL_LINK_MBIT", _int(0),
        "groups spanning hosts, MYCCL_HIERARCHICAL=auto: each host's network link in Mbit/s, declared "
        "instead of measured (0: measure it once per group)"),
    Var("MYCCL_FLOAT32_PARTIALS", _bool,
        "groups spanning hosts, hierarchical: float16/bfloat16 all_reduce and reduce_scatter carry each "
        "host's partial sums across hosts in float32, rounded once at the end (1), or rounded to their own "
        "type first (0: half the bytes of the cross-host sums, one more rounding, still fewer than a ring's)", show=_show_bool),
    Var("MYCCL_CROSS_HOST_RING", _bool,
        "groups spanning hosts: large all_gathers (and the all-gather half of all_reduce), and large sums "
        "whose order may change (integers; floats with MYCCL_ORDERED_SUMS=0), go around a ring of ranks, "
        "each sending only to the next, so that each link carries one stream each way (1), or every rank "
        "sends to every other at once (0; integer all_reduces of 4+ ranks above 1 MiB keep their ring)", show=_show_bool),
    Var("MYCCL_ORDERED_SUMS", _bool,
        "floating-point all_reduce and reduce_scatter fold the ranks' values in rank order, the same bits "
        "whatever the algorithm and layout of the group (1), or, across hosts, large ones may go around the "
        "ring of MYCCL_CROSS_HOST_RING, folding each slice starting at another rank: every rank still gets the "
        "same bits, but not those of a rank-order sum, and float16/bfloat16 partials round at every hop (0)", show=_show_bool),
    Var("MYCCL_SPLIT_LINKS", _bool,
        "groups made by split_group (device meshes) carry their messages over the connections of the "
        "group they were split from, each on its own channel (1), or make connections of their own (0): "
        "slower to create, more sockets and threads, but a failure with a transfer in flight can never "
        "close the parent's links", show=_show_bool),
    Var("MYCCL_NUM_THREADS", _int(1, 64),
        "threads one group may use for copies and reductions, the progress thread included"),
    Var("MYCCL_DEBUG", _debug,
        "DETAIL: check every op's fingerprint (op, sizes, dtype, root) across ranks before running it", show=_show_debug),
    Var("MYCCL_TCP_EAGER_BYTES", _bytes,
        "TCP messages up to this size are sent at once; larger ones wait until the receiver is ready", show=_show_bytes),
    Var("MYCCL_LOCAL_EAGER_BYTES", _bytes,
        "point-to-point messages to a rank on this host up to this size (4 MiB at most) are sent at "
        "once through one of 4 shared-memory slots per peer (from 16 KiB, when one is free; each "
        "slot gets its pages on first use); larger ones, and those that find no free slot, are "
        "copied straight out of the sender's memory once the receiver is ready. Same on every rank", show=_show_bytes),
    Var("MYCCL_COPY_THREADS", _int(1, 16),
        "threads that copy one large message from a rank on this host (from 1 MiB); its sender is "
        "blocked meanwhile, so a second thread runs on the core the sender leaves idle (1: the "
        "receiving thread alone)"),
    Var("MYCCL_SOCKETS_PER_PEER", _int(1, 16),
        "sockets a large TCP message (from 512 KiB) to a rank on another host is spread over, each "
        "with its own thread, so several cores share the kernel's work for one stream (1: the one "
        "socket); every rank must use the same value"),
    Var("MYCCL_TCP_CHUNK_BYTES", _bytes,
        "segment size for pipelined TCP algorithms", show=_show_bytes),
    Var("MYCCL_SHM_BUFFER_BYTES", _bytes,
        "size of each of the two shared-memory staging buffers per rank (the pipeline chunk)", show=_show_bytes),
    Var("MYCCL_STREAM_STORE_BYTES", _stream_bytes,
        "results of at least this many bytes are written into the caller's tensors with streaming "
        "(cache-bypassing) stores; auto (-1): the last-level cache's size; off (0): never", show=_show_stream_bytes),
    Var("MYCCL_SPIN_US", _int(-1),
        "how long a waiting thread spins before sleeping, in microseconds (-1: adapt to ranks per core); "
        "a point-to-point wait() yields its core for that long instead (-1: 50)"),
    Var("MYCCL_FLIGHT_RECORDER", _int(0),
        "ops each group remembers for the flight recorder (0 turns it off); dumped on a timeout, "
        "a fatal error, SIGUSR1 or c10d_ext.trace.dump()"),
    Var("MYCCL_FLIGHT_RECORDER_DUMP", _str,
        "directory for flight recorder dumps (one JSON file per group and rank)", show=_show_str),
    Var("MYCCL_TRACE", _str,
        "path prefix: write a Chrome-trace timeline per rank to <prefix>.rank<R>.json at exit", cpp=False,
        python_default="", show=_show_str),
    Var("MYCCL_LOG_LEVEL", _choice("", "debug", "info", "warning", "error"),
        "sets the level of the 'c10d_ext' Python logger, to which C++ messages go; unset, the "
        "application's logging configuration decides (Python's default shows warnings and errors)",
        cpp=False, python_default="", show=_show_str),
    Var("MYCCL_HVD_RSH", _str,
        "c10d_ext.horovod.run: how to run a command on another host, a command prefix with {host} "
        "(and optionally {command}), e.g. 'ip netns exec {host}'; unset: ssh", cpp=False,
        python_default="", show=_show_str),
    Var("MYCCL_HVD_SLOTS", _str,
        "the rank table of one host's workers ('rank,size,local_rank,local_size,cross_rank,cross_size' "
        "per worker, ';' between), from which each worker's wrapper takes its HOROVOD_* variables",
        cpp=False, python_default="", show=_show_str, set_by="c10d_ext.horovod.run, for each host's agent"),
    Var("MYCCL_HVD_TAG", _str,
        "the rank a worker's output lines are tagged with ([<rank>]<stdout>:), its first rank; unset: RANK",
        cpp=False, python_default="", show=_show_str, set_by="c10d_ext.horovod.run's elastic driver, for each worker"),
    Var("MYCCL_HVD_WORKER_ID", _str,
        "the worker's name in the elastic driver, which the worker publishes in the job's store so that "
        "the driver can ask it to leave when its host does", cpp=False, python_default="", show=_show_str,
        set_by="c10d_ext.horovod.run's elastic driver, for each worker"),
    Var("MYCCL_WM_DIRECT", _bool,
        "c10d_ext.wholememory: a DISTRIBUTED tensor over CPU ranks of one host keeps each rank's part "
        "in shared memory and its gathers read rows where they lie; 0: every access is the exchange "
        "over the group, as across hosts", cpp=False, python_default=True, show=_show_bool),
    Var("MYCCL_TEST_CONNECT_DELAY_MS", _int(0),
        "testing only: pause before connecting the TCP mesh (lets tests knock on a listener)", public=False),
    Var("MYCCL_TEST_SHM_RECHECK_DELAY_MS", _int(0),
        "testing only: a shared-memory wait pauses between finding a peer behind and asking whether it "
        "is gone (opens the window in which the peer finishes and leaves)", public=False),
    Var("MYCCL_BLOCKING_WAIT", _bool,
        "CUDA: Work.wait() blocks the host and raises on timeout instead of ordering streams", show=_show_bool),
    Var("MYCCL_AVOID_RECORD_STREAMS", _bool,
        "CUDA: an asynchronous op keeps its tensors alive by holding them in its Work until the op has "
        "finished, as torch's nccl does (default); 0: recordStream on the op's stream instead", show=_show_bool),
    Var("MYCCL_HIGH_PRIORITY_STREAM", _bool,
        "CUDA: run NCCL on a high-priority stream", show=_show_bool),
    Var("MYCCL_NCCL_NONBLOCKING", _bool,
        "CUDA: nonblocking NCCL communicators: creation and every launch can be abandoned at the timeout "
        "or by abort(), at the price of host polling per op (default 0: blocking, as torch's nccl)", show=_show_bool),
    Var("MYCCL_ASYNC_ERROR_HANDLING", _int(0, 3),
        "CUDA: what a timed-out or failed op does, as TORCH_NCCL_ASYNC_ERROR_HANDLING (read when this one "
        "is unset): 3 take the process down without aborting NCCL, 1 abort NCCL then take it down, 2 abort "
        "NCCL and raise from the group's ops, 0 raise and leave NCCL alone. MYCCL_BLOCKING_WAIT=1 raises in "
        "wait() and takes nothing down"),
    Var("MYCCL_ENABLE_TIMING", _bool,
        "CUDA: record a start event per op, so Work durations are the op's time on the device", show=_show_bool),
]

# Variables that fall back to torch's own name for the same setting when ours is unset.
TORCH_FALLBACKS = {"MYCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


@dataclass(frozen=True)
class BuildVar:
    """A variable setup.py reads when it builds c10d_ext._C (not at run time)."""

    name: str
    default: str
    meaning: str


BUILD_VARS: list[BuildVar] = [
    BuildVar("MYCCL_WITH_NCCL", "auto",
             "the NCCL engine (CUDA tensors): 1 builds it and fails naming what is missing, 0 leaves it out, "
             "auto (unset) builds it when torch is a CUDA build and NCCL's header and library are found"),
    BuildVar("MYCCL_BUILD_TESTS", "0",
             "1 also builds c10d_ext._test_double, the strict CUDA/NCCL host double the tests run the CUDA "
             "engine on (scripts/setup.sh sets it for the source tree's venv; wheels leave it out)"),
    BuildVar("MYCCL_DEBUG_BUILD", "0",
             "1 compiles with debug information, without optimisation and with frame pointers"),
]

BY_NAME = {v.name: v for v in VARS}
BY_FIELD = {v.field: v for v in VARS}
GROUP_FIELDS = [v.field for v in VARS if v.cpp]
# Options fields for users: per-group variables that are not testing knobs.
OPTION_FIELDS = [v.field for v in VARS if v.cpp and v.public]
# Options' names before they followed their variables' (still accepted, with a FutureWarning).
RENAMED_FIELDS = {"split_shares_links": "split_links", "flight_recorder_entries": "flight_recorder",
                  "debug_detail": "debug"}


def _parse(var: Var, env) -> Any:
    raw = env.get(var.name)
    if raw is None and var.name in TORCH_FALLBACKS:
        raw = env.get(TORCH_FALLBACKS[var.name])
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"myccl: environment variable {var.name}={raw!r} is invalid: {e}") from None


def parse_env(environ: os._Environ | dict | None = None) -> dict[str, Any]:
    """Returns {field: value} for every variable, raising ValueError on a bad value."""
    env = os.environ if environ is None else environ
    return {var.field: _parse(var, env) for var in VARS}


def value(name: str, environ: os._Environ | dict | None = None) -> Any:
    """One variable's value (its default when unset), raising ValueError on a bad value. Reads
    only that variable: a per-process variable's default needs no ``_C``."""
    return _parse(BY_NAME[name], os.environ if environ is None else environ)


def torch_env(environ: os._Environ | dict | None = None) -> dict[str, Any]:
    """What the launcher (torchrun, or the user) says in torch's own variables that a group needs:
    MASTER_ADDR (the route TCP listeners default to) and TORCHELASTIC_RESTART_COUNT (which attempt
    of a torchrun job this is: each attempt takes its own key space in a store that outlives it)."""
    env = os.environ if environ is None else environ
    raw = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    try:
        restart = int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"myccl: TORCHELASTIC_RESTART_COUNT={raw!r} is not an integer") from None
    return {"master_addr": env.get("MASTER_ADDR", ""), "restart_count": restart}


def describe(environ: os._Environ | dict | None = None, all_vars: bool = False) -> list[tuple[str, str, str, str]]:
    """(name, value in effect, default, meaning) for every variable, values in the words users
    write ("auto", "64K", "DETAIL"); testing knobs and the launchers' variables only when set
    (or with all_vars)."""
    env = os.environ if environ is None else environ
    values = parse_env(env)
    rows = []
    for var in VARS:
        if (not var.public or var.set_by) and not all_vars and var.name not in env:
            continue
        shown = var.show(values[var.field]) + ("" if var.name in env else " (default)")
        rows.append((var.name, shown, var.show(var.default), var.meaning))
    return rows


def markdown() -> str:
    """docs/CONFIG.md: every public variable with its default and meaning."""
    lines = [
        "# Configuration",
        "",
        "Generated from `c10d_ext/config.py` by `python scripts/gen_config_doc.py`; do not edit by hand",
        "(`tests/project/test_config.py` checks that it is current).",
        "",
        "Every variable is read once per process group, when the group is made. Each is also a field of",
        "`c10d_ext.Options`, named after it without `MYCCL_` in lower case, which overrides it for one",
        "group: `dist.init_process_group(\"myccl\", pg_options=c10d_ext.Options(transport=\"tcp\"))`",
        "(`MYCCL_TRACE` and `MYCCL_LOG_LEVEL` are per process). `python -m c10d_ext.info` prints the",
        "values in effect.",
        "",
        "| variable | `Options` field | default | meaning |",
        "|---|---|---|---|",
    ]
    for var in VARS:
        if not var.public or var.set_by:
            continue
        field = f"`{var.field}`" if var.cpp else "(per process)"
        lines.append(f"| `{var.name}` | {field} | `{var.show(var.default)}` | {_cell(var.meaning)} |")
    fallbacks = ", ".join(f"`{ours}` falls back to `{theirs}`" for ours, theirs in TORCH_FALLBACKS.items())
    lines += ["", f"Where ours is unset, torch's name for the same setting is read: {fallbacks}.", ""]
    lines += [
        "## Set by the launchers",
        "",
        "`c10d_ext.horovod.run` sets these for the processes it starts; they are not for users to set.",
        "",
        "| variable | set by | meaning |",
        "|---|---|---|",
    ]
    for var in VARS:
        if var.public and var.set_by:
            lines.append(f"| `{var.name}` | {var.set_by} | {_cell(var.meaning)} |")
    lines += [
        "",
        "## Build",
        "",
        "Read by `setup.py` (and `scripts/setup.sh`) when it builds `c10d_ext._C` (`pip install`,",
        "`python setup.py build_ext`), not at run time.",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for b in BUILD_VARS:
        lines.append(f"| `{b.name}` | `{b.default}` | {_cell(b.meaning)} |")
    lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
