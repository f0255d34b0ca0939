"""Runs under `torchrun --max-restarts 1` (tests/backend/test_recovery.py): on the first attempt rank 1 dies
before init_process_group while rank 0 is already inside it; the second attempt must form the
group on the store the agent kept and train. Writes <out>/rank<R>.json on the attempt that trains.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/restart_worker.py <out_dir>
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import c10d_ext  # noqa: F401  (registers "myccl")

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

if attempt == 0 and rank == 1:
    # Rank 0 is in init_process_group (and in myccl's bootstrap) by now; die before joining it.
    time.sleep(3)
    sys.exit(3)

t0 = time.monotonic()
dist.init_process_group("myccl", timeout=timedelta(seconds=20))
init_s = time.monotonic() - t0

# A few steps of data-parallel SGD on a linear model; every rank must end with the parameters a
# single process computes from the same data.
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
ddp = c10d_ext.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(5)]
for x, y in data:
    n = x.shape[0] // dist.get_world_size()
    xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(xs), ys).backward()
    opt.step()

torch.manual_seed(0)
ref = torch.nn.Linear(8, 1)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
for x, y in data:
    ropt.zero_grad()
    # The mean over the whole batch is the average of the per-rank means (equal shards).
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ropt.step()
close = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters()))
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"attempt": attempt, "init_s": init_s, "params_match_one_process": close,
               "weight": model.weight.detach().flatten().tolist()}, f)
dist.destroy_process_group()
