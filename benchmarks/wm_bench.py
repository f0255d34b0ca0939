"""Random-row gather from whole-memory tensors, every kind against its limit and its baseline, in
one run:

- ``index_select`` on a private local copy of the whole table: the limit for the kinds that read
  shared memory in place (HOST, CHUNKED, and on one host DISTRIBUTED's direct path, where each
  rank's part lies in shared memory and a gather reads the rows where they lie);
- the same lookup done by hand on gloo (counts, indices and rows through
  ``dist.all_to_all_single`` on a gloo group, each rank holding its part): the baseline for
  DISTRIBUTED's exchange, which makes the same three exchanges over myccl (the path across
  hosts, and on one host with MYCCL_WM_DIRECT=0). Each path is its own row: the direct path is
  compared with the private copy, the exchange with gloo's.

Every rank fetches its own random rows (uniform over the table, repeats allowed) of 512 B and
4 KiB, 1-64 MiB per call; reported is the median over rounds of rank 0's fetched bytes per second,
configurations taking turns inside each round so that load on a shared machine hits all alike.
Each result is checked once against the private copy.

    python benchmarks/wm_bench.py                       # 2 ranks on this host
    python benchmarks/wm_bench.py --world-size 4 --table 512M
    sudo python benchmarks/wm_bench.py --hosts 2 --link-rate 1gbit   # namespace hosts, capped links

Across hosts (network namespaces, tests/netns.py; needs root) the mapped kinds are per host (HOST
only: CHUNKED cannot span hosts) and every DISTRIBUTED row is given its link fraction: the least
time the bytes that must cross one host's link could take at the measured TCP rate, over the
measured time. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from _ranks import run_env_ranks, write_json  # noqa: E402


def _bytes(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def _fmt(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else f"{n}B"


def gloo_lookup(group, part: torch.Tensor, first_of: list[int], per: int, idx: torch.Tensor) -> torch.Tensor:
    """The baseline: a by-hand distributed lookup on gloo (counts, indices, rows)."""
    n = dist.get_world_size(group)
    owner = torch.div(idx, per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=n)
    recv_counts = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    ids = torch.empty(sum(recvs), dtype=torch.int64)
    dist.all_to_all_single(ids, idx[order], recvs, sends, group=group)
    rows = part.index_select(0, ids - first_of[dist.get_rank(group)])
    got = torch.empty((sum(sends),) + tuple(part.shape[1:]), dtype=part.dtype)
    dist.all_to_all_single(got, rows, sends, recvs, group=group)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return got.index_select(0, inverse)


def worker(args) -> dict:
    import c10d_ext
    import c10d_ext.wholememory as wm

    torch.set_num_threads(1)
    dist.init_process_group("myccl", timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    hosts = c10d_ext.cross_size()
    kinds = ["HOST", "CHUNKED", "DISTRIBUTED"] if hosts == 1 else ["HOST", "DISTRIBUTED"]
    results = []
    for row_bytes in args.row_bytes:
        dim = row_bytes // 4
        rows = args.table // row_bytes
        table = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))  # every rank: the same
        tensors = {}
        for k in kinds:
            t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, getattr(wm.WmTensorType, k))
            part, first = wm.local_partition(t)
            part.copy_(table[first:first + part.shape[0]])
            tensors[k] = t
        if hosts == 1:  # DISTRIBUTED's two paths apart: reading parts in place, and the exchange
            tensors["DISTRIBUTED direct"] = tensors.pop("DISTRIBUTED")
            os.environ["MYCCL_WM_DIRECT"] = "0"  # (read when a tensor is made, the same on every rank)
            try:
                t = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
            finally:
                del os.environ["MYCCL_WM_DIRECT"]
            part, first = wm.local_partition(t)
            part.copy_(table[first:first + part.shape[0]])
            tensors["DISTRIBUTED exchange"] = t
        else:
            tensors["DISTRIBUTED exchange"] = tensors.pop("DISTRIBUTED")
        parts = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED)._meta.parts
        per = parts[0][1]
        gpart = table[parts[rank][0]:parts[rank][0] + parts[rank][1]].clone()
        dist.barrier()
        for fetch in args.fetch:
            n = fetch // row_bytes
            idx = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(10 + rank))
            want = table.index_select(0, idx)
            configs = {"index_select (private copy)": lambda: table.index_select(0, idx)}
            for k, t in tensors.items():
                configs[f"{k} gather"] = (lambda t=t: wm.gather(t, idx))
            configs["gloo lookup (by hand)"] = lambda: gloo_lookup(gloo, gpart, [p[0] for p in parts], per, idx)
            times: dict[str, list[float]] = {c: [] for c in configs}
            for name, fn in configs.items():  # warm up and check once
                if not torch.equal(fn(), want):
                    raise AssertionError(f"{name}: wrong rows (rank {rank})")
            for _ in range(args.rounds):
                for name, fn in configs.items():
                    dist.barrier(group=gloo)
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        fn()
                    times[name].append((time.perf_counter() - t0) / args.reps)
            for name, ts in times.items():
                med = statistics.median(ts)
                results.append({"row_bytes": row_bytes, "fetch": fetch, "config": name, "time_s": med,
                                "gbps": fetch / med / 1e9})
        del tensors
        dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "size": size, "hosts": hosts, "results": results}


def report(res: dict, out: str, rate: float | None) -> None:
    rows = res["results"]
    by = {}
    for r in rows:
        by.setdefault((r["row_bytes"], r["fetch"]), {})[r["config"]] = r
    configs = list(dict.fromkeys(r["config"] for r in rows))
    print(f"\nrandom-row gather, {res['size']} ranks on {res['hosts']} host(s); GB/s of rows fetched per rank "
          "(median over rounds, rank 0)")
    head = f"{'row':>5} {'fetch':>6} | " + " | ".join(f"{c[:22]:>22}" for c in configs)
    direct = "DISTRIBUTED direct gather" in configs
    head += " | HOST/index_select" + (" | DISTR. direct/index_select" if direct else "") + " | DISTR. exchange/gloo"
    if rate:
        head += " | link fraction"
    print(head)
    for (rb, fetch), d in sorted(by.items()):
        line = f"{_fmt(rb):>5} {_fmt(fetch):>6} | " + " | ".join(f"{d[c]['gbps']:22.3f}" for c in configs)
        limit = d["index_select (private copy)"]["gbps"]
        host = d["HOST gather"]["gbps"] / limit
        d["HOST gather"]["vs_limit"] = host
        line += f" | {host:17.2f}"
        if direct:
            d["DISTRIBUTED direct gather"]["vs_limit"] = ratio = d["DISTRIBUTED direct gather"]["gbps"] / limit
            line += f" | {ratio:27.2f}"
        exchange = d["DISTRIBUTED exchange gather"]["gbps"] / d["gloo lookup (by hand)"]["gbps"]
        d["DISTRIBUTED exchange gather"]["vs_gloo"] = exchange
        line += f" | {exchange:20.2f}"
        if rate:
            h, l = res["hosts"], res["size"] // res["hosts"]
            remote = l * fetch * (h - 1) / h  # row bytes into one host per call, as many out
            frac = remote / rate / d["DISTRIBUTED exchange gather"]["time_s"]
            d["DISTRIBUTED exchange gather"]["link_fraction"] = frac
            line += f" | {frac:13.2f}"
        print(line)
    res["link_rate_bytes_per_s"] = rate
    write_json(res, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--table", type=_bytes, default=_bytes("256M"), help="bytes of the whole table")
    ap.add_argument("--row-bytes", default="512,4K")
    ap.add_argument("--fetch", default="1M,4M,16M,64M", help="bytes each rank fetches per call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hosts", type=int, default=1, help=">1: network-namespace hosts (root)")
    ap.add_argument("--link-rate", default=None, help="with --hosts: cap every link (tc syntax, e.g. 1gbit)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.row_bytes = [_bytes(x) for x in args.row_bytes.split(",")]
    args.fetch = [_bytes(x) for x in args.fetch.split(",")]
    out = args.out or os.path.join(ROOT, "bench_out", f"wm_bench_{args.hosts}hosts_{args.world_size}ranks.json")
    if args.worker:  # under torchrun, across namespace hosts
        res = worker(args)
        if res["rank"] == 0:
            with open(out + ".part", "w") as f:
                json.dump(res, f)
        return
    if args.hosts > 1:
        res, rate = _multihost(args, out)
        report(res, out, rate)
        return
    report(run_env_ranks(worker, args.world_size, args, timeout=3600), out, None)


def _multihost(args, out):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import netns
    from multihost_bench import tcp_rate

    ok, why = netns.available()
    if not ok:
        sys.exit(f"wm_bench: {why}")
    nproc = max(1, args.world_size // args.hosts)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MYCCL_SOCKET_IFNAME", None)
    port = 29300 + os.getpid() % 500
    run_id = uuid.uuid4().hex[:8]
    passthrough = ["--table", str(args.table), "--row-bytes", ",".join(map(str, args.row_bytes)),
                   "--fetch", ",".join(map(str, args.fetch)), "--rounds", str(args.rounds), "--reps", str(args.reps),
                   "--out", out, "--worker"]
    with netns.Hosts(args.hosts) as hosts:
        rate = None
        if args.link_rate:
            hosts.cap(args.link_rate)
            rate = max(tcp_rate(hosts, env, 1), tcp_rate(hosts, env, 4))
            print(f"links capped at {args.link_rate}: raw TCP {rate / 1e6:.1f} MB/s", flush=True)
        procs = []
        for i in range(hosts.n):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.n), "--nproc-per-node",
                   str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}",
                   "--rdzv-id", run_id, "--max-restarts", "0", "--local-addr", hosts.addrs[i]]
            if i == 0:
                cmd += ["--rdzv-conf", "is_host=1"]
            cmd += [os.path.abspath(__file__)] + passthrough
            host_env = dict(env, GLOO_SOCKET_IFNAME=hosts.devs[i])
            procs.append(hosts.popen(i, cmd, host_env, start_new_session=True,
                                     stdout=None if i == 0 else subprocess.DEVNULL))
        rc = [p.wait(timeout=3600) for p in procs]
    if any(rc):
        sys.exit(f"wm_bench: torchrun exit codes {rc}")
    with open(out + ".part") as f:
        res = json.load(f)
    os.remove(out + ".part")
    return res, rate


if __name__ == "__main__":
    main()
