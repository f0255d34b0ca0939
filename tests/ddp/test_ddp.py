"""c10d_ext.DistributedDataParallel and its C++ Reducer (issue 5).

The heart: for an MLP, a small conv net (with BatchNorm buffers), a transformer block, an
embedding model with an unused branch and checkpointed models, 5 optimizer steps with our DDP
and with torch's DDP on the same backend, same data, at world sizes 2 and 3, leave bit-identical
parameters after every step, for plain sync, no_sync accumulation, gradient_as_bucket_view,
static_graph, find_unused_parameters and the allreduce / fp16 comm hooks. Then each numbered
item of the issue on its own: bucketing, overlap and order, the rebuild, unused parameters and
the error torch raises too late, hooks, join, buffers, sparse gradients, the construction check,
backend-allocated buckets and the timeline.

Each test runs many checks inside one call of a reused world, so the file stays fast.
"""

from __future__ import annotations

import glob
import json
import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from harness import one_thread



# ---- models --------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x, flag=False):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8 * 3 * 3, 4)

    def forward(self, x, flag=False):
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.conv2(h))
        return self.fc(h.flatten(1))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x, flag=False):
        return self.head(self.block(x).mean(1))


class EmbedNet(nn.Module):
    """`branch` is used only when the caller says so: unused on some ranks / steps / always."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 8)
        self.fc = nn.Linear(8, 4)
        self.branch = nn.Linear(8, 4)

    def forward(self, idx, use_branch=False):
        h = self.emb(idx).mean(1)
        out = self.fc(h)
        return out + self.branch(h) if use_branch else out


class CkptNet(nn.Module):
    def __init__(self, reentrant: bool, twice: bool = False):
        super().__init__()
        self.reentrant, self.twice = reentrant, twice
        self.inp = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x, flag=False):
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        if self.twice:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


MODELS = {
    "mlp": MLP,
    "conv": ConvNet,
    "transformer": Transformer,
    "embed": EmbedNet,
    "ckpt_reentrant": lambda: CkptNet(True),
    "ckpt_reentrant_twice": lambda: CkptNet(True, twice=True),
    "ckpt_nonreentrant": lambda: CkptNet(False, twice=True),
}


def make_model(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(name, rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    if name == "conv":
        x = torch.randn(4, 3, 8, 8, generator=g)
    elif name == "transformer":
        x = torch.randn(3, 5, 16, generator=g)
    elif name == "embed":
        x = torch.randint(0, 40, (6, 5), generator=g)
    else:
        x = torch.randn(6, 12, generator=g)
    return x, torch.randn(x.shape[0], 4, generator=g)


SMALL = 0.002  # MiB: several buckets even for these small models

# name -> (DDP kwargs, micro-steps per optimizer step (all but the last under no_sync), zero_grad
# set_to_none, comm hook)
CONFIGS = {
    "plain": ({}, 1, True, None),
    "no_sync": ({"bucket_cap_mb": SMALL}, 3, True, None),
    # gradients kept across steps: from the second step on they are accumulated and averaged
    # in their bucket slots (slot aliases), not copied
    "no_sync_keep": ({"bucket_cap_mb": SMALL}, 3, False, None),
    "grad_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 1, False, None),
    "no_sync_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": SMALL}, 3, False, None),
    "static": ({"static_graph": True, "bucket_cap_mb": SMALL}, 1, True, None),
    "find_unused": ({"find_unused_parameters": True, "bucket_cap_mb": SMALL}, 1, True, None),
    "allreduce_hook": ({"bucket_cap_mb": SMALL}, 1, True, "allreduce"),
    "fp16_hook": ({"bucket_cap_mb": SMALL}, 1, True, "fp16"),
}


def combos():
    for model in ("mlp", "conv", "transformer", "embed"):
        for cfg in CONFIGS:
            yield model, cfg
    # Checkpointing: the combinations torch's DDP supports (reentrant checkpointing hides
    # parameters from find_unused_parameters' graph walk; a module checkpointed twice
    # reentrantly needs static_graph).
    yield from [("ckpt_reentrant", "plain"), ("ckpt_reentrant", "grad_view"), ("ckpt_reentrant", "fp16_hook"),
                ("ckpt_reentrant_twice", "static"), ("ckpt_nonreentrant", "find_unused"),
                ("ckpt_nonreentrant", "no_sync_view")]


def our_hook(name):
    import c10d_ext

    return {"allreduce": c10d_ext.hooks.allreduce_hook, "fp16": c10d_ext.hooks.fp16_compress_hook}[name]


def torch_hook(name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[name]


def use_branch(model, cfg, rank, step):
    # The embedding model's branch: never used under static_graph (the graph must not change),
    # otherwise used on some ranks in some steps (locally unused, globally used).
    return model == "embed" and cfg != "static" and (rank + step) % 2 == 0


def compare_with_torch(ctx, model, cfg, pg, steps=5):
    """Trains our DDP and torch's side by side; returns the mismatches."""
    import c10d_ext

    kw, micro, set_to_none, hook = CONFIGS[cfg]
    kw = dict(kw)
    if model == "embed" and cfg != "static":
        kw["find_unused_parameters"] = True
    ours = c10d_ext.DistributedDataParallel(make_model(model), process_group=pg, **kw)
    theirs = torch.nn.parallel.DistributedDataParallel(make_model(model), process_group=pg, **kw)
    if hook:
        ours.register_comm_hook(pg, our_hook(hook))
        theirs.register_comm_hook(pg, torch_hook(hook))
    pairs = [(ours, torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)),
             (theirs, torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9))]
    bad = []
    for step in range(steps):
        for ddp, opt in pairs:
            opt.zero_grad(set_to_none=set_to_none)
            for k in range(micro):
                x, y = batch(model, ctx.rank, step, k)
                with ddp.no_sync() if k < micro - 1 else nullcontext():
                    F.mse_loss(ddp(x, use_branch(model, cfg, ctx.rank, step)), y).backward()
            opt.step()
        a = dict(ours.module.named_parameters())
        a.update(ours.module.named_buffers())
        b = dict(theirs.module.named_parameters())
        b.update(theirs.module.named_buffers())
        for name, t in b.items():
            if not torch.equal(a[name], t):
                diff = (a[name].double() - t.double()).abs().max().item()
                bad.append(f"{model}/{cfg} step {step}: {name} differs (max |diff| {diff:.3g})")
                break
    return bad


@one_thread
def body_equivalence(ctx):
    ctx.init("myccl")
    bad, checked = [], 0
    for model, cfg in combos():
        bad += compare_with_torch(ctx, model, cfg, dist.group.WORLD)
        checked += 1
    if ctx.size == 2:
        # Another backend through the same public ProcessGroup API (sums of two are order-free,
        # so gloo's results are bit-identical too).
        gloo = dist.new_group(backend="gloo")
        for model, cfg in [("mlp", "plain"), ("conv", "grad_view"), ("embed", "fp16_hook"), ("mlp", "no_sync"),
                           ("conv", "no_sync_keep")]:
            bad += [f"gloo: {b}" for b in compare_with_torch(ctx, model, cfg, gloo)]
            checked += 1
        # myccl over TCP: the fused average takes the scale-first fallback (not shared memory)
        import c10d_ext

        tcp = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(transport="tcp"))
        for model, cfg in [("mlp", "grad_view"), ("conv", "plain")]:
            bad += [f"myccl-tcp: {b}" for b in compare_with_torch(ctx, model, cfg, tcp)]
            checked += 1
    return bad, checked


# 2 and 4: the average folded into myccl's reduction (two inputs, and the general kernel);
# 3: scaled on the way into the buckets, as torch does.
@pytest.mark.parametrize("size", [2, 3, 4])
def test_bitwise_equal_to_torch_ddp(run, size):
    results = run(size, body_equivalence, timeout=240)
    expected = len(list(combos())) + (7 if size == 2 else 0)
    for rank, (bad, checked) in enumerate(results):
        assert checked == expected, f"rank {rank} ran {checked} of {expected} combinations"
        assert not bad, f"rank {rank}:\n" + "\n".join(bad)


# ---- 1. bucket assignment -------------------------------------------------------------------


def test_bucket_assignment_rule():
    import c10d_ext

    C = c10d_ext._C
    f32 = [nn.Parameter(torch.zeros(100)) for _ in range(6)]  # 400 bytes each
    rev = list(range(5, -1, -1))
    # Reverse registration order; the first bucket closes at its own (smaller) cap.
    assert C._ddp_assign_buckets(f32, rev, [False] * 6, C.BucketCaps(400, 1200)) == [[5], [4, 3, 2], [1, 0]]
    assert C._ddp_assign_buckets(f32, rev, [False] * 6, C.BucketCaps(10**9, 10**9)) == [[5, 4, 3, 2, 1, 0]]
    # One open bucket per dtype; a sparse parameter alone; buckets ordered by when they fill.
    mixed = [nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(100, dtype=torch.float64)),
             nn.Parameter(torch.zeros(100)), nn.Parameter(torch.zeros(10, 3)), nn.Parameter(torch.zeros(100))]
    plan = C._ddp_assign_buckets(mixed, [4, 3, 2, 1, 0], [False, False, False, True, False], C.BucketCaps(800, 800))
    assert plan == [[3], [4, 2], [1], [0]], plan


# ---- 2, 3, 6, 7: overlap, order, rebuild, backend memory, views, stats, timeline --------------


class Deep(nn.Module):
    """Eight 64x64 layers; forward order depends on `order` (rank-dependent in the rebuild check)."""

    def __init__(self, order=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(8))
        self.order = order or list(range(8))

    def forward(self, x, flag=False):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(512, 512)  # 1 MiB of weights: large enough for the zero-copy path
        self.b = nn.Linear(512, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@one_thread
def body_mechanics(ctx, trace_prefix):
    import c10d_ext
    from c10d_ext import trace

    ctx.init("myccl")
    bad = []

    def check(cond, what):
        if not cond:
            bad.append(what)

    # Overlap and order: small buckets; bucket 0 is launched long before backward ends.
    ddp = c10d_ext.DistributedDataParallel(Deep(), bucket_cap_mb=0.02)
    nb = len(ddp.reducer.bucket_plan())
    check(nb >= 4, f"expected several buckets, got {nb}")
    for step in range(12):
        ddp(torch.randn(4, 64)).sum().backward()
    stats = ddp.bucket_stats()
    check(len(stats) == 10, f"bucket_stats keeps the last 10 iterations, got {len(stats)}")
    check([s["iteration"] for s in stats] == list(range(3, 13)), f"iterations {[s['iteration'] for s in stats]}")
    for it in stats:
        bs = it["buckets"]
        check(len(bs) == nb, f"iteration {it['iteration']}: {len(bs)} bucket records")
        # The gradients still to come when each bucket was launched: fewer for each later bucket
        # (they went in index order as their gradients arrived), none for the last, and some for
        # bucket 0, whose reduction therefore overlapped backward.
        pending = [b["grads_pending"] for b in bs]
        check(pending == sorted(pending, reverse=True) and pending[-1] == 0, f"buckets launched out of order: {pending}")
        check(pending[0] > 0, f"bucket 0 was not launched before backward's last gradient: {pending}")
        for b in bs:  # every time of the record is filled in
            check(min(b["ready_us"], b["launch_us"], b["done_us"]) > 0, f"bucket times missing: {b}")
        check(min(it["backward_end_us"], it["finished_us"]) > 0, f"iteration times missing: {it}")
        check(all(b["backend_memory"] for b in bs), "myccl offers bucket memory but a bucket did not use it")
        # world size 2: the average is folded into myccl's reduction (a scaled sum)
        check(all(b["fused_average"] for b in bs), "myccl at 2 ranks: a bucket was not averaged in the reduction")

    # Rebuild: each rank uses the layers in its own order; after the first iteration every rank
    # adopts rank 0's order (reversed use order: backward produces gradients last layer first).
    order = list(range(8)) if ctx.rank == 0 else [3, 1, 0, 2, 7, 5, 6, 4]
    ddp = c10d_ext.DistributedDataParallel(Deep(order), bucket_cap_mb=0.02)
    first = ddp.reducer.bucket_plan()
    check(first[0][:2] == [15, 14], f"first plan should start with the last registered layer: {first}")
    for _ in range(3):
        ddp(torch.randn(4, 64)).sum().backward()
    rebuilt = ddp.reducer.bucket_plan()
    flat = [i for b in rebuilt for i in b]
    check(sorted(flat) == list(range(16)), f"rebuilt plan is not a permutation: {rebuilt}")

    # .grad lives in the bucket (no copy in or out after the first backward): as a view with
    # gradient_as_bucket_view, as a tensor of its own over its slot (a slot alias) without it,
    # with find_unused_parameters too (every parameter is used here); after
    # set_grad_alias(False), in memory of its own.
    def in_buckets(m):
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in m.reducer.bucket_buffers()]
        return [any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in m.parameters()]

    def copies(m, it):
        return sum(b["grad_copies"] for b in m.bucket_stats()[it]["buckets"])

    nparams = len(list(Wide().parameters()))
    for as_view, unused in ((True, False), (False, False), (False, True), (True, True)):
        m = c10d_ext.DistributedDataParallel(Wide(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.5,
                                             find_unused_parameters=unused)
        c10d_ext.reset_stats()
        for _ in range(2):
            m(torch.randn(4, 512)).sum().backward()
        bufs = m.reducer.bucket_buffers()
        inside = in_buckets(m)
        grad_storages = {p.grad.untyped_storage().data_ptr() for p in m.parameters()}
        what = f"gradient_as_bucket_view={as_view}, find_unused_parameters={unused}"
        check(copies(m, 0) == nparams, f"{what}: first backward copied {copies(m, 0)} of {nparams} gradients")
        if as_view:
            check(all(inside), "gradient_as_bucket_view: a .grad is not a view into its bucket")
            check(grad_storages <= {b.untyped_storage().data_ptr() for b in bufs}, "grads have their own storage")
        else:
            check(all(inside), f"{what}: a .grad is not in its bucket slot: {inside}")
            check(all(p.grad._base is None and p.grad.untyped_storage().nbytes() == p.grad.numel() * 4
                      for p in m.parameters()), f"{what}: a .grad is a view or shares a storage")
            for p in m.parameters():
                p.grad.detach_()  # what zero_grad does; a view would refuse
        check(copies(m, -1) == 0, f"{what}: second backward copied {copies(m, -1)} gradients")
        # Every rank registered its bucket: myccl reduces straight out of them.
        check("all_reduce/shm-zero-copy" in c10d_ext.stats(), f"no zero-copy all_reduce: {sorted(c10d_ext.stats())}")
    # set_grad_alias(False): every .grad gets memory of its own and is copied again.
    m = c10d_ext.DistributedDataParallel(Wide(), bucket_cap_mb=0.5)
    m(torch.randn(4, 512)).sum().backward()
    before = [p.grad.clone() for p in m.parameters()]
    m.reducer.set_grad_alias(False)
    check(not any(in_buckets(m)), "set_grad_alias(False) left a .grad in its bucket")
    check(all(torch.equal(a, p.grad) for a, p in zip(before, m.parameters())), "set_grad_alias(False) changed a .grad")
    m(torch.randn(4, 512)).sum().backward()
    check(copies(m, -1) == nparams and not any(in_buckets(m)), "set_grad_alias(False): gradients not copied")

    # no_sync: no collective at all during the accumulation backward.
    m = c10d_ext.DistributedDataParallel(MLP())
    c10d_ext.reset_stats()
    with m.no_sync():
        m(torch.randn(3, 12)).sum().backward()
    check(not any(k.startswith("all_reduce") for k in c10d_ext.stats()), f"no_sync ran {c10d_ext.stats()}")
    m(torch.randn(3, 12)).sum().backward()
    check(any(k.startswith("all_reduce") for k in c10d_ext.stats()), "the synchronised backward ran no all_reduce")

    # Another backend: same Reducer over gloo, which offers no bucket memory.
    gloo = dist.new_group(backend="gloo")
    m = c10d_ext.DistributedDataParallel(MLP(), process_group=gloo)
    m(torch.randn(3, 12)).sum().backward()
    check(not any(b["backend_memory"] for b in m.bucket_stats()[-1]["buckets"]), "gloo has no bucket memory")
    check(not any(b["fused_average"] for b in m.bucket_stats()[-1]["buckets"]), "gloo has no scaled sum")

    # state_dict keys as torch's DDP.
    tkeys = list(torch.nn.parallel.DistributedDataParallel(ConvNet()).state_dict())
    check(list(c10d_ext.DistributedDataParallel(ConvNet()).state_dict()) == tkeys, "state_dict keys differ")

    # Timeline: bucket spans next to the ops.
    trace.start(trace_prefix)
    m = c10d_ext.DistributedDataParallel(Deep(), bucket_cap_mb=0.02)
    for _ in range(2):
        m(torch.randn(4, 64)).sum().backward()
    path = trace.stop()
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["name"] for e in events}
    check({"ddp bucket 0", "ddp backward", "ddp wait + write-back"} <= names, f"timeline lacks DDP events: {names}")
    spans = [e for e in events if e["name"] == "ddp bucket 0"]
    check(len(spans) == 2 and all(e["args"]["nbytes"] > 0 for e in spans), f"bucket spans: {spans}")
    return bad, rebuilt


def test_overlap_order_rebuild_views_memory_stats_timeline(run, tmp_path):
    results = run(2, body_mechanics, str(tmp_path / "ddp"), timeout=120)
    for rank, (bad, _) in enumerate(results):
        assert not bad, f"rank {rank}: " + "; ".join(bad)
    plans = [plan for _, plan in results]
    assert plans[0] == plans[1], f"ranks disagree on the rebuilt plan: {plans}"
    # Rank 0 used the layers in registration order: gradients arrive last layer first (within
    # a layer, weight and bias in whatever order autograd produces them).
    layers = [i // 2 for b in plans[0] for i in b]
    assert layers == sorted(layers, reverse=True), plans[0]
    assert len(glob.glob(str(tmp_path / "ddp.rank*.json"))) == 2


# ---- 4. unused parameters, static graph, the error torch raises too late ---------------------


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)
        self.aux = nn.Linear(6, 2)

    def forward(self, x, use_aux=True):
        h = torch.relu(self.trunk(x))
        return (self.head(h), self.aux(h)) if use_aux else (self.head(h), None)


def _expect_error(fn, *needles):
    try:
        fn()
    except RuntimeError as e:
        missing = [n for n in needles if n not in str(e)]
        return f"error lacks {missing}: {e}" if missing else None
    return f"no error (wanted one mentioning {needles})"


def _params_equal_everywhere(module):
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


@one_thread
def body_unused(ctx):
    import c10d_ext

    ctx.init("myccl")
    bad = []
    x = torch.randn(4, 6)

    # find_unused_parameters=False, aux unused in step 2 on every rank: the same backward raises,
    # names the parameters, and the next step (everything used) works and stays in sync.
    m = c10d_ext.DistributedDataParallel(TwoHeads())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    steps_taken = 0
    for step, use_aux in enumerate([True, False, True]):
        opt.zero_grad()
        head, aux = m(x + step, use_aux)
        loss = head.sum() + (aux.sum() if use_aux else 0)
        if use_aux:
            loss.backward()
            opt.step()
            steps_taken += 1
        else:
            err = _expect_error(loss.backward, "'aux.weight'", "'aux.bias'", "received no gradient",
                                "find_unused_parameters")
            if err:
                bad.append(f"unused on all ranks: {err}")
            if m.module.aux.weight.grad is not None:
                bad.append("aux.weight got a gradient although it was unused")
    if steps_taken != 2 or not _params_equal_everywhere(m.module):
        bad.append("training did not continue in sync after the error")

    # An output the loss ignores: its head gets an undefined gradient -> also named.
    m = c10d_ext.DistributedDataParallel(TwoHeads())
    head, aux = m(x)
    err = _expect_error(head.sum().backward, "'aux.weight'", "received no gradient")
    if err:
        bad.append(f"ignored output: {err}")

    # Unused on rank 1 only: rank 1 raises, rank 0 finishes (rank 1 still reduced the buckets
    # with zeros, so nobody hangs), and both carry on.
    m = c10d_ext.DistributedDataParallel(TwoHeads())
    head, aux = m(x, use_aux=ctx.rank == 0)
    loss = head.sum() + (aux.sum() if aux is not None else 0)
    if ctx.rank == 1:
        err = _expect_error(loss.backward, "'aux.weight'")
        if err:
            bad.append(f"rank 1 only: {err}")
    else:
        loss.backward()
    head, aux = m(x)
    (head.sum() + aux.sum()).backward()  # the next step works on both ranks and is in sync
    g = m.module.trunk.weight.grad.reshape(-1)
    gs = [torch.empty_like(g) for _ in range(ctx.size)]
    dist.all_gather(gs, g)
    if not torch.equal(gs[0], gs[1]):
        bad.append("after the one-sided error the next step's gradients differ across ranks")

    # find_unused_parameters=True: rank-dependent usage; locally unused but globally used
    # parameters get the average, globally unused ones keep .grad None.
    m = c10d_ext.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    head, aux = m(x, use_aux=ctx.rank == 0)
    (head.sum() + (aux.sum() if aux is not None else 0)).backward()
    if m.module.aux.weight.grad is None:
        bad.append("find_unused: aux used on rank 0 must get the averaged gradient on every rank")
    m2 = c10d_ext.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    head, _ = m2(x, use_aux=False)
    head.sum().backward()
    if m2.module.aux.weight.grad is not None or m2.module.head.weight.grad is None:
        bad.append("find_unused: globally unused parameters must keep .grad None")

    # .grad kept across steps and made different per rank (a local clipping, say), then the
    # aux head unused on every rank / on rank 1 only: torch's DDP leaves a globally unused
    # .grad as it was and writes the average over the ranks' values into a locally unused but
    # globally used one. Ours keeps .grad in bucket slots, which a reduction in place would
    # change in the first case; both must match torch's bits.
    for who_uses in ((), (0,)):
        grads = []
        for impl in (c10d_ext.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
            torch.manual_seed(0)
            m = impl(TwoHeads(), find_unused_parameters=True)
            head, aux = m(x, use_aux=True)
            (head.sum() + aux.sum()).backward()
            for p in m.module.aux.parameters():
                p.grad.fill_(ctx.rank + 1.5)
            head, aux = m(x, use_aux=ctx.rank in who_uses)
            (head.sum() + (aux.sum() if aux is not None else 0)).backward()
            grads.append([p.grad.clone() for p in m.module.aux.parameters()])
        if not all(torch.equal(a, b) for a, b in zip(*grads)):
            bad.append(f"find_unused, aux used by ranks {who_uses}: aux .grad differs from torch's DDP")
        if not who_uses and not all(bool((g == ctx.rank + 1.5).all()) for g in grads[0]):
            bad.append("find_unused: a globally unused .grad changed")

    # static_graph: the graph may not change after the first iteration.
    m = c10d_ext.DistributedDataParallel(TwoHeads(), static_graph=True)
    for use_aux in (False, False):
        head, _ = m(x, use_aux)
        head.sum().backward()
    head, aux = m(x, True)
    err = _expect_error((head.sum() + aux.sum()).backward, "'aux.", "static_graph")
    if err:
        bad.append(f"static graph change: {err}")

    # A module checkpointed twice reentrantly without static_graph: named, with the way out.
    m = c10d_ext.DistributedDataParallel(CkptNet(True, twice=True))
    err = _expect_error(m(torch.randn(2, 12)).sum().backward, "'block.", "static_graph=True")
    if err:
        bad.append(f"reentrant twice: {err}")
    return bad


def test_unused_parameters_and_early_error(run):
    for rank, bad in enumerate(run(2, body_unused, timeout=120)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


# ---- 5. hooks, join, buffers, sparse, construction check -------------------------------------


@one_thread
def body_hooks(ctx):
    import c10d_ext
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ctx.init("myccl")
    bad = []
    pg = dist.group.WORLD
    x, y = batch("mlp", ctx.rank, 0, 0)

    # What a hook sees: our GradBucket with torch's GradBucket methods.
    seen = []

    def recording_hook(state, bucket):
        grads = bucket.gradients()
        params = bucket.parameters()
        seen.append((bucket.index(), bucket.is_last(), [tuple(p.shape) for p in params],
                     [tuple(g.shape) for g in grads], bucket.buffer().numel()))
        return c10d_ext.hooks.allreduce_hook(state, bucket)

    m = c10d_ext.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=0.002)
    m.register_comm_hook(pg, recording_hook)
    F.mse_loss(m(x), y).backward()
    nb = len(m.reducer.bucket_plan())
    if [s[0] for s in seen] != list(range(nb)) or [s[1] for s in seen] != [False] * (nb - 1) + [True]:
        bad.append(f"bucket index/is_last: {[(s[0], s[1]) for s in seen]}")
    for _, _, pshapes, gshapes, numel in seen:
        if pshapes != gshapes or numel != sum(torch.Size(s).numel() for s in pshapes):
            bad.append(f"gradients()/parameters()/buffer() disagree: {pshapes} {gshapes} {numel}")

    # torch's wrapper (uses set_buffer) on our DDP equals it on torch's DDP; bf16 is close to fp32.
    ref = torch.nn.parallel.DistributedDataParallel(make_model("mlp"))
    F.mse_loss(ref(x), y).backward()
    for name, hook, theirs, tol in [
        ("fp16 wrapper", default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
         default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook), 0),
        # torch's DDP refuses its own bf16 hook on a CPU-only build of torch (it asks for CUDA
        # and NCCL): there ours is checked against plain averaging only.
        ("bf16", c10d_ext.hooks.bf16_compress_hook,
         default_hooks.bf16_compress_hook if torch.version.cuda is not None else None, 0),
    ]:
        ours = c10d_ext.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=0.002)
        ours.register_comm_hook(pg, hook)
        F.mse_loss(ours(x), y).backward()
        tddp = ours
        if theirs is not None:
            tddp = torch.nn.parallel.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=0.002)
            tddp.register_comm_hook(pg, theirs)
            F.mse_loss(tddp(x), y).backward()
        for p, q, r in zip(ours.parameters(), tddp.parameters(), ref.parameters()):
            if not torch.equal(p.grad, q.grad):
                bad.append(f"{name}: gradients differ from torch's DDP with the same hook")
                break
            if not torch.allclose(p.grad, r.grad, rtol=2e-2, atol=1e-3):
                bad.append(f"{name}: gradients far from uncompressed averaging")
                break

    # Misuse is named.
    m = c10d_ext.DistributedDataParallel(make_model("mlp"))
    m.register_comm_hook(None, c10d_ext.hooks.allreduce_hook)
    for what, fn in [("twice", lambda: m.register_comm_hook(None, c10d_ext.hooks.allreduce_hook)),
                     ("bad signature", lambda: c10d_ext.DistributedDataParallel(make_model("mlp"))
                      .register_comm_hook(None, lambda bucket: None))]:
        try:
            fn()
            bad.append(f"register_comm_hook {what}: no error")
        except (RuntimeError, ValueError):
            pass
    m = c10d_ext.DistributedDataParallel(make_model("mlp"))
    m.register_comm_hook(None, lambda state, bucket: bucket.buffer())  # not a Future
    err = _expect_error(m(x).sum().backward, "torch.futures.Future")
    if err:
        bad.append(f"hook returning a tensor: {err}")
    m = c10d_ext.DistributedDataParallel(make_model("mlp"))
    m(x).sum().backward()
    err = _expect_error(lambda: m.register_comm_hook(None, c10d_ext.hooks.allreduce_hook), "before the first backward")
    if err:
        bad.append(f"late hook: {err}")
    return bad


@one_thread
def body_join_buffers_sparse(ctx):
    import c10d_ext

    ctx.init("myccl")
    bad = []
    r, n = ctx.rank, ctx.size

    # join(): rank r has 2 + r batches. Same result as torch's DDP under its join(), and every
    # rank ends with the same model; with divide_by_initial_world_size=False as well.
    for divide in (True, False):
        models = []
        for impl in ("ours", "torch"):
            cls = c10d_ext.DistributedDataParallel if impl == "ours" else torch.nn.parallel.DistributedDataParallel
            m = cls(make_model("conv"), bucket_cap_mb=SMALL)
            opt = torch.optim.SGD(m.parameters(), lr=0.05)
            with m.join(divide_by_initial_world_size=divide):
                for step in range(2 + r):
                    opt.zero_grad()
                    x, y = batch("conv", r, step, 0)
                    F.mse_loss(m(x), y).backward()
                    opt.step()
            models.append(m.module)
            if not _params_equal_everywhere(m.module):
                bad.append(f"join({impl}, divide={divide}): ranks end with different models")
        for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
            if not torch.equal(a, b):
                bad.append(f"join(divide={divide}): {name} differs from torch's DDP")
                break

    # Buffers: broadcast from rank 0 before each forward (and at construction); not when off.
    torch.manual_seed(r)  # different initial weights per rank: construction makes them rank 0's
    m = c10d_ext.DistributedDataParallel(ConvNet())
    if not _params_equal_everywhere(m.module):
        bad.append("init_sync did not give every rank rank 0's parameters")
    m(torch.randn(4, 3, 8, 8) + r)  # training forward: BatchNorm statistics now differ per rank
    got = [torch.empty(8) for _ in range(n)]
    dist.all_gather(got, m.module.bn.running_mean.clone())
    if torch.equal(got[0], got[1]):
        bad.append("running stats did not differ after a training forward; the check proves nothing")
    m.eval()
    m(torch.randn(4, 3, 8, 8))  # starts by taking rank 0's buffers; eval leaves them as they are
    dist.all_gather(got, m.module.bn.running_mean.clone())
    if not all(torch.equal(t, got[0]) for t in got):
        bad.append("the forward did not broadcast rank 0's buffers")
    m2 = c10d_ext.DistributedDataParallel(ConvNet(), broadcast_buffers=False)
    m2(torch.randn(4, 3, 8, 8) + r)
    m2.eval()
    m2(torch.randn(4, 3, 8, 8))
    dist.all_gather(got, m2.module.bn.running_mean.clone())
    if torch.equal(got[0], got[1]):
        bad.append("broadcast_buffers=False still synchronised the buffers")

    # Sparse gradients: an nn.Embedding(sparse=True) gets a bucket of its own; same result as
    # torch's DDP.
    class SparseNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 6, sparse=True)
            self.fc = nn.Linear(6, 2)

        def forward(self, idx):
            return self.fc(self.emb(idx).mean(1))

    res = []
    for cls in (c10d_ext.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        m = cls(SparseNet())
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            idx = torch.randint(0, 30, (4, 3), generator=torch.Generator().manual_seed(10 * r + step))
            m(idx).sum().backward()
            opt.step()
        res.append([p.detach().clone() for p in m.parameters()])
        if cls is c10d_ext.DistributedDataParallel:
            plan = m.reducer.bucket_plan()
            if [0] not in plan:
                bad.append(f"the sparse embedding does not have a bucket of its own: {plan}")
            if not m.module.emb.weight.grad.is_sparse:
                bad.append("the embedding's gradient is no longer sparse")
    if not all(torch.equal(a, b) for a, b in zip(*res)):
        bad.append("sparse: parameters differ from torch's DDP")

    # Construction check: rank 1's last layer has another shape.
    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5 if r == 1 else 4))
    err = _expect_error(lambda: c10d_ext.DistributedDataParallel(odd), "'1.weight'", "[5, 4]", "[4, 4]", "rank 1")
    if err:
        bad.append(f"shape check: {err}")
    extra = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2 + (r == 1))])
    needles = ("index 4", "no such parameter") + (("'2.weight'",) if r == 1 else ())
    err = _expect_error(lambda: c10d_ext.DistributedDataParallel(extra), *needles)
    if err:
        bad.append(f"count check: {err}")
    return bad


def test_comm_hooks(run):
    for rank, bad in enumerate(run(2, body_hooks, timeout=120)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_join_buffers_sparse_param_check(run):
    for rank, bad in enumerate(run(3, body_join_buffers_sparse, timeout=180)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_arguments_are_checked():
    import c10d_ext

    with pytest.raises(RuntimeError, match="init_process_group"):
        c10d_ext.DistributedDataParallel(MLP())


# ---- CUDA (NCCL through the same public API) -------------------------------------------------


@one_thread
def body_cuda(ctx):
    ctx.init("nccl")
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    bad = []
    for cfg in ("plain", "grad_view", "fp16_hook", "find_unused"):
        bad += compare_with_torch_cuda(ctx, cfg)
    return bad


def compare_with_torch_cuda(ctx, cfg):
    import c10d_ext

    kw, micro, set_to_none, hook = CONFIGS[cfg]
    dev = torch.device("cuda", torch.cuda.current_device())
    ours = c10d_ext.DistributedDataParallel(make_model("mlp").to(dev), device_ids=[dev.index], **kw)
    theirs = torch.nn.parallel.DistributedDataParallel(make_model("mlp").to(dev), device_ids=[dev.index], **kw)
    if hook:
        ours.register_comm_hook(None, our_hook(hook))
        theirs.register_comm_hook(None, torch_hook(hook))
    bad = []
    for step in range(3):
        for m in (ours, theirs):
            m.zero_grad()
            x, y = batch("mlp", ctx.rank, step, 0)
            F.mse_loss(m(x.to(dev)), y.to(dev)).backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            if not torch.equal(p.grad, q.grad):
                bad.append(f"cuda {cfg} step {step}: gradients differ")
                break
    return bad


@pytest.mark.cuda
def test_cuda_nccl_equivalence(run):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for rank, bad in enumerate(run(2, body_cuda, timeout=180)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_scaled_sum_kernel_is_scaling_then_summing():
    """The kernel behind the reducer's fused average: sum(round(x_q * s)) in input order, bit
    for bit what torch computes by scaling each input first (no FMA contraction), for
    float32/float64, 1-4 inputs, lengths around the vector and block widths; anything else
    is refused."""
    from c10d_ext import _C

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        for n in (1, 2, 3, 4):
            for numel in (1, 7, 16, 1000, 4097):
                ins = [torch.randn(numel, generator=g, dtype=torch.float64).to(dtype) * 1e3 for _ in range(n)]
                for scale in (0.5, 0.25, 0.1):
                    want = ins[0] * scale
                    for x in ins[1:]:
                        want = want + x * scale
                    out = torch.empty(numel, dtype=dtype)
                    _C._reduce_kernel(ins, out, "sum", 0, scale)
                    assert torch.equal(out, want), (dtype, n, numel, scale)
    with pytest.raises(Exception, match="scaled sum"):
        _C._reduce_kernel([torch.ones(4, dtype=torch.bfloat16)] * 2, torch.empty(4, dtype=torch.bfloat16), "sum", 0, 0.5)
    with pytest.raises(Exception, match="scaled sum"):
        _C._reduce_kernel([torch.ones(4)] * 2, torch.empty(4), "max", 0, 0.5)


def body_fused_disagreement(ctx):
    """Ranks that disagree on folding the average into the reduction get an error naming the
    disagreement, never silently different sums."""
    import c10d_ext

    ctx.init("myccl", timeout=20)
    torch.manual_seed(0)
    ddp = c10d_ext.DistributedDataParallel(MLP(), gradient_as_bucket_view=True)
    ddp.reducer.set_fused_average(ctx.rank != 0)
    try:
        ddp(torch.randn(3, 12)).sum().backward()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_ranks_disagreeing_on_the_fused_average_get_an_error(run):
    msgs = run(2, body_fused_disagreement, timeout=60)
    assert any("disagree" in m or "while this rank runs" in m or "expects" in m for m in msgs), msgs
