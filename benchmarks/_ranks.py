"""The benchmarks' ranks on this host: spawned processes that meet on a free local port."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
