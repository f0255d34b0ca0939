"""DDP training on CUDA: torch's DistributedDataParallel over "nccl" (the baseline), the same over
"myccl", and c10d_ext's own DistributedDataParallel over "myccl", in one run, from one model,
one seed and the same data.

    python benchmarks/ddp_cuda.py                       # world size 2 (sharing one GPU if need be)
    python benchmarks/ddp_cuda.py --steps 20 --width 4096 --out bench_out/ddp_cuda.json

Every configuration holds its own copy of the model and their steps run round-robin, so load
that comes and goes hits all alike. A step is forward + backward + optimizer step, closed by
torch.cuda.synchronize() and as long as its slowest rank; reported is the median after warm-up.
All start from the same parameters and see the same batches, and DDP averages the same
gradients, so every configuration must follow the baseline's losses and end with its parameters
(up to the order of float additions: --rtol); and every rank must hold the same parameters.
A configuration that refuses CUDA modules is reported as "not supported" with its reason,
which is not a failure. Prints one table, writes JSON; exits 1 if a supported configuration
drifts from the baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from collbench import cuda_problem, free_port, share_gpus  # noqa: E402

# name -> (DDP implementation, backend)
CONFIGS = {
    "torch-ddp/nccl": ("torch", "nccl"),
    "torch-ddp/myccl": ("torch", "myccl"),
    "c10d_ext-ddp/myccl": ("ours", "myccl"),
}
BASELINE = "torch-ddp/nccl"


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 16))


def build(name: str, base: torch.nn.Module, dev, groups: dict, args):
    """(ddp, optimizer), or the reason the implementation refuses this module."""
    import c10d_ext

    impl, backend = CONFIGS[name]
    cls = c10d_ext.DistributedDataParallel if impl == "ours" else torch.nn.parallel.DistributedDataParallel
    try:
        ddp = cls(copy.deepcopy(base), device_ids=[dev], process_group=groups[backend],
                  bucket_cap_mb=args.bucket_cap_mb)
    except (NotImplementedError, ValueError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr)), None


def step(ddp, opt, x, y) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, loss.detach()


def worker(rank: int, world: int, port: int, names: list, args, out_queue) -> None:
    os.environ.setdefault("MYCCL_LOG_LEVEL", "error")
    shared = share_gpus(rank, world)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    import c10d_ext  # noqa: F401  (registers myccl)

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("myccl", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    groups = {"myccl": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    ref = groups["nccl"]
    base = make_model(args.layers, args.width).to(dev)
    g = torch.Generator().manual_seed(1000 + rank)
    xs = [torch.randn(args.batch, args.width, generator=g).to(dev) for _ in range(4)]
    ys = [torch.randn(args.batch, 16, generator=g).to(dev) for _ in range(4)]

    runs, refused = {}, {}
    for name in names:
        run, why = build(name, base, dev, groups, args)
        # every rank keeps a configuration only if every rank could build it
        flag = torch.tensor([0.0 if why is None else 1.0], device=dev)
        dist.all_reduce(flag, group=ref)
        if flag.item() == 0:
            runs[name] = run
        else:
            refused[name] = why or "refused on another rank"
    times = {name: [] for name in runs}
    losses = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, (ddp, opt) in runs.items():
            dist.barrier(group=ref)
            t, loss = step(ddp, opt, xs[i % 4], ys[i % 4])
            times[name].append(t)
            losses[name].append(loss)

    out = {}
    base_params = None
    if BASELINE in runs:
        base_params = torch.cat([p.detach().flatten() for p in runs[BASELINE][0].parameters()])
    for name, (ddp, _) in runs.items():
        t = torch.tensor(times[name], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ref)  # a step ends when its slowest rank is done
        loss = torch.stack(losses[name]).double()
        dist.all_reduce(loss, group=ref)
        params = torch.cat([p.detach().flatten() for p in ddp.parameters()])
        hi, lo = params.clone(), params.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=ref)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=ref)
        diff = torch.zeros(2, dtype=torch.float64, device=dev)
        if base_params is not None:
            d = (params - base_params).abs()
            diff[0] = d.max()
            tol = args.atol + args.rtol * base_params.abs()
            diff[1] = (d > tol).sum()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=ref)
        out[name] = {"step_times_s": t.tolist(), "losses": (loss / world).tolist(),
                     "replicas_max_diff": (hi - lo).abs().max().item(),
                     "max_param_diff": diff[0].item() if base_params is not None else None,
                     "params_out_of_tol": int(diff[1].item()) if base_params is not None else None}
    if rank == 0:
        out_queue.put({"runs": out, "refused": refused, "shared_gpu": shared,
                       "params": sum(p.numel() for p in base.parameters()),
                       "gpu": torch.cuda.get_device_name(dev), "gpus": torch.cuda.device_count()})
    dist.destroy_process_group()


def spawn(args, names: list) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args.world_size, port, names, args, q)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    result = None
    while result is None:  # a rank that dies or hangs must end the run, not hang it
        try:
            result = q.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"rank(s) {dead} failed" if dead else f"no result within {args.timeout:.0f} s"
                sys.exit(f"ddp_cuda: {why}")
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return result


def summarize(result: dict, args) -> dict:
    runs = result["runs"]
    base = runs.get(BASELINE)
    base_med = statistics.median(base["step_times_s"][args.warmup:]) if base else None
    rows = {}
    for name in CONFIGS:
        if name in result["refused"]:
            rows[name] = {"config": name, "supported": False, "reason": result["refused"][name]}
            continue
        if name not in runs:
            continue
        r = dict(runs[name], config=name, supported=True)
        r["median_step_s"] = statistics.median(r["step_times_s"][args.warmup:])
        r["first_steps_s"] = r["step_times_s"][:3]
        if base is not None and name != BASELINE:
            r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
            losses_ok = all(abs(a - b) <= args.atol + args.rtol * abs(b) for a, b in zip(r["losses"], base["losses"]))
            r["matches_baseline"] = losses_ok and r["params_out_of_tol"] == 0
            r["speedup"] = base_med / r["median_step_s"]
        r["replicas_identical"] = r["replicas_max_diff"] == 0.0
        rows[name] = r
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--rtol", type=float, default=1e-4, help="losses and parameters vs the baseline")
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "ddp_cuda.json"))
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    problem = cuda_problem()
    if problem:
        sys.exit(f"ddp_cuda: {problem}")

    result = spawn(args, names)
    rows = summarize(result, args)
    ok = all(r.get("matches_baseline", True) and r.get("replicas_identical", True)
             for r in rows.values() if r["supported"])
    print(f"\nDDP on CUDA ({result['gpu']} x{result['gpus']}), world size {args.world_size}"
          + (" sharing GPUs" if result["shared_gpu"] else "")
          + f", {result['params'] / 1e6:.1f}M parameters, batch {args.batch}/rank, "
          f"median of {args.steps} steps after {args.warmup} warm-up, baseline {BASELINE}")
    hdr = (f"{'config':<20}{'step ms':>9}{'vs nccl':>9}{'steps 1-3 ms':>16}{'last loss':>12}"
           f"{'max |dloss|':>13}{'max |dparam|':>14}{'replicas':>10}  result")
    print(hdr)
    print("-" * len(hdr))
    for name, r in rows.items():
        if not r["supported"]:
            print(f"{name:<20}  not supported: {r['reason']}")
            continue
        base = name == BASELINE
        verdict = "baseline" if base else ("ok" if r.get("matches_baseline") else "DIFFERS")
        first = " ".join(f"{t * 1e3:.0f}" for t in r["first_steps_s"])
        dl = "-" if base or "max_loss_diff" not in r else f"{r['max_loss_diff']:.1e}"
        dp = "-" if base or r["max_param_diff"] is None else f"{r['max_param_diff']:.1e}"
        sp = "-" if "speedup" not in r else f"{r['speedup']:.2f}x"
        print(f"{name:<20}{r['median_step_s'] * 1e3:>9.1f}{sp:>9}{first:>16}{r['losses'][-1]:>12.6f}"
              f"{dl:>13}{dp:>14}{'same' if r['replicas_identical'] else 'DIFFER':>10}  {verdict}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "baseline": BASELINE, "ok": ok, "gpu": result["gpu"], "gpus": result["gpus"],
                   "shared_gpu": result["shared_gpu"], "params": result["params"], "results": rows}, f, indent=1)
    print(f"\njson: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
