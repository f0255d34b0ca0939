"""What the whole-memory tests share: the table every rank writes its part of, and for the
embedding tests the start-up, the table's fill, error expectations, and the training run checked
step by step against wg_embedding_ref's one-process reference (a body that the CPU and the CUDA
tests both run)."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from harness import Report, one_thread
from wg_embedding_ref import CONFIGS, DIM, HOT, LR, ROWS, STATES, Reference, batch, close, init_table, weights


def _reference(rows: int, rest: tuple, dtype) -> torch.Tensor:
    """What the whole table holds after every rank wrote its part: row i is i*1000 + column."""
    cols = 1
    for d in rest:
        cols *= d
    t = torch.arange(rows, dtype=torch.float64).unsqueeze(1) * 1000 + torch.arange(cols, dtype=torch.float64)
    return t.view((rows,) + rest).to(dtype)


# ---- trainable embeddings -----------------------------------------------------------------------

TYPES = ["continuous", "chunked", "distributed"]
STEPS = 3


def start(ctx, mode: str = "cpu", local_size: int | None = None):
    """The default group, pylibwholegraph's init and its global communicator (on the CUDA double:
    this rank's simulated device selected). local_size: ranks per simulated node (all of them)."""
    import c10d_ext.wholememory as wgth

    wgth.finalize()  # what an earlier call in this process may have left
    ctx.init(timeout=60)
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % 2)
    local_size = local_size or ctx.size
    wgth.init(ctx.rank, ctx.size, ctx.rank % local_size, local_size)
    return wgth, wgth.get_global_communicator()


def fill(emb, table: torch.Tensor) -> None:
    """Each rank writes its own rows of the table (then every rank waits for all)."""
    local, first = emb.get_embedding_tensor().get_local_tensor()
    local.copy_(table[first:first + local.shape[0]].to(local.device))
    emb.wmb_embedding.comm.barrier()


def expect(rep, what, fn, exc, *texts):
    """fn() raises exc, its message holding every text."""
    rep.checks += 1
    try:
        fn()
    except exc as e:
        missing = [t for t in texts if t not in str(e)]
        if missing:
            rep.failures.append(f"rank {rep.rank}: {what}: {type(e).__name__}({e}) lacks {missing}")
        return
    except Exception as e:  # noqa: BLE001
        rep.failures.append(f"rank {rep.rank}: {what}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        return
    rep.failures.append(f"rank {rep.rank}: {what}: nothing raised")


def on_one_rank(rep, what, fn, bad_rank, exc, texts, collective):
    """fn() fails on bad_rank with exc naming texts; for a collective op the others raise too,
    naming bad_rank; otherwise they succeed."""
    if rep.rank == bad_rank:
        expect(rep, what, fn, exc, f"(rank {bad_rank})", *texts)
    elif collective:
        expect(rep, what + " (a peer's bad input)", fn, Exception, f"rank {bad_rank}")
    else:
        fn()


def uneven(rows, n):
    """A partition other than the equal one (a rank with none at n = 3)."""
    return {1: [rows], 2: [rows - 3, 3], 3: [rows - 5, 0, 5]}.get(n, None)


def parts(rows, n, partition):
    """(first row, rows) of each rank under `partition` (None: the equal one)."""
    counts = partition or [min(rows, (i + 1) * -(-rows // n)) - min(rows, i * -(-rows // n)) for i in range(n)]
    return [(sum(counts[:i]), c) for i, c in enumerate(counts)]


def train_and_check(rep, wgth, emb, kind, params, n, steps=STEPS, what="", rows=ROWS, state_rows=None):
    """STEPS steps through the module (every rank its batch), each lookup and the end state
    against the reference; returns the reference and the optimizer. state_rows: where the states
    hold row i (round-robin sharding places rows, the table's lookups map them)."""
    r = rep.rank
    table = init_table(rows)
    ref = Reference(kind, params, table)
    opt = wgth.create_wholememory_optimizer(emb, kind, params)
    rep.check(emb.get_optimizer_state_names() == STATES[kind], f"{what} state names {emb.get_optimizer_state_names()}")
    module = wgth.WholeMemoryEmbeddingModule(emb)
    for step in range(steps):
        ids = batch(step, r)
        out = module(ids)
        rep.check(out.requires_grad and close(out, ref.w[ids]), f"{what} step {step}: lookup")
        (out * weights(step, r, ids.numel())).sum().backward()
        opt.step(LR)
        ref.train_step(step, n)
    every = torch.arange(rows)
    got = emb.gather(every)
    rep.check(close(got, ref.w), f"{what}: table after {steps} steps, largest difference "
              f"{(got.double() - ref.w).abs().max().item():.3g}")
    rep.check(torch.equal(got[HOT:], table[HOT:]), f"{what}: untouched rows changed")
    for name in STATES[kind]:
        st = emb.get_optimizer_state(name).gather(every if state_rows is None else state_rows)
        rep.check(close(st, ref.states[name]), f"{what}: state {name}")
        if kind == "adam":  # lazy: an untouched row's state is as it began
            rep.check(torch.equal(st[HOT:], torch.full_like(st[HOT:], 1.0 if name == "beta12t" else 0.0)),
                      f"{what}: untouched rows' {name} changed")
    return ref, opt


@one_thread
def body_optimizers(ctx, memory_type, location, mode):
    wgth, comm = start(ctx, mode)
    rep = Report(ctx)
    if mode == "double":
        import cuda_double

        before = cuda_double.counters()
    for kind, params in CONFIGS:
        emb = wgth.create_embedding(comm, memory_type, location, torch.float32, [ROWS, DIM])
        fill(emb, init_table())
        _, opt = train_and_check(rep, wgth, emb, kind, params, ctx.size, what=f"{memory_type} {kind} {params}")
        wgth.destroy_wholememory_optimizer(opt)
        wgth.destroy_embedding(emb)
    if mode == "double":  # the exchanges ran on the CUDA engine, and broke none of CUDA's rules
        after = cuda_double.counters()
        rep.check(ctx.size == 1 or after.get("sends", 0) > before.get("sends", 0), f"no NCCL sends: {after}")
        rep.check(not cuda_double.violations(), f"violations on the double: {cuda_double.violations()}")
    wgth.finalize()
    return rep.result()


def _share(ctx, name):
    """A directory every rank of this call names alike."""
    path = os.path.join(tempfile.gettempdir(), f"wgemb-{os.getppid()}-{ctx.call_id}-{name}")
    os.makedirs(path, exist_ok=True)
    return path


def _unshare(ctx, path):
    dist.barrier()  # every rank is done with the files
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
