"""Adasum vs gradient averaging at a large effective batch: a small, honest convergence experiment.

What runs: ranks are SIMULATED in one process (no myccl, no spawning). Every simulated rank holds
a replica of the model and draws its own mini-batch; the reductions are computed with
c10d_ext.horovod.adasum.adasum_reference, the local form of the VHDD tree that
tests/horovod/test_horovod_adasum.py checks adasum_allreduce_ against on real myccl groups. CPU only,
deterministic (fixed seeds; every method sees the same data in the same order from the same
initial weights).

Methods (as Horovod's PyTorch API would run them, N = simulated ranks):
  single      one worker, per-rank batch, base lr (what the base lr was meant for; N x fewer samples)
  avg         DistributedOptimizer, op=Average: gradients averaged, one SGD step, base lr
  avg-lrxN    the same with lr = base lr x N (the scaling in Horovod's examples)
  adasum      DistributedOptimizer, op=Adasum (_DistributedAdasumOptimizer): each rank applies
              its own SGD step (its own momentum buffer) to its local gradient, the per-parameter
              deltas are combined with Adasum, every rank adds the combined delta; base lr
              (Horovod's examples do not scale the lr for CPU Adasum)

Setting (fixed before any run, after the Adasum paper's: many workers with small per-worker
batches, so a large effective batch, and the single-worker hyperparameters kept): a synthetic
10-class task labelled by a random teacher network, an MLP 32-128-128-10, per-rank batch 64,
SGD lr 0.1 momentum 0.5 (Horovod's MNIST example uses momentum 0.5), N = 4 and 16, 200 steps,
3 seeds. No warmup, no tuning per method.

    .venv/bin/python benchmarks/adasum_convergence.py            # ~1-3 min on 2 cores
    .venv/bin/python benchmarks/adasum_convergence.py --ranks 4 --steps 100 --seeds 1   # quick
Writes bench_out/adasum_convergence.json and docs/figures/adasum_convergence.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from c10d_ext.horovod.adasum import adasum_reference  # noqa: E402

METHODS = ["single", "avg", "avg-lrxN", "adasum"]
DIVERGED = float("inf")


# ---- data and model --------------------------------------------------------------------------

def make_data(n_train: int, n_test: int, dim: int = 32, classes: int = 10, seed: int = 1234):
    """Gaussian inputs labelled by a fixed random teacher (tanh MLP); the same for every run."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_test, dim, generator=g)
    w1 = torch.randn(dim, 64, generator=g) / math.sqrt(dim)
    w2 = torch.randn(64, classes, generator=g) / math.sqrt(64)
    y = (torch.tanh(x @ w1 * 2.0) @ w2).argmax(1)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def make_model(seed: int, dim: int = 32, classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes))


def batch_plan(n_train: int, ranks: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, ranks, batch] sample indices: every epoch a fresh permutation split across the
    ranks (DistributedSampler-like). Rank 0's column is what the single worker sees."""
    g = torch.Generator().manual_seed(10_000 + seed)
    per_step = ranks * batch
    out, pool = [], torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if pool.numel() < per_step:
            pool = torch.cat([pool, torch.randperm(n_train, generator=g)])
        out.append(pool[:per_step].view(ranks, batch))
        pool = pool[per_step:]
    return torch.stack(out)


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[float, float]:
    x, y = data
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


# ---- the methods ------------------------------------------------------------------------------
# SGD with momentum written out (torch.optim.SGD's rule, dampening 0, no Nesterov:
# buf = g on the first step, then buf = momentum * buf + g; p -= lr * buf), so that the Adasum
# method can keep one momentum buffer per simulated rank, as _DistributedAdasumOptimizer does.

def _momentum(buf, g, momentum: float):
    return g.clone() if buf is None else buf.mul_(momentum).add_(g)


def run_method(method: str, ranks: int, args, train, test, seed: int) -> dict:
    from torch.func import functional_call, grad_and_value, vmap

    x_all, y_all = train
    plan = batch_plan(x_all.shape[0], ranks, args.batch, args.steps, seed)
    lr = args.lr * (ranks if method == "avg-lrxN" else 1)
    n = 1 if method == "single" else ranks
    model = make_model(seed)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    sizes = [v.numel() for v in params.values()]

    def loss_fn(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    grad_loss = grad_and_value(loss_fn)
    per_rank = vmap(grad_loss, in_dims=(None, 0, 0))  # the parameters are the same on every rank
    bufs = {k: None for k in params}
    rec = {"step_loss": [], "eval_steps": [], "train_loss": [], "test_acc": [], "gain": []}
    diverged_at = None
    for step in range(args.steps):
        idx = plan[step, :n]
        xb, yb = x_all[idx], y_all[idx]  # [n, batch, dim], [n, batch]
        if method == "adasum":
            grads, losses = per_rank(params, xb, yb)
            # every rank steps with its own gradient and momentum; delta_r = -lr * buf_r
            deltas = []
            for k in params:
                bufs[k] = _momentum(bufs[k], grads[k], args.momentum)
                deltas.append((-lr * bufs[k]).reshape(n, -1))
            deltas = torch.cat(deltas, 1)
            combined = adasum_reference(list(deltas), sizes)
            rec["gain"].append((combined.norm() / deltas.mean(0).norm().clamp_min(1e-30)).item())
            off = 0
            for k, v in params.items():
                v.add_(combined[off:off + v.numel()].view_as(v))
                off += v.numel()
            step_loss = losses.mean().item()
        else:
            # the mean of equal-sized per-rank mean losses is the mean loss over their union, so
            # one pass over the n ranks' samples gives the averaged gradient
            grads, loss = grad_loss(params, xb.reshape(-1, xb.shape[-1]), yb.reshape(-1))
            for k, v in params.items():
                bufs[k] = _momentum(bufs[k], grads[k], args.momentum)
                v.sub_(lr * bufs[k])
            step_loss = loss.item()
        rec["step_loss"].append(step_loss if math.isfinite(step_loss) else DIVERGED)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            with torch.no_grad():
                for k, v in model.named_parameters():
                    v.copy_(params[k])
            finite = all(torch.isfinite(v).all() for v in params.values())
            tl, acc = evaluate(model, train) if finite else (DIVERGED, 0.0)
            if finite:
                acc = evaluate(model, test)[1]
            if not math.isfinite(tl):
                tl = DIVERGED
            if tl == DIVERGED and diverged_at is None:
                diverged_at = step + 1
            rec["eval_steps"].append(step + 1)
            rec["train_loss"].append(tl)
            rec["test_acc"].append(acc)
    rec["lr"] = lr
    rec["diverged_at"] = diverged_at
    return rec


# ---- reporting ---------------------------------------------------------------------------------

def _mean_std(xs):
    finite = [x for x in xs if math.isfinite(x)]
    if len(finite) < len(xs):
        return f"diverged {len(xs) - len(finite)}/{len(xs)}"
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))
    return f"{m:.4f} ± {s:.4f}"


def _fmt(x: float) -> str:
    return "  inf " if not math.isfinite(x) else f"{x:6.3f}"


def print_tables(results: dict, args) -> None:
    for ranks, per_method in results.items():
        print(f"\n== {ranks} simulated ranks: per-rank batch {args.batch}, effective batch {int(ranks) * args.batch}, "
              f"base lr {args.lr}, momentum {args.momentum}, {args.steps} steps, {len(args.seeds)} seeds ==")
        steps = per_method[METHODS[0]][0]["eval_steps"]
        print("training loss (whole training set), mean over seeds, at step:")
        print(f"{'step':>6} " + " ".join(f"{m:>10}" for m in METHODS))
        for i, s in enumerate(steps):
            row = []
            for m in METHODS:
                vals = [run["train_loss"][i] for run in per_method[m]]
                row.append(_fmt(sum(vals) / len(vals)) if all(math.isfinite(v) for v in vals) else "  inf ")
            print(f"{s:>6} " + " ".join(f"{v:>10}" for v in row))
        print("final (mean ± std over seeds):")
        print(f"{'method':>10} {'lr':>6} {'train loss':>18} {'test accuracy':>18} {'Adasum |step|/|mean step|':>26}")
        for m in METHODS:
            runs = per_method[m]
            gain = ""
            if m == "adasum":
                g = [sum(r["gain"]) / len(r["gain"]) for r in runs]
                gain = f"{sum(g) / len(g):.2f} (1 = average, {ranks} = sum)"
            print(f"{m:>10} {runs[0]['lr']:>6.2f} {_mean_std([r['train_loss'][-1] for r in runs]):>18} "
                  f"{_mean_std([r['test_acc'][-1] for r in runs]):>18} {gain:>26}")


def plot(results: dict, args, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no figure"
    cols = len(results)
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 7), squeeze=False)
    colors = {"single": "0.5", "avg": "tab:blue", "avg-lrxN": "tab:orange", "adasum": "tab:green"}
    for c, (ranks, per_method) in enumerate(results.items()):
        for m in METHODS:
            runs = per_method[m]
            steps = runs[0]["eval_steps"]
            for row, key in ((0, "train_loss"), (1, "test_acc")):
                ys = [[v if math.isfinite(v) else float("nan") for v in r[key]] for r in runs]
                mean = [sum(v) / len(v) for v in zip(*ys)]
                lo = [min(v) for v in zip(*ys)]
                hi = [max(v) for v in zip(*ys)]
                label = f"{m} (lr {runs[0]['lr']:g})"
                axes[row][c].plot(steps, mean, color=colors[m], label=label)
                axes[row][c].fill_between(steps, lo, hi, color=colors[m], alpha=0.15)
        axes[0][c].set_title(f"{ranks} simulated ranks, effective batch {int(ranks) * args.batch}")
        axes[0][c].set_yscale("log")
        axes[0][c].set_ylabel("training loss")
        axes[1][c].set_ylabel("test accuracy")
        axes[1][c].set_xlabel("step")
        axes[0][c].legend(fontsize=8)
    fig.suptitle(f"Adasum vs averaging (SGD lr {args.lr}, momentum {args.momentum}, per-rank batch {args.batch}; "
                 f"mean and min-max of {len(args.seeds)} seeds)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _json_safe(obj):
    """Diverged values (inf/nan) become null: the file stays strict JSON."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--n-train", type=int, default=32768)
    ap.add_argument("--n-test", type=int, default=8192)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench_out", "adasum_convergence.json"))
    ap.add_argument("--figure", default=os.path.join(ROOT, "docs", "figures", "adasum_convergence.png"))
    args = ap.parse_args()
    for r in args.ranks:
        if r < 1 or r & (r - 1):
            ap.error("--ranks: powers of 2 only (Adasum's VHDD tree)")
    torch.set_num_threads(1)
    t0 = time.time()
    train, test = make_data(args.n_train, args.n_test)
    results: dict = {}
    for ranks in args.ranks:
        results[str(ranks)] = {m: [run_method(m, ranks, args, train, test, s) for s in args.seeds] for m in METHODS}
    elapsed = time.time() - t0
    print_tables(results, args)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({
            "what": "Adasum vs gradient averaging, simulated ranks in one process (adasum_reference)",
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "figure")},
            "torch": torch.__version__, "seconds": round(elapsed, 1),
            "results": _json_safe(results),
        }, f, indent=1)
    fig = plot(results, args, args.figure)
    print(f"\nwrote {args.json}; figure: {fig}; {elapsed:.0f} s")


if __name__ == "__main__":
    main()
