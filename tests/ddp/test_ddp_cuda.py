"""c10d_ext.DistributedDataParallel on CUDA parameters: the Reducer's device path.

Each body runs in the two modes of tests/cuda/test_cuda.py: "double" (always, in CI: the strict host
double, where CPU tensors stand for CUDA tensors and myccl sends them to its CUDA engine) and
"gpu" (marked `cuda`: two ranks on one GPU). Our DDP trains next to torch's DDP on the same
myccl group and torch's DDP on the reference group (gloo under the double, nccl on a GPU), from
the same start on the same data, 4 optimizer steps.

What is asserted, per configuration (several buckets, gradient_as_bucket_view on and off,
find_unused_parameters with a locally and a globally unused parameter, the fp16 compression
hook, no_sync accumulation, gradients arriving on two streams):
  * parameters equal to torch's DDP over myccl after every step, bit for bit: both reducers scale
    the same gradients the same way and both sums run in the same engine (with two ranks a sum is
    order-free anyway);
  * parameters close to torch's DDP over the reference backend (rtol 1e-5, atol 1e-6: another
    backend's kernels, same arithmetic);
  * that the device path ran: every bucket reduced by the CUDA engine (under the double its
    collective counter grows by at least the number of buckets each backward), nothing on myccl's
    CPU engine, no fused average, no slot alias, no CPU-engine bucket memory; a Reducer that took a
    CPU path for these tensors fails here;
  * with gradients on two streams, that launches waited for the other stream (and, under the
    double, that single-stream configurations used no event);
  * no strictness violation of the double (Report.result()).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cuda_helpers import MODES, WORLD, Report, _init
from harness import assert_reports, one_thread

SMALL = 0.002  # MiB: 3-4 buckets for the model below

# name -> (DDP kwargs, micro-steps per optimizer step (all but the last under no_sync),
# zero_grad(set_to_none), comm hook, gradients on two streams)
CONFIGS = {
    "buckets": ({"bucket_cap_mb": SMALL}, 1, True, None, False),
    "grad_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 1, False, None, False),
    "find_unused": ({"find_unused_parameters": True, "bucket_cap_mb": SMALL}, 1, True, None, False),
    "find_unused_view": ({"find_unused_parameters": True, "gradient_as_bucket_view": True,
                          "bucket_cap_mb": SMALL}, 1, False, None, False),
    "fp16_hook": ({"bucket_cap_mb": SMALL}, 1, True, "fp16", False),
    "no_sync": ({"bucket_cap_mb": SMALL}, 3, False, None, False),
    "no_sync_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 3, False, None, False),
    "two_streams": ({"bucket_cap_mb": SMALL}, 1, True, None, True),
    "two_streams_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 1, False, None, True),
}
STEPS = 4


class Net(nn.Module):
    """With `extra`: `branch` is used on some ranks in some steps (locally unused, globally
    used), `unused` never (globally unused: its .grad must stay None)."""

    def __init__(self, extra: bool):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        if extra:
            self.branch = nn.Linear(32, 4)
            self.unused = nn.Linear(32, 4)

    def forward(self, x, use_branch=False):
        h = torch.relu(self.mid(torch.tanh(self.inp(x))))
        y = self.out(h)
        return y + self.branch(h) if use_branch else y




def _second_stream(module, mode):
    """`mid`'s gradients arrive on another stream than the rest: a pre-hook on each of its
    parameters switches the current stream before AccumulateGrad and the Reducer's hook run (on
    a GPU after making that stream wait for the gradient; the autograd engine puts the node's
    stream back afterwards; the double has no such guard, so every parameter's hook sets it).
    `mid` shares its bucket with `out`, so that bucket's launch must wait for a stream of its own."""
    if mode == "gpu":
        side = torch.cuda.Stream()

        def to_side(g):
            side.wait_stream(torch.cuda.current_stream())
            # g was made on the node's stream and is read on `side`: without this the caching
            # allocator may hand its memory to the node's stream's next kernel before `side` has
            # read it (seen once in three H100 runs: mid.bias off by 2e-3 at step 1).
            g.record_stream(side)
            torch.cuda.set_stream(side)
            return g

        for p in module.mid.parameters():
            p.register_hook(to_side)
        return lambda: None
    import cuda_double

    side = cuda_double.new_stream()
    for name, p in module.named_parameters():
        sid = side if name.startswith("mid.") else 0
        p.register_hook(lambda g, sid=sid: (cuda_double.set_stream(sid), g)[1])
    return lambda: cuda_double.set_stream(0)


def _hooks(name):
    import c10d_ext
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"fp16": (c10d_ext.hooks.fp16_compress_hook, default_hooks.fp16_compress_hook)}[name]


def _storage_in(t, bufs) -> bool:
    return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in bufs)


@one_thread
def body_ddp_device(ctx, mode, cfg):
    import c10d_ext

    dev, ref = _init(ctx, compare=True, mode=mode)
    rep = Report(ctx, mode)
    kw, micro, set_to_none, hook, two_streams = CONFIGS[cfg]
    extra = kw.get("find_unused_parameters", False)
    ids = [dev] if mode == "gpu" else None
    torch.manual_seed(1234)
    base = Net(extra).to(dev)
    ours = c10d_ext.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, **kw)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, **kw)
    theirs_ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids, process_group=ref, **kw)
    if hook:
        mine, torchs = _hooks(hook)
        ours.register_comm_hook(None, mine)
        theirs.register_comm_hook(None, torchs)
        theirs_ref.register_comm_hook(ref, torchs)
    # Only ours gets two streams: torch's reducer does not order copies made on several streams.
    restore = _second_stream(ours.module, mode) if two_streams else (lambda: None)
    models = [ours, theirs, theirs_ref]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    c10d_ext.reset_stats()
    if mode == "double":
        import cuda_double

    for step in range(STEPS):
        use_branch = extra and (ctx.rank + step) % 2 == 0
        for m, o in zip(models, opts):
            o.zero_grad(set_to_none=set_to_none)
            for k in range(micro):
                g = torch.Generator().manual_seed(1000 * ctx.rank + 10 * step + k)
                x = torch.randn(6, 12, generator=g).to(dev)
                y = torch.randn(6, 4, generator=g).to(dev)
                synced = k == micro - 1
                before = cuda_double.counters()["collectives"] if mode == "double" and m is ours else 0
                with m.no_sync() if not synced else nullcontext():
                    F.mse_loss(m(x, use_branch), y).backward()
                if m is ours:
                    restore()
                if mode == "double" and m is ours and synced:
                    ran = cuda_double.counters()["collectives"] - before
                    nbuckets = len(ours.bucket_stats()[-1]["buckets"])
                    rep.check(ran >= nbuckets, f"{cfg} step {step}: the CUDA engine ran {ran} collectives for "
                                               f"{nbuckets} buckets")
            o.step()

        # The device path, seen from outside.
        last = ours.bucket_stats()[-1]["buckets"]
        rep.check(all(b["on_device"] for b in last), f"{cfg} step {step}: a bucket took the CPU path: {last}")
        rep.check(not any(b["fused_average"] for b in last), f"{cfg} step {step}: a bucket was averaged by "
                                                             "the CPU engine's scaled sum")
        rep.check(not any(b["backend_memory"] for b in last), f"{cfg} step {step}: a bucket got CPU-engine memory")
        bufs = ours.reducer.bucket_buffers()
        grads = [p.grad for p in ours.parameters() if p.grad is not None]
        if kw.get("gradient_as_bucket_view"):
            rep.check(all(_storage_in(g, bufs) for g in grads), f"{cfg} step {step}: a .grad is not its bucket view")
        else:
            # torch's layout: .grad in memory of its own, copied into the bucket every backward
            rep.check(not any(_storage_in(g, bufs) for g in grads), f"{cfg} step {step}: a .grad aliases its "
                                                                    "bucket slot on the device path")
            copied = sum(b["grad_copies"] for b in last)
            rep.check(copied == len(list(ours.parameters())) or extra,
                      f"{cfg} step {step}: {copied} gradients copied into the buckets, expected every one")
        waits = sum(b["stream_waits"] for b in last)
        if two_streams:
            rep.check(waits >= 1, f"{cfg} step {step}: gradients on two streams but no launch waited: {last}")
        elif mode == "double":
            rep.check(waits == 0, f"{cfg} step {step}: one stream but launches waited for {waits} others")
        if extra:
            rep.check(ours.module.unused.weight.grad is None, f"{cfg} step {step}: a globally unused "
                                                              "parameter got a .grad")

        a = dict(ours.module.named_parameters())
        differ = [(name, (a[name].double() - q.double()).abs().max().item())
                  for name, q in theirs.module.named_parameters() if not torch.equal(a[name], q)]
        rep.check(not differ, f"{cfg} step {step}: parameters differ from torch's DDP over myccl (max |diff|): "
                              f"{differ}")
        close = all(torch.allclose(a[name], q, rtol=1e-5, atol=1e-6)
                    for name, q in theirs_ref.module.named_parameters())
        rep.check(close, f"{cfg} step {step}: parameters differ from torch's DDP over the reference backend")

    cpu_ops = {k: v["count"] for k, v in c10d_ext.stats().items() if v["count"]}
    rep.check(not cpu_ops, f"{cfg}: ops ran on myccl's CPU engine: {cpu_ops}")
    return rep.result()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_ddp_on_device_matches_torch(run, cfg, mode):
    assert_reports(run(2, body_ddp_device, mode, cfg, timeout=240, world_env=WORLD[mode]))
