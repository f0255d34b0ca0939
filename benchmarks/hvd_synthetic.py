"""Horovod's synthetic benchmark on c10d_ext.horovod against torch's DDP, in one run.

    python benchmarks/hvd_synthetic.py --device cuda      # vs DDP over nccl (2 ranks share a GPU if need be)
    python benchmarks/hvd_synthetic.py --device cpu       # vs DDP over gloo

Runs, one after the other, on the same ranks and model (examples/horovod/smallcnn.py):
  * examples/horovod/pytorch_synthetic_benchmark.py: Horovod's script with only the import changed;
  * benchmarks/synthetic_ddp.py: the same training with torch's DistributedDataParallel over nccl
    (cuda) or gloo (cpu), the baseline;
and reads the "Total img/sec" line of each (goal: Horovod within 5 % of the baseline). On CUDA it
then profiles a few steps of the Horovod run on rank 0 and reports how the NCCL kernels lay beside
backward's: the streams each ran on, and the share of NCCL kernel time during which a compute
kernel ran on another stream (the overlap of gradient allreduces with backward). Prints a table,
writes JSON; exits 2 where the device cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "examples", "horovod", "pytorch_synthetic_benchmark.py")
BASELINE = os.path.join(HERE, "synthetic_ddp.py")
TOTAL = re.compile(r"Total img/sec on (\d+) \w+\(s\): ([0-9.]+) \+-([0-9.]+)")
GOAL = 0.95

sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)


def _env(rank: int, size: int, port: int, shared_gpu: bool) -> dict:
    from _ranks import SHARED_GPU

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
               LOCAL_RANK=str(0 if shared_gpu else rank), LOCAL_WORLD_SIZE=str(1 if shared_gpu else size),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if shared_gpu:
        # Ranks sharing one GPU each pose as a host of their own (NCCL's and myccl's identity), so
        # that Horovod's script pins each to local rank 0's device.
        for k, v in SHARED_GPU.items():
            env.setdefault(k, v.replace("{rank}", str(rank)))
        env["MYCCL_HOST_ID"] = f"host{rank}"
    return env


def launch(argv: list[str], size: int, shared_gpu: bool, timeout: float) -> tuple[str, float]:
    """Runs `argv` as `size` ranks on this host; returns rank 0's output and the wall time."""
    from _ranks import free_port

    port = free_port()
    t0 = time.monotonic()
    procs = [subprocess.Popen(argv, env=_env(r, size, port, shared_gpu), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(size)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"hvd_synthetic: {' '.join(argv[1:3])} did not finish within {timeout:.0f} s")
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        for r, _ in bad:
            sys.stderr.write(f"---- rank {r} ----\n{outs[r][-3000:]}\n")
        raise SystemExit(f"hvd_synthetic: {os.path.basename(argv[1])} failed on ranks {[r for r, _ in bad]}")
    return outs[0], time.monotonic() - t0


def total(out: str, what: str) -> tuple[float, float]:
    m = TOTAL.search(out)
    if m is None:
        raise SystemExit(f"hvd_synthetic: no 'Total img/sec' line from {what}:\n{out[-2000:]}")
    return float(m.group(2)), float(m.group(3))


def kernel_overlap(trace_path: str) -> dict:
    """From a chrome trace of rank 0: NCCL kernels vs the others (compute), by stream; the share
    of NCCL kernel time that a compute kernel on another stream covers."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    compute = [e for e in kernels if "nccl" not in e.get("name", "").lower()]

    def stream(e):
        return e.get("args", {}).get("stream", e.get("tid"))

    nccl_us = sum(e["dur"] for e in nccl)
    covered = 0.0
    spans = sorted((e["ts"], e["ts"] + e["dur"], stream(e)) for e in compute)
    for k in nccl:
        a, b, s = k["ts"], k["ts"] + k["dur"], stream(k)
        pieces = sorted((max(a, x), min(b, y)) for x, y, t in spans if t != s and x < b and y > a)
        end = a
        for x, y in pieces:  # the union of the covering pieces
            x = max(x, end)
            if y > x:
                covered += y - x
                end = y
    return {"nccl_kernels": len(nccl), "compute_kernels": len(compute),
            "nccl_streams": sorted({str(stream(e)) for e in nccl}),
            "compute_streams": sorted({str(stream(e)) for e in compute}),
            "nccl_us": round(nccl_us, 1), "overlapped_us": round(covered, 1),
            "overlap": round(covered / nccl_us, 3) if nccl_us else None}


PROFILED = """
import runpy, sys, torch
from torch.profiler import ProfilerActivity, profile
trace, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
if int(__import__("os").environ["RANK"]) == 0:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runpy.run_path(script, run_name="__main__")
    torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
else:
    runpy.run_path(script, run_name="__main__")
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--world-size", type=int, default=0, help="ranks (default: the GPUs, at least 2; cpu: 2)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=10, help="warm-up batches")
    ap.add_argument("--batches", type=int, default=10, help="batches per iteration")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for each run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "hvd_synthetic.json"))
    args = ap.parse_args()

    import torch

    cuda = args.device == "cuda"
    if cuda:
        from collbench import cuda_problem

        problem = cuda_problem()
        if problem:
            print(f"hvd_synthetic: --device cuda cannot run here: {problem}", file=sys.stderr)
            return 2
    gpus = torch.cuda.device_count() if cuda else 0
    size = args.world_size or (max(2, gpus) if cuda else 2)
    shared = cuda and size > gpus
    common = ["--batch-size", str(args.batch_size), "--num-warmup-batches", str(args.warmup),
              "--num-batches-per-iter", str(args.batches), "--num-iters", str(args.iters)]
    if not cuda:
        common.append("--no-cuda")
    base_backend = "nccl" if cuda else "gloo"

    rows = []
    out, wall = launch([sys.executable, BASELINE, "--backend", base_backend] + common, size, shared, args.timeout)
    base = total(out, "the baseline")
    rows.append({"config": f"torch DDP/{base_backend}", "img_s": base[0], "conf": base[1], "wall_s": round(wall, 1)})
    out, wall = launch([sys.executable, EXAMPLE] + common, size, shared, args.timeout)
    hvd = total(out, "Horovod's script")
    rows.append({"config": "c10d_ext.horovod", "img_s": hvd[0], "conf": hvd[1], "wall_s": round(wall, 1)})

    overlap = None
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            short = ["--batch-size", str(args.batch_size), "--num-warmup-batches", "3",
                     "--num-batches-per-iter", "3", "--num-iters", "2"]
            launch([sys.executable, "-c", PROFILED, trace, EXAMPLE] + short, size, shared, args.timeout)
            overlap = kernel_overlap(trace)

    ratio = hvd[0] / base[0] if base[0] else float("nan")
    print(f"Horovod's synthetic benchmark (SmallCNN, batch {args.batch_size}), {size} ranks on {args.device}"
          + (" sharing one GPU" if shared else ""))
    print(f"{'config':<22}{'img/s':>12}{'+-':>10}{'vs baseline':>14}")
    for r in rows:
        print(f"{r['config']:<22}{r['img_s']:>12.1f}{r['conf']:>10.1f}{r['img_s'] / base[0]:>13.3f}x")
    print(f"goal: within 5 % of the baseline (>= {GOAL}x): {'met' if ratio >= GOAL else 'not met'} ({ratio:.3f}x)")
    if overlap is not None:
        print(f"overlap (rank 0, profiled steps): NCCL kernels {overlap['nccl_kernels']} on streams "
              f"{overlap['nccl_streams']}, compute on {overlap['compute_streams']}; "
              f"{overlap['overlap'] if overlap['overlap'] is not None else 'n/a'} of NCCL kernel time beside compute")
    result = {"device": args.device, "world_size": size, "shared_gpu": shared, "torch": torch.__version__,
              "rows": rows, "ratio": round(ratio, 4), "goal": GOAL, "met": ratio >= GOAL, "overlap": overlap,
              "command": " ".join(sys.argv)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
