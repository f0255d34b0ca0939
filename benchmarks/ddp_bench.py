"""DDP step time and memory on CPU: torch's DDP on gloo (the baseline), torch's DDP on myccl, and
c10d_ext's DDP on myccl, in one run.

    python benchmarks/ddp_bench.py                      # world size 2, ~25M-parameter MLP
    python benchmarks/ddp_bench.py --layers 3 --width 1024 --steps 8   # quicker

The model is communication-heavy on purpose: wide linear layers and a small batch, so much of a
step is gradient reduction. Two phases:

- step time: one set of processes holds every configuration (its own model copy each; gloo
  through a second process group) and runs their steps round-robin, so load that comes and
  goes on a shared machine hits all of them alike. Reported: the median over the measured
  steps after warm-up, and the first three steps one by one (torch's DDP reduces everything
  in one bucket, without overlap, until it has seen an iteration; ours overlaps from the
  first step). A step is forward + backward + optimizer step, as long as its slowest rank.
- memory: each configuration alone in fresh processes. Each rank's proportional set size
  (PSS, /proc/self/smaps_rollup) is sampled after every backward and every optimizer step
  (where gradients, buckets and model coexist); reported is the largest sample of the larger
  rank, and its excess over "local (no DDP)", the same loop without DDP. PSS rather than
  RSS because myccl's buckets are shared memory that the peer also maps (it reduces straight
  out of them): RSS would count those pages in both processes, PSS splits them. Not
  tracemalloc: tensors come from torch's C++ allocator, which tracemalloc does not see. The
  peak RSS (ru_maxrss) is in the JSON too. For our DDP the bytes of gradient storage (.grad
  plus buckets) are exact as well.

Gradients are zeroed in place (zero_grad(set_to_none=False)) so they persist across steps as
in most training loops; that is where gradient_as_bucket_view saves a copy.
Prints one table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import free_port  # noqa: E402

# name -> (DDP implementation, backend, gradient_as_bucket_view)
CONFIGS = {
    "local (no DDP)": ("none", "myccl", False),
    "torch-ddp/gloo": ("torch", "gloo", False),
    "torch-ddp/myccl": ("torch", "myccl", False),
    "c10d_ext-ddp/myccl": ("ours", "myccl", False),
    "torch-ddp/myccl+view": ("torch", "myccl", True),
    "c10d_ext-ddp/myccl+view": ("ours", "myccl", True),
    # the same with the average as a separate pass (what folding it into the reduction saves)
    "c10d_ext-ddp/myccl+view-unfused": ("ours-unfused", "myccl", True),
    # without gradient_as_bucket_view, .grad in memory of its own as torch keeps it (copied into
    # the bucket and back every step) instead of slot aliases (what the aliases save)
    "c10d_ext-ddp/myccl-copy": ("ours-copy", "myccl", False),
}
BASELINE = "torch-ddp/gloo"
LOCAL = "local (no DDP)"


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 16))


def grad_storage_bytes(ddp) -> int:
    """Bytes of memory under .grad tensors and bucket buffers, each byte counted once (a .grad
    may be a view of a bucket or a tensor of its own over a bucket slot)."""
    spans = []
    for p in ddp.parameters():
        if p.grad is not None:
            s = p.grad.untyped_storage()
            spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    for b in ddp.reducer.bucket_buffers():
        if b is not None and b.numel():
            s = b.untyped_storage()
            spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    total, end = 0, 0
    for lo, hi in sorted(spans):
        lo = max(lo, end)
        if hi > lo:
            total += hi - lo
            end = hi
    return total


def setup(rank: int, size: int, port: int, args):
    os.environ.setdefault("MYCCL_LOG_LEVEL", "error")
    torch.set_num_threads(args.threads)
    import c10d_ext  # noqa: F401  (registers myccl)

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("myccl", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(args.batch, args.width, generator=g) for _ in range(4)]
    ys = [torch.randn(args.batch, 16, generator=g) for _ in range(4)]
    return xs, ys


def build(name: str, args, groups: dict):
    import c10d_ext

    impl, backend, as_view = CONFIGS[name]
    model = make_model(args.layers, args.width)
    if impl == "none":
        ddp = model
    else:
        ours = impl.startswith("ours")
        cls = c10d_ext.DistributedDataParallel if ours else torch.nn.parallel.DistributedDataParallel
        ddp = cls(model, process_group=groups[backend], gradient_as_bucket_view=as_view,
                  bucket_cap_mb=args.bucket_cap_mb)
        if impl == "ours-unfused":
            ddp.reducer.set_fused_average(False)
        if impl == "ours-copy":
            ddp.reducer.set_grad_alias(False)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4)


def step(ddp, opt, x, y) -> float:
    """Forward, backward, optimizer step; returns the seconds spent."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def time_worker(rank: int, size: int, port: int, names: list, args, queue) -> None:
    import c10d_ext

    xs, ys = setup(rank, size, port, args)
    groups = {"myccl": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    runs = {name: build(name, args, groups) for name in names}
    times = {name: [] for name in names}
    for i in range(args.warmup + args.steps):
        for name, (ddp, opt) in runs.items():
            dist.barrier()
            times[name].append(step(ddp, opt, xs[i % 4], ys[i % 4]))
    out = {}
    for name, (ddp, _) in runs.items():
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank is done
        out[name] = {"step_times_s": t.tolist()}
        if CONFIGS[name][0].startswith("ours"):
            # How much reduction was left after autograd finished (not hidden by backward).
            out[name]["exposed_reduction_ms"] = [(it["finished_us"] - it["backward_end_us"]) / 1e3
                                                 for it in ddp.bucket_stats()]
    if rank == 0:
        out["_params"] = sum(p.numel() for p in make_model(args.layers, args.width).parameters())
        out["_myccl_algorithms"] = sorted(c10d_ext.stats())
        queue.put(out)
    dist.destroy_process_group()


def memory_worker(rank: int, size: int, port: int, name: str, args, queue) -> None:
    xs, ys = setup(rank, size, port, args)
    groups = {"myccl": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    ddp, opt = build(name, args, groups)
    pss = 0
    for i in range(args.warmup + args.memory_steps):
        dist.barrier()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(xs[i % 4]), ys[i % 4]).backward()
        pss = max(pss, pss_bytes())
        opt.step()
        pss = max(pss, pss_bytes())
    mem = torch.tensor([float(pss), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    grads = grad_storage_bytes(ddp) if CONFIGS[name][0].startswith("ours") else None  # torch's buckets are not visible
    if rank == 0:
        queue.put({"peak_pss_bytes": mem[0].item(), "peak_rss_bytes": mem[1].item(), "grad_storage_bytes": grads})
    dist.destroy_process_group()


def spawn(target, extra, args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, args.world_size, port, extra, args, queue))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for p in procs:
        if p.exitcode not in (0, None):
            raise RuntimeError(f"{target.__name__}({extra}): a rank exited with {p.exitcode}")
    return result


def summarize(r: dict, warmup: int) -> dict:
    measured = r["step_times_s"][warmup:]
    r["median_step_s"] = statistics.median(measured)
    r["first_steps_s"] = r["step_times_s"][:3]
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--memory-steps", type=int, default=4, help="steps per configuration in the memory phase")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "ddp_bench.json"))
    args = ap.parse_args(argv)

    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    print(f"timing {len(names)} configurations round-robin ...", file=sys.stderr, flush=True)
    timed = spawn(time_worker, names, args)
    results = {}
    for name in names:
        print(f"memory: {name} ...", file=sys.stderr, flush=True)
        results[name] = {"config": name, "params": timed["_params"], **timed[name], **spawn(memory_worker, name, args)}
        summarize(results[name], args.warmup)
    myccl_algorithms = timed["_myccl_algorithms"]

    base = results.get(BASELINE)
    local = results.get(LOCAL)
    nparams = next(iter(results.values()))["params"]
    print(f"\nDDP on CPU, world size {args.world_size}, {nparams / 1e6:.1f}M parameters "
          f"({nparams * 4 / 2**20:.0f} MiB of fp32 gradients), batch {args.batch}, {args.threads} thread(s)/rank, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    hdr = (f"{'config':<26}{'step ms':>9}{'vs gloo':>9}{'steps 1-3 ms':>18}{'peak PSS MiB':>14}"
           f"{'vs local MiB':>14}{'grad storage MiB':>18}")
    print(hdr)
    print("-" * len(hdr))
    for name, r in results.items():
        speedup = f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base and name != LOCAL else "-"
        first = " ".join(f"{t * 1e3:.0f}" for t in r["first_steps_s"])
        extra = f"{(r['peak_pss_bytes'] - local['peak_pss_bytes']) / 2**20:+.0f}" if local else "-"
        gs = "-" if r["grad_storage_bytes"] is None else f"{r['grad_storage_bytes'] / 2**20:.0f}"
        print(f"{name:<26}{r['median_step_s'] * 1e3:>9.1f}{speedup:>9}{first:>18}"
              f"{r['peak_pss_bytes'] / 2**20:>14.0f}{extra:>14}{gs:>18}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results, "myccl_algorithms": myccl_algorithms}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
