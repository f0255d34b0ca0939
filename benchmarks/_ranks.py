"""The benchmarks' ranks on this host: spawned processes that meet on a free local port. The port
and the environment of ranks that share a GPU are the tests' (tests/harness.py), one definition."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from harness import SHARED_GPU, free_port  # noqa: E402,F401  (the benchmarks import both from here)


def run_ranks(target, world_size: int, args, timeout: float):
    """Runs target(rank, world_size, port, args, queue) in `world_size` spawned processes and
    returns what rank 0 puts on the queue (waiting at most `timeout` seconds for it)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return result


def _from_env(rank: int, size: int, port: int, job, queue) -> None:
    worker, args = job
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    res = worker(args)
    if rank == 0:
        queue.put(res)


def run_env_ranks(worker, world_size: int, args, timeout: float):
    """run_ranks for a module-level worker(args) that starts from torchrun's variables (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE); returns rank 0's result."""
    return run_ranks(_from_env, world_size, (worker, args), timeout)


def write_json(res, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {out}")
