"""The main job: a short DistributedDataParallel training run on myccl and then on gloo, in
the same processes, with the same seed and data, printing loss and throughput side by side.

    torchrun --nproc-per-node 2 examples/train.py [--steps 30] [--width 2048]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import c10d_ext  # noqa: F401  (registers "myccl")


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def train(backend: str, args) -> dict:
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(make_model(args.width, args.depth))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1234 + rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
               for _ in range(args.steps)]
    losses = []
    for step, (x, y) in enumerate(batches):
        if step == args.warmup:
            dist.barrier()
            t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.barrier()
    elapsed = time.perf_counter() - t0
    timed = args.steps - args.warmup
    final = torch.tensor([losses[-1]])
    dist.all_reduce(final)
    params = sum(p.numel() for p in model.parameters())
    # Parameters must be identical on every rank after DDP training.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    in_sync = all(torch.equal(gathered[0], t) for t in gathered)
    dist.destroy_process_group()
    return {
        "backend": backend,
        "mean_final_loss": final.item() / world,
        "step_ms": 1000 * elapsed / timed,
        "samples_per_s": timed * args.batch * world / elapsed,
        "params_m": params / 1e6,
        "in_sync": in_sync,
        "params": flat,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--backends", default="myccl,gloo")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    results = [train(b, args) for b in args.backends.split(",")]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"\nDDP training, {int(os.environ.get('WORLD_SIZE', '1'))} ranks, "
              f"{results[0]['params_m']:.1f} M parameters, {args.steps - args.warmup} timed steps")
        print(f"{'backend':<8} {'final loss':>12} {'step (ms)':>10} {'samples/s':>10}  ranks in sync")
        for r in results:
            print(f"{r['backend']:<8} {r['mean_final_loss']:>12.6f} {r['step_ms']:>10.1f} "
                  f"{r['samples_per_s']:>10.1f}  {r['in_sync']}")
        if len(results) > 1:
            same = torch.equal(results[0]["params"], results[1]["params"])
            print(f"parameters identical across backends: {same}; "
                  f"{results[0]['backend']} is {results[1]['step_ms'] / results[0]['step_ms']:.2f}x "
                  f"{results[1]['backend']}'s speed")


if __name__ == "__main__":
    main()
