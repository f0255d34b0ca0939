"""What the Horovod layer's lockstep costs (docs/HOROVOD.md, "Cost"): the same ops at 3 ranks
without process sets (the engine loop is free: a synchronous op runs its own cycle) and with a
second set of two members (the loop runs every set in lockstep, one cycle of each per iteration at
HOROVOD_CYCLE_TIME), each beside dist.all_reduce on a myccl group of the same ranks.

    python benchmarks/hvd_lockstep.py [--ranks 3] [--out bench_out/hvd_lockstep.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_env_ranks, write_json  # noqa: E402

ROUNDS, OPS = 5, 100


def _per_op_us(fn) -> float:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(OPS):
            fn()
        times.append((time.perf_counter() - t0) / OPS * 1e6)
    return statistics.median(times)


def _async_ms(hvd, torch) -> float:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        hs = [hvd.allreduce_async(torch.ones(64), name=f"a{i}") for i in range(OPS)]
        for h in hs:
            hvd.synchronize(h)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def worker(with_set: bool) -> dict:
    import torch
    import torch.distributed as dist

    import c10d_ext.horovod as hvd
    from c10d_ext.horovod import loop

    os.environ["LOCAL_RANK"] = os.environ["RANK"]
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["WORLD_SIZE"]
    hvd.init(process_sets=[hvd.ProcessSet([0, 1])] if with_set else None)
    # The baseline on a group of its own: the loop's cycles (heartbeats, lockstep iterations) run on
    # Horovod's groups at any time, and a job's own collectives never do.
    own = dist.new_group(list(range(hvd.size())), backend="myccl")
    try:
        t = torch.ones(2)
        for _ in range(20):
            hvd.allreduce(t, name="warm")
        return {"lockstep": loop._LOOP[0].lockstep,
                "hvd_allreduce_us": _per_op_us(lambda: hvd.allreduce(t, name="x")),
                "dist_all_reduce_us": _per_op_us(lambda: dist.all_reduce(t, group=own)),
                "allreduce_async_x100_ms": _async_ms(hvd, torch)}
    finally:
        hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--out", default="bench_out/hvd_lockstep.json")
    args = ap.parse_args()
    rows = {}
    for label, with_set in (("free (no process sets)", False), ("lockstep (a set of ranks 0, 1)", True)):
        rows[label] = run_env_ranks(worker, args.ranks, with_set, timeout=600)
    print(f"c10d_ext.horovod, {args.ranks} ranks, free vs lockstep engine loop (medians of {ROUNDS} rounds of {OPS})")
    print(f"{'loop':34} {'hvd.allreduce 8 B us':>21} {'dist.all_reduce us':>19} {'100 async+sync ms':>18}")
    for label, r in rows.items():
        print(f"{label:34} {r['hvd_allreduce_us']:21.1f} {r['dist_all_reduce_us']:19.1f} "
              f"{r['allreduce_async_x100_ms']:18.2f}")
    write_json({"ranks": args.ranks, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
