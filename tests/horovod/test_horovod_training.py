"""c10d_ext.horovod, the training side: compression, the helper functions (broadcast_parameters,
broadcast_optimizer_state, broadcast_object, allgather_object), DistributedOptimizer (plain,
grouped, accumulating, predivided, compressed, sparse, with unused parameters, the Adasum
variant). SyncBatchNorm: tests/horovod/test_horovod_sync_bn.py; the elastic API: tests/horovod/test_horovod_elastic.py.

Every multi-rank check compares a rank's result with what a single process computes locally
(the same model on the whole batch); messages and exception types are Horovod 0.28.1's.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import c10d_ext.horovod as hvd
from harness import assert_reports
from hvd_helpers import batches, close, expect_raise, hvd_body, mlp, state_close

STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                   "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                   "your code.")
ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                  "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to "
                   "step(). Increase backward_passes_per_step to accumulate gradients locally.")


# ---- rank-body plumbing ----------------------------------------------------------------------

def same_object(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_object(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_object(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def shard(t, rank, size):
    k = t.shape[0] // size
    return t[rank * k:(rank + 1) * k]


# ---- models and data -------------------------------------------------------------------------

def bn_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


class Branchy(nn.Module):
    """`extra` takes part only when the caller says so (a parameter unused on some ranks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3).double()
        self.extra = nn.Linear(5, 3).double()

    def forward(self, x, use_extra):
        out = self.fc(x)
        return out + self.extra(x) if use_extra else out


class EmbedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=True).double()
        self.fc = nn.Linear(4, 3).double()

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


class Counting(torch.optim.Optimizer):
    """An optimizer whose per-parameter state mixes tensors and plain Python values."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                st["scale"] = float(p.grad.abs().sum())
                st["trace"] = st.get("trace", torch.zeros_like(p)) + p.grad
                p.add_(p.grad, alpha=-group["lr"])


# ---- compression (no ranks) --------------------------------------------------------------------

def test_compression_round_trips():
    from c10d_ext.horovod.compression import Compression, Compressor, FP16Compressor, NoneCompressor

    assert hvd.Compression is Compression
    assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor
    assert issubclass(NoneCompressor, Compressor) and issubclass(FP16Compressor, Compressor)
    x = torch.randn(7, 3)
    assert Compressor.compress(x) is None and Compressor.decompress(x, None) is None

    c, ctx = Compression.none.compress(x)
    assert c is x and ctx is None and Compression.none.decompress(c, ctx) is x

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = (torch.randn(6, 5, generator=torch.Generator().manual_seed(2)) * 100).to(dtype)
        c, ctx = Compression.fp16.compress(t)
        assert c.dtype == torch.float16 and ctx == dtype
        assert torch.equal(c, t.to(torch.float16))
        back = Compression.fp16.decompress(c, ctx)
        assert back.dtype == dtype and torch.equal(back, t.to(torch.float16).to(dtype))
        assert torch.equal(t, (torch.randn(6, 5, generator=torch.Generator().manual_seed(2)) * 100).to(dtype))
    for dtype in (torch.int32, torch.int64, torch.uint8):
        t = torch.arange(12, dtype=dtype)
        c, ctx = Compression.fp16.compress(t)
        assert c is t and ctx == dtype and Compression.fp16.decompress(c, ctx) is c


# ---- broadcast_parameters ----------------------------------------------------------------------

@hvd_body
def _body_broadcast_parameters(ctx, rep):
    root = ctx.size - 1
    m = bn_model(ctx.rank)
    m(torch.randn(6, 4)).sum().backward()  # some BN running stats and num_batches_tracked
    hvd.broadcast_parameters(m.state_dict(), root_rank=root)
    want = bn_model(root)  # the same seed: the root's parameters, and its buffers after the same forward
    want(torch.randn(6, 4))
    sd, wd = m.state_dict(), want.state_dict()
    rep.check(sd.keys() == wd.keys(), "state_dict keys")
    for k in wd:
        rep.check(torch.equal(sd[k], wd[k]) and sd[k].dtype == wd[k].dtype, f"dict: {k} is the root's")

    m2 = mlp(100 + ctx.rank)
    hvd.broadcast_parameters(list(m2.named_parameters()), root_rank=0)
    close(rep, m2.parameters(), mlp(100).parameters(), "list of (name, tensor)", 0, 0)

    m3 = mlp(200 + ctx.rank)
    hvd.broadcast_parameters(list(m3.parameters()), root_rank=root)
    close(rep, m3.parameters(), mlp(200 + root).parameters(), "list of tensors", 0, 0)

    mixed = [torch.full((3,), float(ctx.rank)), ("named.one", torch.full((2, 2), 10.0 + ctx.rank))]
    hvd.broadcast_parameters(mixed, root_rank=root)
    rep.check(torch.equal(mixed[0], torch.full((3,), float(root))), "mixed list: plain tensor")
    rep.check(torch.equal(mixed[1][1], torch.full((2, 2), 10.0 + root)), "mixed list: named tensor")

    expect_raise(rep, ValueError, "invalid params of type: <class 'generator'>",
                 lambda: hvd.broadcast_parameters(m2.parameters(), root_rank=0), "generator")
    expect_raise(rep, ValueError, "invalid params of type: <class 'generator'>",
                 lambda: hvd.broadcast_parameters(m2.named_parameters(), root_rank=0), "named generator")
    expect_raise(rep, ValueError, "invalid params of type: <class 'tuple'>",
                 lambda: hvd.broadcast_parameters(tuple(m2.parameters()), root_rank=0), "tuple")


def test_broadcast_parameters(run):
    assert_reports(run(2, _body_broadcast_parameters, timeout=120))


# ---- broadcast_optimizer_state -----------------------------------------------------------------

def stepped(make_opt, seed, steps):
    """A model (always the same start) and its optimizer after `steps` steps on data `seed`."""
    model = mlp(0)
    opt = make_opt(model.parameters())
    for x, y in batches(steps, seed=seed):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


@hvd_body
def _body_broadcast_optimizer_state(ctx, rep):
    r, root = ctx.rank, ctx.size - 1

    # Both states empty: initialised by a step on zero gradients, then the options broadcast.
    model = mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    rep.check(opt.param_groups[0]["lr"] == 0.1 * (root + 1), f"empty SGD: lr {opt.param_groups[0]['lr']}")
    rep.check(opt.param_groups[0]["momentum"] == 0.9, "empty SGD: momentum option")
    bufs = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    rep.check(all(b is not None and not b.any() for b in bufs), "empty SGD: zero momentum buffers")
    close(rep, model.parameters(), before, "empty SGD: parameters unchanged", 0, 0)

    # Real, rank-specific state: every rank ends with the root's (tensors and options).
    def sgd(params, rank=r):
        return torch.optim.SGD(params, lr=0.05 * (rank + 1), momentum=0.5 + 0.1 * rank, weight_decay=1e-3 * rank)

    _, opt = stepped(sgd, seed=r, steps=r + 1)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    state_close(rep, opt, stepped(functools.partial(sgd, rank=root), seed=root, steps=root + 1)[1], "SGD momentum")

    def adam(params, rank=r):
        return torch.optim.Adam(params, lr=1e-2 * (rank + 1), betas=(0.9 - 0.1 * rank, 0.99), eps=1e-8 * (rank + 1))

    _, opt = stepped(adam, seed=10 + r, steps=r + 2)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state_close(rep, opt, stepped(functools.partial(adam, rank=0), seed=10, steps=2)[1], "Adam")
    rep.check(opt.param_groups[0]["betas"] == (0.9, 0.99), f"Adam betas {opt.param_groups[0]['betas']}")

    # Non-tensor state values go through broadcast_object and back into the live state.
    def counting(params, rank=r):
        return Counting(params, lr=0.01 * (rank + 1))

    _, opt = stepped(counting, seed=20 + r, steps=r + 1)
    hvd.broadcast_optimizer_state(opt, root_rank=root)
    state_close(rep, opt, stepped(functools.partial(counting, rank=root), seed=20 + root, steps=root + 1)[1],
                "non-tensor state")
    p0 = next(iter(opt.param_groups[0]["params"]))
    rep.check(opt.state[p0]["count"] == root + 1, f"live state count {opt.state[p0]['count']}")

    # A stateless optimizer: nothing is sent, not even the options (Horovod returns early).
    opt = torch.optim.SGD(mlp(0).parameters(), lr=0.1 * (r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    rep.check(opt.param_groups[0]["lr"] == 0.1 * (r + 1), "stateless SGD keeps its own lr")

    # A DistributedOptimizer's empty state is initialised with the wrapped class's step (no reduction).
    model = mlp(0)
    dopt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9),
                                    named_parameters=model.named_parameters())
    dopt.synchronize = lambda: rep.fail("broadcast_optimizer_state reduced through DistributedOptimizer.step")
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    rep.check(dopt.param_groups[0]["lr"] == 0.1, "DistributedOptimizer: lr is rank 0's")
    rep.check(all("momentum_buffer" in dopt.state[p] for p in model.parameters()), "DistributedOptimizer: state")
    del dopt.synchronize

    # Sparse embeddings (model=): SparseAdam's state is initialised with sparse zero gradients.
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3 * (r + 1))
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=emb)
    st = opt.state[emb.weight]
    rep.check({"step", "exp_avg", "exp_avg_sq"} <= set(st), f"SparseAdam state {sorted(st)}")
    rep.check(opt.param_groups[0]["lr"] == 1e-3, "SparseAdam lr")
    emb2 = nn.Embedding(10, 3, sparse=True)  # SGD steps a sparse embedding with sparse zeros
    opt = torch.optim.SGD(emb2.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=emb2)
    rep.check(emb2.weight.grad is not None and emb2.weight.grad.is_sparse, "SGD + model=: sparse zero gradient")

    lbfgs = torch.optim.LBFGS(mlp(0).parameters())
    expect_raise(rep, ValueError, "cannot broadcast torch.optim.LBFGS state",
                 lambda: hvd.broadcast_optimizer_state(lbfgs, root_rank=0), "LBFGS")


def test_broadcast_optimizer_state(run):
    assert_reports(run(2, _body_broadcast_optimizer_state, timeout=150))


# ---- broadcast_object / allgather_object -------------------------------------------------------

def rank_object(r):
    return {"rank": r, "items": list(range(r * 50)), "t": torch.arange(r + 1, dtype=torch.float32),
            "nested": ("x" * r, {r: [r, None]})}


@hvd_body
def _body_objects(ctx, rep):
    obj = rank_object(ctx.rank)
    for root in range(ctx.size):
        got = hvd.broadcast_object(obj, root_rank=root)
        if ctx.rank == root:
            rep.check(got is obj, f"root {root}: the root gets its own object")
        else:
            rep.check(same_object(got, rank_object(root)), f"root {root}: the root's object")
    got = hvd.broadcast_object(obj)
    rep.check(got is obj if ctx.rank == 0 else same_object(got, rank_object(0)), "default root 0")
    got = hvd.broadcast_object(obj, root_rank=ctx.size - 1, name="custom.name")
    rep.check(ctx.rank == ctx.size - 1 or same_object(got, rank_object(ctx.size - 1)), "named broadcast")
    big = bytes(range(256)) * 4096 if ctx.rank == 0 else None
    rep.check(hvd.broadcast_object(big, root_rank=0, name="big") == bytes(range(256)) * 4096, "1 MiB object")

    gathered = hvd.allgather_object(obj)
    rep.check(isinstance(gathered, list) and len(gathered) == ctx.size, f"allgather_object: {len(gathered)} items")
    rep.check(all(same_object(g, rank_object(i)) for i, g in enumerate(gathered)), "allgather_object: rank order")
    gathered = hvd.allgather_object(ctx.rank * 7, name="ints")
    rep.check(gathered == [i * 7 for i in range(ctx.size)], f"allgather_object named: {gathered}")
    gathered = hvd.allgather_object(None)
    rep.check(gathered == [None] * ctx.size, "allgather_object of None")


def test_broadcast_object_and_allgather_object(run):
    assert_reports(run(3, _body_objects, timeout=120))


# ---- DistributedOptimizer against one process on the whole batch -------------------------------

def make_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_adam(params):
    return torch.optim.Adam(params, lr=0.01)


def reference_run(make_opt, data, passes=1, clip=None, loss_scale=1.0):
    model = mlp(0)
    opt = make_opt(model.parameters())
    for x, y in data:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
            (F.mse_loss(model(xm), ym) * loss_scale).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach() for p in model.parameters()]


def hvd_run(ctx, make_opt, data, passes=1, clip=None, kwargs=None, named=True):
    model = mlp(0)
    kw = kwargs(model) if callable(kwargs) else dict(kwargs or {})
    if named:
        kw["named_parameters"] = model.named_parameters()
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), backward_passes_per_step=passes, **kw)
    for x, y in data:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(passes), y.chunk(passes)):
            F.mse_loss(model(shard(xm, ctx.rank, ctx.size)), shard(ym, ctx.rank, ctx.size)).backward()
        if clip is not None:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return [p.detach() for p in model.parameters()], opt


@hvd_body
def _body_optimizer_matches(ctx, rep):
    data = batches(3)
    cases = [
        ("named", make_sgd, {}, {}, True),
        ("auto names", make_sgd, {}, {}, False),
        ("adam", make_adam, {}, {}, True),
        ("backward_passes_per_step=2", make_sgd, {"passes": 2}, {}, True),
        ("groups=2", make_sgd, {}, {"groups": 2}, True),
        ("groups=list", make_sgd, {}, lambda m: {"groups": [[m[0].weight, m[2].weight]]}, True),
        ("groups=list unnamed", make_sgd, {}, lambda m: {"groups": [[m[2].bias, m[0].bias]]}, False),
        ("gradient_predivide_factor", make_sgd, {}, {"gradient_predivide_factor": 4.0}, True),
        ("op=Sum", make_sgd, {"loss_scale": float(ctx.size)}, {"op": hvd.Sum}, True),
        ("synchronize+clip", make_sgd, {"clip": 0.05}, {}, True),
    ]
    for what, make_opt, ref_kw, kw, named in cases:
        got, opt = hvd_run(ctx, make_opt, data, passes=ref_kw.get("passes", 1), clip=ref_kw.get("clip"),
                           kwargs=kw, named=named)
        want = reference_run(make_opt, data, **ref_kw)
        close(rep, got, want, what)
        rep.check(type(opt).__name__ == make_opt(mlp(0).parameters()).__class__.__name__, f"{what}: class name")
    rep.check(isinstance(opt, torch.optim.SGD) and type(opt).__module__ == "c10d_ext.horovod.optimizer",
              f"generated class: {type(opt).__mro__}, module {type(opt).__module__}")

    # fp16 compression: each rank's gradient travels as float16.
    got, _ = hvd_run(ctx, make_sgd, data, kwargs={"compression": hvd.Compression.fp16})
    close(rep, got, reference_run(make_sgd, data), "fp16 compression", rtol=2e-3, atol=2e-3)

    # num_groups: the deprecated spelling of groups.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got, _ = hvd_run(ctx, make_sgd, data, kwargs={"num_groups": 2})
    rep.check(any(issubclass(x.category, DeprecationWarning) and str(x.message) ==
                  "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0."
                  for x in w), f"num_groups warning: {[str(x.message) for x in w]}")
    close(rep, got, reference_run(make_sgd, data), "num_groups=2")

    # A parameter used only on rank 0: the others contribute zeros (synchronize fills them in).
    model = Branchy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref = Branchy()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(shard(x, ctx.rank, ctx.size), ctx.rank == 0), shard(y, ctx.rank, ctx.size)).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(F.mse_loss(ref(shard(x, q, ctx.size), q == 0), shard(y, q, ctx.size))
            for q in range(ctx.size)).div(ctx.size).backward()
        ref_opt.step()
    close(rep, model.parameters(), ref.parameters(), "parameter unused on some ranks")


@hvd_body
def _body_optimizer_sparse(ctx, rep):
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 20, (12, 3), generator=g), torch.randn(12, 3, generator=g).double())
            for _ in range(3)]
    ref = EmbedNet()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in data:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for as_dense in (False, True):
        model = EmbedNet()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), sparse_as_dense=as_dense)
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(shard(x, ctx.rank, ctx.size)), shard(y, ctx.rank, ctx.size)).backward()
            opt.step()
            rep.check(model.emb.weight.grad.is_sparse, f"sparse_as_dense={as_dense}: gradient stays sparse")
        close(rep, model.parameters(), ref.parameters(), f"sparse embedding, sparse_as_dense={as_dense}")


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_matches_one_process(run, size):
    assert_reports(run(size, _body_optimizer_matches, timeout=240))


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_sparse_gradients(run, size):
    assert_reports(run(size, _body_optimizer_sparse, timeout=120))


@hvd_body
def _body_optimizer_protocol(ctx, rep):
    data = batches(2)
    x, y = shard(data[0][0], ctx.rank, ctx.size), shard(data[0][1], ctx.rank, ctx.size)

    # step() after an explicit synchronize() warns; inside skip_synchronize() it does not.
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for use_skip in (False, True):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.synchronize()
            if use_skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        texts = [str(m.message) for m in w]
        rep.check((STEP_AFTER_SYNC in texts) != use_skip, f"skip_synchronize={use_skip}: warnings {texts}")

    # zero_grad() between backward() and step() is refused; step() then completes the reduction.
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    expect_raise(rep, AssertionError, ZERO_GRAD_RACE, opt.zero_grad, "zero_grad before step")
    opt.step()
    opt.zero_grad()
    expect_raise(rep, TypeError, None, lambda: opt.zero_grad(set_to_none=True), "zero_grad(set_to_none)")

    # A second backward pass with backward_passes_per_step=1 is refused in the hook.
    m2 = mlp(0)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=m2.named_parameters())
    F.mse_loss(m2(x), y).backward()
    expect_raise(rep, AssertionError, TOO_MANY_PASSES, lambda: F.mse_loss(m2(x), y).backward(), "two passes")
    opt2.synchronize()

    # set_backward_passes_per_step and load_state_dict reset the accumulation counters.
    m3 = mlp(0)
    ref = mlp(0)
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.1),
                                    named_parameters=m3.named_parameters())
    opt3.set_backward_passes_per_step(2)
    rep.check(opt3.backward_passes_per_step == 2, "set_backward_passes_per_step")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for xb, yb in data:
        opt3.zero_grad()
        ref_opt.zero_grad()
        for xm, ym in zip(xb.chunk(2), yb.chunk(2)):
            F.mse_loss(m3(shard(xm, ctx.rank, ctx.size)), shard(ym, ctx.rank, ctx.size)).backward()
            F.mse_loss(ref(xm), ym).backward()
        opt3.step()
        ref_opt.step()
    close(rep, m3.parameters(), ref.parameters(), "set_backward_passes_per_step(2)")
    opt3.load_state_dict(opt3.state_dict())
    rep.check(opt3._handles == {} and all(v == 2 for v in opt3._allreduce_delay.values()), "load_state_dict resets")

    # Attributes Horovod exposes.
    rep.check((opt3.op, opt3.gradient_predivide_factor, opt3.sparse_as_dense, opt3.process_set) ==
              (hvd.Average, 1.0, False, hvd.global_process_set), "attributes")
    rep.check(opt3.find_duplicates(["a", "b", "a", "c", "b"]) == {"a", "b"}, "find_duplicates")

    # Misuse.
    m = mlp(0)
    ps = list(m.parameters())

    def dopt(**kw):
        kw.setdefault("named_parameters", m.named_parameters())
        return lambda: hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), **kw)

    groups_text = "groups should be a non-negative integer or a list of list of torch.Tensor."
    cases = [
        (ValueError, "gradient_predivide_factor not supported with op != Average",
         dopt(gradient_predivide_factor=2.0, op=hvd.Sum)),
        (ValueError, "backward_passes_per_step must be > 0", dopt(backward_passes_per_step=0)),
        (ValueError, "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
         "model.named_parameters().", dopt(named_parameters=ps)),
        (ValueError, "Parameter names in named_parameters must be unique. Found duplicates: w",
         dopt(named_parameters=[("w", ps[0]), ("w", ps[1]), ("a", ps[2]), ("b", ps[3])])),
        (ValueError, "named_parameters was specified, but one or more model parameters were not named. "
         "Python object ids: %s" % id(ps[3]), dopt(named_parameters=list(m.named_parameters())[:3])),
        (ValueError, groups_text, dopt(groups=-1)),
        (ValueError, groups_text, dopt(groups=0)),
        (ValueError, "groups must consist of torch.Tensor.", dopt(groups=[[1.0]])),
        (ValueError, "A parameter can only appear once in groups.", dopt(groups=[[ps[0]], [ps[1], ps[0]]])),
    ]
    if ctx.size & (ctx.size - 1) == 0:
        cases.append((NotImplementedError, "Adasum does not support non-global process sets yet.",
                      dopt(op=hvd.Adasum, process_set=hvd.ProcessSet([0]))))
    for i, (exc, text, fn) in enumerate(cases):
        expect_raise(rep, exc, text, fn, f"misuse case {i}")


@pytest.mark.parametrize("size", [2, 3])
def test_distributed_optimizer_protocol_and_misuse(run, size):
    assert_reports(run(size, _body_optimizer_protocol, timeout=150))


@hvd_body
def _body_one_rank(ctx, rep):
    # One rank: no hooks, the optimizer is the local one (Adasum included, as in Horovod).
    data = batches(3)
    for op in (hvd.Average, hvd.Adasum):
        got, opt = hvd_run(ctx, make_sgd, data, kwargs={"op": op})
        close(rep, got, reference_run(make_sgd, data), f"one rank, op={op}")
        rep.check(type(opt).__name__ == "SGD" and opt._handles == {}, "one rank: plain wrapper")


def test_distributed_optimizer_one_rank(run):
    assert_reports(run(1, _body_one_rank, timeout=90))


# ---- the Adasum optimizer ------------------------------------------------------------------------

def adasum_pair(a, b):
    """Adasum of two ranks' tensors, from c10d_ext.horovod.adasum when it is there."""
    try:
        from c10d_ext.horovod.adasum import adasum_reference
    except ImportError:
        a64, b64 = a.double().flatten(), b.double().flatten()
        dot, na, nb = a64 @ b64, a64 @ a64, b64 @ b64
        tiny = math.sqrt(2.2250738585072014e-308)
        ca = 1.0 if na < tiny else 1.0 - dot / (2 * na)
        cb = 1.0 if nb < tiny else 1.0 - dot / (2 * nb)
        return (ca * a64 + cb * b64).to(a.dtype).view_as(a)
    return adasum_reference([a.flatten(), b.flatten()], [a.numel()]).view_as(a)


@hvd_body
def _body_adasum_optimizer(ctx, rep):
    data = batches(3)
    lr = 0.1
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    rep.check(type(opt).__name__ == "SGD" and isinstance(opt, torch.optim.SGD), "Adasum: class")
    ref = [p.detach().clone() for p in model.parameters()]
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(shard(x, ctx.rank, ctx.size)), shard(y, ctx.rank, ctx.size)).backward()
        opt.step()
        # each rank's local SGD delta on its shard, combined with Adasum per tensor
        deltas = []
        for q in range(ctx.size):
            local = mlp(0)
            with torch.no_grad():
                for lp, v in zip(local.parameters(), ref):
                    lp.copy_(v)
            F.mse_loss(local(shard(x, q, ctx.size)), shard(y, q, ctx.size)).backward()
            deltas.append([-lr * lp.grad for lp in local.parameters()])
        ref = [v + adasum_pair(d0, d1) for v, d0, d1 in zip(ref, deltas[0], deltas[1])]
    close(rep, model.parameters(), ref, "Adasum optimizer", rtol=1e-9, atol=1e-12)

    rep.check(opt.synchronize() is None, "Adasum synchronize() does nothing")

    def enter_skip():
        with opt.skip_synchronize():
            pass

    expect_raise(rep, AssertionError, "Skipping synchronization is not supported when using Adasum optimizer.",
                 enter_skip, "Adasum skip_synchronize")
    opt.zero_grad()
    F.mse_loss(model(shard(data[0][0], ctx.rank, ctx.size)), shard(data[0][1], ctx.rank, ctx.size)).backward()
    expect_raise(rep, AssertionError, ZERO_GRAD_RACE, opt.zero_grad, "Adasum zero_grad before step")
    opt.step()


def test_adasum_optimizer(run):
    assert_reports(run(2, _body_adasum_optimizer, timeout=120))
