"""How long a 2-rank group takes to be ready for its first op when 4 ranks on one host make two of
them: myccl's split_group (on its parent's links) and new_group, next to gloo's new_group, in one
run; and what each adds per group and process (sockets, threads).

    python benchmarks/split_bench.py                 # 4 ranks, median of 5
    python benchmarks/split_bench.py --reps 9 --transport tcp

Prints one table and writes JSON (--out, default bench_out/split_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from harness import free_port  # noqa: E402
from harness import open_sockets as _sockets  # noqa: E402  (how the tests count sockets)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank, size, port, reps, transport, out):
    import c10d_ext

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("myccl", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=120),
                            pg_options=c10d_ext.Options(transport=transport))
    halves = [list(range(0, size // 2)), list(range(size // 2, size))]
    mine = rank // (size // 2)
    makers = {
        "myccl split_group": lambda: dist.split_group(split_ranks=halves),
        "myccl new_group": lambda: [dist.new_group(h) for h in halves][mine],
        "gloo new_group": lambda: [dist.new_group(h, backend="gloo") for h in halves][mine],
    }
    result = {}
    for name, make in makers.items():
        times, socks, threads = [], 0, 0
        for _ in range(reps):
            dist.barrier()
            s0, t0n = _sockets(), _threads()
            t0 = time.perf_counter()
            g = make()
            dist.all_reduce(torch.ones(1), group=g)  # ready to use
            times.append(time.perf_counter() - t0)
            socks, threads = _sockets() - s0, _threads() - t0n
        times.sort()
        result[name] = {"median_ms": times[len(times) // 2] * 1e3, "sockets": socks, "threads": threads}
    gathered = [None] * size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        out.put(gathered)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", choices=["auto", "tcp"], default="auto")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "split_bench.json"))
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args.reps, args.transport, q))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    per_rank = q.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    names = list(per_rank[0])
    # the slowest rank's median: a group is ready when its last member is
    rows = {n: {"median_ms": max(r[n]["median_ms"] for r in per_rank),
                "sockets": max(r[n]["sockets"] for r in per_rank),
                "threads": max(r[n]["threads"] for r in per_rank)} for n in names}
    print(f"a {args.world_size // 2}-rank group at {args.world_size} ranks on one host, transport {args.transport}, "
          f"median of {args.reps} (slowest rank)")
    print(f"{'group':20} {'ready in (ms)':>14} {'sockets':>8} {'threads':>8}")
    for n, r in rows.items():
        print(f"{n:20} {r['median_ms']:14.1f} {r['sockets']:+8d} {r['threads']:+8d}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows, "per_rank": per_rank}, f, indent=1)
    print("json:", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
