"""What c10d_ext.horovod costs over torch.distributed on the same myccl group, in one run, with
gloo measured beside it as the baseline:

1. per op: ``hvd.allreduce`` of 8 bytes against ``dist.all_reduce`` of the same tensor on the
   group Horovod's global set runs on (and on a gloo group);
2. many small tensors: 100 tensors of 64 floats through one ``grouped_allreduce``, through 100
   ``allreduce_async`` + ``synchronize`` (tensor fusion), and through 100 ``dist.all_reduce``;
3. a training step: ``hvd.DistributedOptimizer`` against ``c10d_ext.DistributedDataParallel`` and
   torch's DDP (on myccl and on gloo), the same MLP and data.

Configurations run round-robin inside the same processes, so load that comes and goes on a shared
machine hits all of them alike; reported are medians over the rounds.

    python benchmarks/hvd_bench.py                 # 2 ranks
    python benchmarks/hvd_bench.py --world-size 4 --rounds 5
    python benchmarks/hvd_bench.py --transport tcp    # every group over TCP, as across hosts

Prints one table per part and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from _ranks import run_ranks  # noqa: E402


def _timed(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))


def worker(rank: int, size: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    if args.transport:
        os.environ["MYCCL_TRANSPORT"] = args.transport
    torch.set_num_threads(1)
    import c10d_ext
    import c10d_ext.horovod as hvd
    from c10d_ext.horovod.basics import STATE

    from c10d_ext.horovod import controller

    dist.init_process_group("myccl", timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    # This benchmark runs torch.distributed's own collectives on Horovod's group and turns the
    # set's one-step path off and on between two ops on every rank: no heartbeat cycle of the
    # idle set may run on that group meanwhile (a job's code never reaches the group).
    controller.HEARTBEAT_SECONDS = float("inf")
    hvd.init()
    group = STATE.group
    out: dict = {"op": {}, "many": {}, "step": {}}

    # 1. per op, 8 bytes; also without the one-step agreed op (its key in the negotiation's
    # message, as across hosts), and negotiated as a request, as before either existed (every
    # rank turns them off and back between the same two ops, so their cycles stay in step)
    x = torch.ones(2)
    ctrl = controller._CONTROLLERS[0]

    def without_agreed_op(name="lat3", hold=True):
        was, ctrl.agreed_ok = ctrl.agreed_ok, False
        if not hold:
            ctrl.held.accepting = False  # (the cycle's end turns it on again)
        try:
            hvd.allreduce(x, name=name, op=hvd.Sum)
        finally:
            ctrl.agreed_ok = was

    ops = {
        "dist.all_reduce (myccl)": lambda: dist.all_reduce(x, group=group),
        "hvd.allreduce (myccl)": lambda: hvd.allreduce(x, name="lat", op=hvd.Sum),
        "hvd.allreduce, key negotiated (myccl)": without_agreed_op,
        "hvd.allreduce, negotiated (myccl)": lambda: without_agreed_op("lat2", hold=False),
        "dist.all_reduce (gloo)": lambda: dist.all_reduce(x, group=gloo),
    }
    # 2. 100 small tensors
    ts = [torch.ones(64) for _ in range(100)]

    def fused_async():
        hs = [hvd.allreduce_async(t, name=f"m{i}", op=hvd.Sum) for i, t in enumerate(ts)]
        for h in hs:
            hvd.synchronize(h)

    many = {
        "dist.all_reduce x100 (myccl)": lambda: [dist.all_reduce(t, group=group) for t in ts],
        "hvd.grouped_allreduce (myccl)": lambda: hvd.grouped_allreduce(ts, name="g", op=hvd.Sum),
        "hvd.allreduce_async x100 (myccl)": fused_async,
        "dist.all_reduce x100 (gloo)": lambda: [dist.all_reduce(t, group=gloo) for t in ts],
    }
    # 3. training step
    data = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    target = torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(rank + 100))
    steps = {}

    def make(kind):
        m = _model(args.width, args.layers)
        if kind == "hvd":
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            return m, opt
        if kind == "ours":
            m = c10d_ext.DistributedDataParallel(m)
        elif kind == "torch-myccl":
            m = torch.nn.parallel.DistributedDataParallel(m)
        elif kind == "torch-gloo":
            m = torch.nn.parallel.DistributedDataParallel(m, process_group=gloo)
        return m, torch.optim.SGD(m.parameters(), lr=0.01)

    for name, kind in [("hvd.DistributedOptimizer (myccl)", "hvd"), ("c10d_ext DDP (myccl)", "ours"),
                       ("torch DDP (myccl)", "torch-myccl"), ("torch DDP (gloo)", "torch-gloo")]:
        m, opt = make(kind)

        def step(m=m, opt=opt):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(data), target).backward()
            opt.step()
        steps[name] = step

    for part, table, reps in (("op", ops, args.op_reps), ("many", many, args.many_reps), ("step", steps, args.step_reps)):
        for fn in table.values():  # warm-up: connections, buffers, DDP's first iterations
            for _ in range(3):
                fn()
        for name in table:
            out[part][name] = []
        for _ in range(args.rounds):
            for name, fn in table.items():
                dist.barrier(group=gloo)
                t = _timed(fn, reps)
                slowest = torch.tensor([t])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
                out[part][name].append(slowest.item())
    hvd.shutdown()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--op-reps", type=int, default=300)
    ap.add_argument("--many-reps", type=int, default=10)
    ap.add_argument("--step-reps", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--transport", choices=["auto", "tcp", "shm"], default=None,
                    help="MYCCL_TRANSPORT for every group (tcp: no shared memory, as across hosts)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "hvd_bench.json"))
    args = ap.parse_args(argv)
    out = run_ranks(worker, args.world_size, args, timeout=1800)
    med = {part: {k: statistics.median(v) for k, v in tbl.items()} for part, tbl in out.items()}
    how = f", transport {args.transport}" if args.transport else ""
    print(f"c10d_ext.horovod vs torch.distributed, {args.world_size} ranks{how}, medians of {args.rounds} rounds")
    print(f"\n{'per op (8 B)':40s} {'us':>10s}")
    for k, v in med["op"].items():
        print(f"{k:40s} {v * 1e6:10.1f}")
    extra = (med["op"]["hvd.allreduce (myccl)"] - med["op"]["dist.all_reduce (myccl)"]) * 1e6
    print(f"{'hvd.allreduce - dist.all_reduce':40s} {extra:10.1f}")
    slow = (med["op"]["hvd.allreduce, negotiated (myccl)"] - med["op"]["dist.all_reduce (myccl)"]) * 1e6
    print(f"{'  the same, negotiated':40s} {slow:10.1f}")
    base = med["many"]["dist.all_reduce x100 (myccl)"]
    print(f"\n{'100 tensors of 64 floats':40s} {'ms':>10s} {'x faster':>9s}")
    for k, v in med["many"].items():
        print(f"{k:40s} {v * 1e3:10.2f} {base / v:9.2f}")
    ref = med["step"]["c10d_ext DDP (myccl)"]
    print(f"\n{'training step (%dx%d MLP, batch %d)' % (args.layers, args.width, args.batch):40s} {'ms':>10s} {'vs ours':>9s}")
    for k, v in med["step"].items():
        print(f"{k:40s} {v * 1e3:10.2f} {v / ref:9.3f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "samples": out, "medians": med,
                   "hvd_extra_us": extra, "hvd_negotiated_extra_us": slow, "torch": torch.__version__}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
