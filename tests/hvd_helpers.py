"""What the Horovod tests share: starting and stopping c10d_ext.horovod on a rank (on the CUDA
double too), each rank's inputs, the body wrapper that gives a Report, checks on tensors and
optimizer states, the small model and its data, and the elastic training run that the elastic
tests (in-process, under the launcher, and with hosts leaving) all check against one process."""

from __future__ import annotations

import functools
import json
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import c10d_ext.horovod as hvd
from c10d_ext.horovod import controller as _controller
from harness import Report, one_thread

_HEARTBEAT = _controller.HEARTBEAT_SECONDS  # the product's, put back by stop()


def start(ctx, **kw):
    import os

    if os.environ.get("MYCCL_TEST_CUDA_DOUBLE") == "1":  # each thread that issues CUDA work selects a device
        import cuda_double

        import c10d_ext.horovod.controller as C

        cuda_double.set_device(ctx.rank)
        C.THREAD_INIT[:] = [lambda: cuda_double.set_device(ctx.rank)]
    ctx.init()
    hvd.init(**kw)
    return hvd


def quiet_heartbeat():
    """For tests that count a set's cycles or ops exactly: no heartbeat cycle (which an idle set
    runs once a second) lands among them. stop() turns it back on."""
    import c10d_ext.horovod.controller as C

    C.HEARTBEAT_SECONDS = float("inf")


def stop(hvd):
    import c10d_ext.horovod.controller as C

    hvd.shutdown()
    C.THREAD_INIT.clear()
    C.HEARTBEAT_SECONDS = _HEARTBEAT
    if dist.is_initialized():
        dist.destroy_process_group()


def value(r: int, dtype, shape=(5,), salt=0):
    """Rank r's input: small integers so that every dtype holds the exact result."""
    n = 1
    for d in shape:
        n *= d
    base = (torch.arange(n) % 3 + r + 1 + salt).reshape(shape)
    return base.to(dtype)


# ---- rank bodies and checks ------------------------------------------------------------------

def hvd_body(fn):
    """fn(ctx, rep, *args) on every rank between ctx.init(); hvd.init() and hvd.shutdown();
    dist.destroy_process_group(); returns the rank's Report result."""

    @functools.wraps(fn)
    def body(ctx, *args):
        rep = Report(ctx)
        ctx.init()
        hvd.init()
        try:
            fn(ctx, rep, *args)
        finally:
            try:
                hvd.shutdown()
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        return rep.result()

    return one_thread(body)


def expect_raise(rep, exc_type, text, fn, what):
    """fn() raises exc_type whose str is `text` (any text if None)."""
    try:
        fn()
    except exc_type as e:
        rep.check(text is None or str(e) == text, f"{what}: message {str(e)!r}, expected {text!r}")
        return
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{what}: expected {exc_type.__name__}, got {type(e).__name__}: {e}")
        return
    rep.fail(f"{what}: expected {exc_type.__name__}, nothing raised")


def close(rep, got, want, what, rtol=1e-9, atol=1e-11):
    got, want = list(got), list(want)
    if not rep.check(len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"):
        return
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.detach().to_dense() if a.is_sparse else a.detach()
        b = b.detach().to_dense() if b.is_sparse else b.detach()
        ok = a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=rtol, atol=atol)
        diff = (a.double() - b.double()).abs().max().item() if a.shape == b.shape and a.numel() else None
        rep.check(ok, f"{what}[{i}]: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}, max diff {diff}")


def state_close(rep, got_opt, want_opt, what):
    got, want = got_opt.state_dict(), want_opt.state_dict()
    if not rep.check(got["state"].keys() == want["state"].keys(), f"{what}: state keys"):
        return
    for pid, st in want["state"].items():
        g = got["state"][pid]
        if not rep.check(g.keys() == st.keys(), f"{what}: param {pid} state keys {sorted(g)} vs {sorted(st)}"):
            continue
        for k, v in st.items():
            if torch.is_tensor(v):
                close(rep, [g[k]], [v], f"{what}: param {pid} {k}", 0, 0)
            else:
                rep.check(g[k] == v and type(g[k]) is type(v), f"{what}: param {pid} {k}: {g[k]!r} vs {v!r}")
    for gg, wg in zip(got["param_groups"], want["param_groups"]):
        rep.check(gg == wg, f"{what}: param group {gg} vs {wg}")


# ---- models and data -------------------------------------------------------------------------

def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batches(steps, batch=12, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 5, generator=g).to(dtype), torch.randn(batch, 3, generator=g).to(dtype))
            for _ in range(steps)]


# ---- elastic training --------------------------------------------------------------------------

ELASTIC_GLOBAL_BATCH = 12  # divisible by every world size the job goes through (3, 2)
ELASTIC_SAMPLES = 96  # 8 steps


def elastic_data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(ELASTIC_SAMPLES, 5, generator=g).double(), torch.randn(ELASTIC_SAMPLES, 3, generator=g).double()


def elastic_reference(lr, momentum):
    """One process: the sampler's order, 12 samples a step, the whole epoch."""
    x, y = elastic_data()
    order = list(range(ELASTIC_SAMPLES))
    random.Random(0).shuffle(order)
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for k in range(ELASTIC_SAMPLES // ELASTIC_GLOBAL_BATCH):
        idx = order[k * ELASTIC_GLOBAL_BATCH:(k + 1) * ELASTIC_GLOBAL_BATCH]
        opt.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def elastic_training(hvd, result, hook_for=None, after_step=None) -> None:
    """The elastic training both multi-process tests run: DistributedOptimizer, TorchState and
    ElasticSampler, 12 samples a step over the world as it is, committing every 2 steps.
    `hook_for(model, state)` may return a hook handle to remove after the step's backward;
    `after_step(state)` runs after each step. Records steps, resets and the end in `result`."""
    lr, momentum = 0.1, 0.9
    x, y = elastic_data()
    model = mlp(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(list(range(ELASTIC_SAMPLES)), shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, batch=0)
    state.register_reset_callbacks([lambda: result["resets"].append(
        {"size": hvd.size(), "rank": hvd.rank(), "batch": state.batch})])

    @hvd.elastic.run
    def train(state):
        local = ELASTIC_GLOBAL_BATCH // hvd.size()
        mine = list(state.sampler)
        k = 0
        while state.batch < ELASTIC_SAMPLES // ELASTIC_GLOBAL_BATCH:
            idx = mine[k * local:(k + 1) * local]
            hook = hook_for(model, state) if hook_for is not None else None
            try:
                opt.zero_grad()
                F.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
            finally:
                if hook is not None:
                    hook.remove()
            result["steps"].append({"batch": state.batch, "size": hvd.size()})
            state.sampler.record_batch(k, local)
            state.batch += 1
            k += 1
            if state.batch % 2 == 0:
                state.commit()
            if after_step is not None:
                after_step(state)

    train(state)
    result.update(params=[p.detach().flatten().tolist() for p in model.parameters()],
                  reference=elastic_reference(lr, momentum), size=hvd.size(), new_rank=hvd.rank(),
                  sampler=dict(sampler.state_dict(), num_replicas=sampler.num_replicas))


def write_result(path: str, result: dict, error: BaseException | None) -> None:
    if error is not None:
        import traceback

        result["error"] = f"{type(error).__name__}: {error}\n{''.join(traceback.format_exception(error))}"
    with open(path, "w") as f:
        json.dump(result, f)


def same_as_one_process(res):
    import torch

    got = [torch.tensor(p, dtype=torch.float64) for p in res["params"]]
    want = [torch.tensor(p, dtype=torch.float64) for p in res["reference"]]
    return all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got, want))
