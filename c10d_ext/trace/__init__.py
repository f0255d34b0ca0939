"""Timeline and flight recorder.

Timeline: ``MYCCL_TRACE=/path/prefix`` (or ``trace.start(prefix)`` ... ``trace.stop()``) writes,
per rank, ``<prefix>.rank<R>.json``: a Chrome trace (Perfetto, chrome://tracing) with one event
per op (group, sequence number, op, dtype, bytes, algorithm, transport, queued/started/finished
times) plus whatever ``trace.complete()`` adds (our DDP's bucket events).

    python -m c10d_ext.trace merge prefix.rank*.json -o merged.json   # one time axis
    python -m c10d_ext.trace analyze /tmp/myccl_flight_recorder       # who is stuck where

Flight recorder: every group keeps its last ``MYCCL_FLIGHT_RECORDER`` ops; they are dumped to
``MYCCL_FLIGHT_RECORDER_DUMP`` on a timeout, a fatal error, SIGUSR1, or ``trace.dump()``.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import sys
import threading
from collections import defaultdict
from typing import Any

_lock = threading.Lock()
_prefix: str | None = None
_py_events: list[dict] = []
_atexit_registered = False


def _C():
    from .. import _C as c

    return c


def start(prefix: str) -> None:
    """Starts recording every op of every myccl group in this process."""
    global _prefix, _atexit_registered
    with _lock:
        _prefix = prefix
        _py_events.clear()
        if not _atexit_registered:
            atexit.register(_stop_at_exit)
            _atexit_registered = True
    _C().set_tracing(True)


def active() -> bool:
    return _prefix is not None


def now_us() -> int:
    return _C().now_us()


def complete(name: str, start_us: int, end_us: int, category: str = "myccl", track: str = "python",
             **args: Any) -> None:
    """Adds one finished span to the timeline (no-op unless tracing)."""
    if _prefix is None:
        return
    with _lock:
        _py_events.append({"name": name, "cat": category, "ph": "X", "ts": start_us,
                           "dur": max(0, end_us - start_us), "track": track, "args": args})


def instant(name: str, category: str = "myccl", track: str = "python", **args: Any) -> None:
    if _prefix is None:
        return
    with _lock:
        _py_events.append({"name": name, "cat": category, "ph": "i", "s": "t", "ts": now_us(),
                           "track": track, "args": args})


def _rank_hint(drained) -> int:
    for key in ("RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    for _group, rank, _events in drained:
        return rank
    return os.getpid()


def chrome_trace(drained, py_events, rank: int) -> dict:
    """Builds the Chrome trace dict from drained records (group, group rank, records)."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
    tids: dict[str, int] = {}

    def tid(track: str) -> int:
        if track not in tids:
            tids[track] = len(tids) + 1
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tids[track], "args": {"name": track}})
        return tids[track]

    for group, group_rank, records in drained:
        t = tid(f"group {group}")
        for r in records:
            start = r["started_us"] or r["queued_us"]
            events.append({
                "name": r["op"] if not r["p2p"] else r["op"].split(" ")[0],
                "cat": "myccl",
                "ph": "X",
                "ts": start,
                "dur": max(0, r["ended_us"] - start),
                "pid": rank,
                "tid": t,
                "args": {"group": group, "group_rank": group_rank, "seq": r["seq"], "op": r["op"],
                         "dtype": r["dtype"], "shape": r["shape"], "bytes": r["bytes"], "root": r["root"],
                         "redop": r["redop"], "algorithm": r["algorithm"], "transport": r["transport"],
                         "state": r["state"], "queued_us": r["queued_us"], "queue_wait_us": start - r["queued_us"],
                         "error": r["error"]},
            })
    for e in py_events:
        e = dict(e)
        e["pid"] = rank
        e["tid"] = tid(e.pop("track"))
        events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"rank": rank, "clock": "CLOCK_REALTIME microseconds", "producer": "c10d_ext"}}


def stop(path: str | None = None) -> str | None:
    """Stops tracing and writes this rank's Chrome trace; returns its path."""
    global _prefix
    with _lock:
        prefix, _prefix = _prefix, None
        py_events = list(_py_events)
        _py_events.clear()
    if prefix is None:
        return None
    c = _C()
    c.set_tracing(False)
    drained = c.drain_trace()
    rank = _rank_hint(drained)
    path = path or f"{prefix}.rank{rank}.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(drained, py_events, rank), f)
    return path


def _stop_at_exit() -> None:
    try:
        stop()
    except Exception as e:  # noqa: BLE001 - never fail interpreter exit
        print(f"c10d_ext.trace: could not write the trace: {e}", file=sys.stderr)


def dump(dir: str | None = None, reason: str = "requested") -> list[str]:
    """Writes the flight recorder of every myccl group of this process now (to `dir`, or to
    each group's MYCCL_FLIGHT_RECORDER_DUMP directory); returns the paths."""
    return list(_C().dump_all_flight_recorders(dir or "", reason))


# ---- merge ----------------------------------------------------------------------------------

def merge(paths: list[str], out: str) -> dict:
    """One trace with every rank on the same (wall clock) time axis, one process per rank."""
    merged: list[dict] = []
    ranks = []
    for p in sorted(paths):
        with open(p) as f:
            t = json.load(f)
        ranks.append(t.get("otherData", {}).get("rank"))
        merged.extend(t["traceEvents"])
    result = {"traceEvents": merged, "displayTimeUnit": "ms", "otherData": {"ranks": ranks, "merged_from": paths}}
    with open(out, "w") as f:
        json.dump(result, f)
    return result


# ---- analyze --------------------------------------------------------------------------------

def _signature(e: dict) -> tuple:
    return (e["op"], e["dtype"], e["bytes"], e["root"], e["redop"])


def analyze(paths_or_dir: list[str]) -> str:
    """Reads flight recorder dumps of all ranks and explains what went wrong."""
    files: list[str] = []
    for p in paths_or_dir:
        files.extend(sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p])
    if not files:
        return "no flight recorder dumps found"
    groups: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in files:
        with open(path) as f:
            d = json.load(f)
        prev = groups[d["group"]].get(d["rank"])
        if prev is None or d.get("dumped_us", 0) > prev.get("dumped_us", 0):
            groups[d["group"]][d["rank"]] = d
    lines: list[str] = []
    for group, by_rank in sorted(groups.items()):
        world = max(d["world_size"] for d in by_rank.values())
        lines.append(f"group {group!r}: {world} ranks, dumps from ranks {sorted(by_rank)}")
        missing = sorted(set(range(world)) - set(by_rank))
        if missing:
            lines.append(f"  no dump from ranks {missing} (dead, or never reached a dump point)")
        colls = {r: [e for e in d["entries"] if not e["p2p"]] for r, d in by_rank.items()}
        done = {r: max([e["seq"] for e in es if e["state"] == "completed"] or [0]) for r, es in colls.items()}
        lead = max(done.values()) if done else 0
        behind = sorted(r for r, s in done.items() if s < lead)
        lines.append(f"  last completed collective per rank: " + ", ".join(f"{r}: #{done[r]}" for r in sorted(done)))
        if behind:
            lines.append(f"  ranks behind: {behind} (others completed up to #{lead})")
        issued = {r: max([e["seq"] for e in es] or [0]) for r, es in colls.items()}
        furthest = max(issued.values()) if issued else 0
        for r in sorted(colls):
            if issued[r] < furthest:
                last = max(colls[r], key=lambda e: e["seq"]) if colls[r] else None
                lines.append(f"  rank {r} never called #{issued[r] + 1} (others are at #{furthest}); its last op: "
                             + (f"{last['op']} #{last['seq']} ({last['state']})" if last else "none")
                             + " -- it is busy outside myccl, stuck in another group, or called fewer collectives")
        for r in sorted(colls):
            pending = [e for e in colls[r] if e["state"] in ("queued", "started", "failed")]
            if pending:
                e = pending[0]
                lines.append(f"  rank {r} is stuck in {e['op']} #{e['seq']} ({e['state']}; {e['dtype']} "
                             f"{e['shape']}, {e['bytes']} bytes{', root ' + str(e['root']) if e['root'] >= 0 else ''})"
                             + (f": {e['error'][:200]}" if e["error"] else ""))
        # Same sequence number, different call: somebody called something else.
        by_seq: dict[int, dict[int, dict]] = defaultdict(dict)
        for r, es in colls.items():
            for e in es:
                by_seq[e["seq"]][r] = e
        for seq in sorted(by_seq):
            sigs = defaultdict(list)
            for r, e in by_seq[seq].items():
                sigs[_signature(e)].append(r)
            if len(sigs) > 1:
                desc = "; ".join(f"ranks {rs} called {s[0]} ({s[1]}, {s[2]} bytes"
                                 + (f", root {s[3]}" if s[3] >= 0 else "") + (f", {s[4]}" if s[4] else "") + ")"
                                 for s, rs in sorted(sigs.items(), key=lambda kv: kv[1]))
                lines.append(f"  MISMATCH at #{seq}: {desc}")
                break
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m c10d_ext.trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge per-rank traces onto one time axis")
    m.add_argument("paths", nargs="+")
    m.add_argument("-o", "--out", default="myccl_trace_merged.json")
    a = sub.add_parser("analyze", help="read flight recorder dumps and say who is stuck where")
    a.add_argument("paths", nargs="+", help="dump files or directories")
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        res = merge(args.paths, args.out)
        print(f"merged {len(args.paths)} traces ({len(res['traceEvents'])} events) into {args.out}")
    else:
        print(analyze(args.paths))
    return 0


