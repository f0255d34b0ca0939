"""An embedding table no rank holds whole, trained through whole-memory gather / scatter.

The table (rows x dim) is a DISTRIBUTED whole-memory tensor: each rank holds ceil(rows/n) rows.
Each step every rank takes its share of the global batch, gathers the rows it needs (from
whichever rank holds them), runs a small classifier head on them and backpropagates. The head's
gradients are all-reduced; the table's row gradients go to the rows' owners, which apply sparse
SGD (a row hit several times in the batch gets the sum of its gradients) and scatter the new
rows back. Rank 0 then trains the same model in one process, on the whole batch, and compares:
the table and the head must come out equal.

    torchrun --nproc-per-node 2 examples/embedding_train.py [--rows 2000] [--dim 32] [--steps 40]
    torchrun --nproc-per-node 4 examples/embedding_train.py --kind HOST   # or CHUNKED

Prints the loss as it goes and the largest difference from the single process; exits 1 if they
differ by more than float64 rounding.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import c10d_ext  # noqa: F401  (registers "myccl")
import c10d_ext.wholememory as wm

DTYPE = torch.float64  # exact enough that the only difference from one process is summation order


def data(step: int, batch: int, rows: int, classes: int):
    """The global batch of a step: row indices (repeats included) and labels."""
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, rows, (batch,), generator=g)
    labels = (idx * 7) % classes  # a fixed class per row: learnable from the rows
    return idx, labels


def init_params(rows: int, dim: int, classes: int):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, dim, generator=g, dtype=DTYPE) * 0.1,
            torch.randn(classes, dim, generator=g, dtype=DTYPE) * 0.1)


def sparse_sgd(table_rows: torch.Tensor, idx: torch.Tensor, grads: torch.Tensor, lr: float):
    """(distinct rows, their new values): each row minus lr times the sum of its gradients."""
    uniq, inverse = torch.unique(idx, return_inverse=True)
    summed = torch.zeros((uniq.numel(), grads.shape[1]), dtype=grads.dtype).index_add_(0, inverse, grads)
    return uniq, table_rows - lr * summed


def train_distributed(args):
    rank, n = dist.get_rank(), dist.get_world_size()
    table0, head0 = init_params(args.rows, args.dim, args.classes)
    emb = wm.create_wm_tensor(None, [args.rows, args.dim], [], DTYPE, getattr(wm.WmTensorType, args.kind))
    part, first = wm.local_partition(emb)
    part.copy_(table0[first:first + part.shape[0]])  # each rank fills only its own part
    if args.kind != "DISTRIBUTED":
        dist.barrier()
    head = head0.clone()
    per_rank = args.batch // n
    for step in range(args.steps):
        idx, labels = data(step, args.batch, args.rows, args.classes)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        rows = wm.gather(emb, idx[mine]).requires_grad_()
        w = head.clone().requires_grad_()
        loss = F.cross_entropy(rows @ w.t(), labels[mine], reduction="sum") / args.batch
        loss.backward()
        # the head: every rank's gradient summed
        dist.all_reduce(w.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        head -= args.lr * w.grad
        # the table: every (row, gradient) to the rank that owns the row, which updates it
        all_idx = torch.empty(per_rank * n, dtype=torch.int64)
        dist.all_gather_into_tensor(all_idx, idx[mine].contiguous())
        all_grads = torch.empty(per_rank * n, args.dim, dtype=DTYPE)
        dist.all_gather_into_tensor(all_grads, rows.grad.contiguous())
        first_row, count, _, _ = wm.get_partition_plan(emb)
        owned = (all_idx >= first_row) & (all_idx < first_row + count)
        touched = torch.unique(all_idx[owned])
        if args.kind != "DISTRIBUTED":
            dist.barrier()  # mapped kinds: every rank read its rows before any are rewritten
        current = wm.gather(emb, touched)
        uniq, new = sparse_sgd(current, all_idx[owned], all_grads[owned], args.lr)
        wm.scatter(emb, new, uniq)
        if args.kind != "DISTRIBUTED":
            dist.barrier()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total.item():.5f}", flush=True)
    return wm.gather(emb, torch.arange(args.rows)), head


def train_one_process(args):
    table, head = init_params(args.rows, args.dim, args.classes)
    for step in range(args.steps):
        idx, labels = data(step, args.batch, args.rows, args.classes)
        rows = table[idx].clone().requires_grad_()
        w = head.clone().requires_grad_()
        loss = F.cross_entropy(rows @ w.t(), labels, reduction="sum") / args.batch
        loss.backward()
        head -= args.lr * w.grad
        uniq, new = sparse_sgd(table[torch.unique(idx)], idx, rows.grad, args.lr)
        table[uniq] = new
    return table, head


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=512, help="global batch (split evenly over the ranks)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=20.0)
    ap.add_argument("--kind", default="DISTRIBUTED", choices=["DISTRIBUTED", "HOST", "CHUNKED"])
    args = ap.parse_args()
    dist.init_process_group("myccl")
    if args.batch % dist.get_world_size():
        sys.exit("--batch must divide by the number of ranks")
    table, head = train_distributed(args)
    ok = True
    if dist.get_rank() == 0:
        ref_table, ref_head = train_one_process(args)
        diff = max((table - ref_table).abs().max().item(), (head - ref_head).abs().max().item())
        moved = (ref_table - init_params(args.rows, args.dim, args.classes)[0]).abs().max().item()
        ok = diff < 1e-9 and moved > 1e-3
        print(f"{dist.get_world_size()} ranks, {args.kind} table of {args.rows} x {args.dim}: largest difference "
              f"from one process {diff:.3g} (the table moved by up to {moved:.3g}) -> {'EQUAL' if ok else 'DIFFERENT'}")
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    return int(flag.item() != 0)


if __name__ == "__main__":
    sys.exit(main())
