"""The baseline of benchmarks/hvd_synthetic.py: Horovod's synthetic benchmark
(examples/horovod/pytorch_synthetic_benchmark.py) written with torch's DistributedDataParallel
instead of Horovod: the same model, batch, optimizer, step and timing loop, and the same last log
line, so that the two are read alike. Run under torchrun:

    torchrun --nproc-per-node 2 benchmarks/synthetic_ddp.py --backend nccl
"""

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "horovod"))
from smallcnn import SmallCNN  # noqa: E402

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark, torch DDP")
parser.add_argument("--backend", default="nccl", help="the process group's backend (nccl, gloo, myccl)")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--no-cuda", action="store_true", default=False)
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

if args.backend == "myccl":
    import c10d_ext  # noqa: F401  (registers the backend)
dist.init_process_group(args.backend)
rank, size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
if args.cuda:
    torch.cuda.set_device(local_rank)
torch.backends.cudnn.benchmark = True

model = SmallCNN()
if args.cuda:
    model.cuda()
model = DDP(model, device_ids=[local_rank] if args.cuda else None)
optimizer = optim.SGD(model.parameters(), lr=0.01 * size)

data = torch.randn(args.batch_size, 3, 224, 224)
target = torch.LongTensor(args.batch_size).random_() % 1000
if args.cuda:
    data, target = data.cuda(), target.cuda()


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()  # no device synchronisation: timed as Horovod's script times its step


def log(s):
    if rank == 0:
        print(s, flush=True)


device = "GPU" if args.cuda else "CPU"
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_secs.append(args.batch_size * args.num_batches_per_iter / t)
mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log("Img/sec per %s: %.1f +-%.1f" % (device, mean, conf))
log("Total img/sec on %d %s(s): %.1f +-%.1f" % (size, device, size * mean, size * conf))
dist.destroy_process_group()
