"""A learnable node-embedding table under a small graph model, trained with DDP.

Written against pylibwholegraph.torch's names: the one line that differs from a WholeGraph script
is the import (``import pylibwholegraph.torch as wgth``). Each node of a fixed random graph has a
row in a WholeMemory embedding (adam, a sparse optimizer: each row's gradients from every rank are
summed at the rank that holds the row, which steps it); a mean-of-neighbours layer and a
classifier on top are trained with DistributedDataParallel on myccl. Every rank takes its share of
each global batch; its loss is its share of the batch's mean loss, and the dense gradients are
summed over the ranks like the table's, so the training is the same at any number of ranks.

    torchrun --nproc-per-node 2 examples/gnn_embedding_train.py [--steps 30] [--out result.pt]
    torchrun --nproc-per-node 1 examples/gnn_embedding_train.py --out one.pt   # the same, one process
    torchrun --nproc-per-node 4 examples/gnn_embedding_train.py --memory-type chunked --cache-type all_devices

--out writes the trained table and model (rank 0) for comparison between runs.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import c10d_ext.wholememory as wgth  # WholeGraph: import pylibwholegraph.torch as wgth


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--neighbors", type=int, default=5)
    ap.add_argument("--dim", type=int, default=32, help="embedding width")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="global batch (split evenly over the ranks)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.5, help="the dense layers' learning rate (SGD)")
    ap.add_argument("--emb-lr", type=float, default=0.05, help="the embedding's learning rate (adam)")
    ap.add_argument("--memory-type", default="distributed", choices=["continuous", "chunked", "distributed"])
    ap.add_argument("--memory-location", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cache-type", default="none", choices=["none", "all_devices"])
    ap.add_argument("--cache-ratio", type=float, default=0.5)
    ap.add_argument("--out", default="", help="where rank 0 saves the trained table and model")
    return ap.parse_args(argv)


def graph(nodes: int, k: int) -> torch.Tensor:
    """Each node's k neighbours (a fixed random graph every rank builds alike)."""
    return torch.randint(0, nodes, (nodes, k), generator=torch.Generator().manual_seed(1))


def labels_of(ids: torch.Tensor, classes: int) -> torch.Tensor:
    return (ids * 7 + ids // 3) % classes


class NodeModel(torch.nn.Module):
    """Embedding lookup, the mean of the neighbours' rows beside the node's own, two layers."""

    def __init__(self, node_embedding, neighbors: torch.Tensor, hidden: int, classes: int):
        super().__init__()
        dim = node_embedding.shape[1]
        self.gather_fn = wgth.WholeMemoryEmbeddingModule(node_embedding)
        self.neighbors = neighbors
        self.layer = torch.nn.Linear(2 * dim, hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        nbrs = self.neighbors[ids]
        x = self.gather_fn(torch.cat([ids, nbrs.reshape(-1)]), force_dtype=torch.float32)
        own, around = x[:ids.numel()], x[ids.numel():].view(ids.numel(), nbrs.shape[1], -1).mean(1)
        return self.out(F.relu(self.layer(torch.cat([own, around], dim=1))))


def sum_hook(process_group, bucket):
    """DDP's gradients summed over the ranks (not averaged): each rank's loss is already its share."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def train(args, rank: int, world: int, local_rank: int, local_size: int) -> dict:
    """The training on this rank; returns the trained table, the first one and the model's state
    (on the CPU, alike on every rank)."""
    global_comm, local_comm = wgth.init_torch_env_and_create_wm_comm(rank, world, local_rank, local_size)
    if args.batch % world:
        raise SystemExit("--batch must divide by the number of ranks")
    cache_policy = wgth.create_builtin_cache_policy(args.cache_type, args.memory_type, args.memory_location,
                                                    "readwrite", args.cache_ratio,
                                                    cache_memory_location=args.memory_location)
    node_emb = wgth.create_embedding(global_comm, args.memory_type, args.memory_location, torch.float32,
                                     [args.nodes, args.dim], cache_policy=cache_policy)
    table0 = torch.randn(args.nodes, args.dim, generator=torch.Generator().manual_seed(2)) * 0.1
    local, first = node_emb.get_embedding_tensor().get_local_tensor()
    local.copy_(table0[first:first + local.shape[0]].to(local.device))  # each rank fills its own rows
    global_comm.barrier()
    wm_optimizer = wgth.create_wholememory_optimizer(node_emb, "adam", {})

    torch.manual_seed(0)  # the same dense layers on every rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = NodeModel(node_emb, graph(args.nodes, args.neighbors), args.hidden, args.classes).to(device)
    model.neighbors = model.neighbors.to(device)
    ddp = DDP(model)
    ddp.register_comm_hook(None, sum_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    per = args.batch // world
    for step in range(args.steps):
        ids = torch.randint(0, args.nodes, (args.batch,), generator=torch.Generator().manual_seed(100 + step))
        mine = ids[rank * per:(rank + 1) * per].to(device)
        loss = F.cross_entropy(ddp(mine), labels_of(mine, args.classes), reduction="sum") / args.batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        wm_optimizer.step(args.emb_lr)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {total.item():.4f}", flush=True)
    table = node_emb.gather(torch.arange(args.nodes))  # (collective for distributed memory and caches)
    result = {"table": table.cpu(), "table0": table0}
    result.update({f"model.{k}": v.detach().cpu() for k, v in model.state_dict().items()})
    wgth.finalize()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    result = train(args, rank, world, local_rank, local_size)
    if rank == 0 and args.out:
        torch.save(result, args.out)
        print(f"{world} ranks: wrote the trained table and model to {args.out}")


if __name__ == "__main__":
    main()
