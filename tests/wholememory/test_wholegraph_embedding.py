"""pylibwholegraph.torch's trainable embeddings in c10d_ext.wholememory at 1-4 ranks on one host:
every optimizer against one process's implementation of WholeMemory's rules (several steps, rows
repeated within and across ranks, untouched rows and their state left alone), the module's
forward and backward, partitions and round-robin sharding, file lists, save / load, and every bad
input an error on every rank with the job going on. Caches, the CUDA double and the example are in
test_wholegraph_embedding_cache.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness import Report, assert_reports, one_thread
from wg_embedding_ref import DIM, LR, ROWS, STATES, Reference, batch, close, init_table, weights
from wm_helpers import TYPES, _share, _unshare, body_optimizers, expect, fill, start, train_and_check

@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_optimizers_against_one_process(run, size, memory_type):
    assert_reports(run(size, body_optimizers, memory_type, "cpu", "cpu", timeout=240))


@pytest.mark.parametrize("memory_type", ["chunked", "distributed"])
def test_optimizers_at_four_ranks(run, memory_type):
    assert_reports(run(4, body_optimizers, memory_type, "cpu", "cpu", timeout=300))


@one_thread
def body_module(ctx):
    """The module under a dense layer: forward is the table's rows, backward gives the dense
    layer the gradient one process would compute and the table (through sgd, lr 1) the sum of
    every rank's row gradients."""
    wgth, comm = start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    table = init_table()
    emb = wgth.create_embedding(comm, "distributed", "cpu", torch.float32, [ROWS, DIM])
    fill(emb, table)
    module = wgth.WholeMemoryEmbeddingModule(emb)
    module.eval()
    out = module(batch(0, r))
    rep.check(not out.requires_grad and not emb.need_apply, "eval mode: no gradient expected")
    rep.check(torch.equal(out, table[batch(0, r)]), "eval lookup")
    half = module(batch(0, r), force_dtype=torch.float16)
    rep.check(half.dtype == torch.float16 and torch.equal(half, table[batch(0, r)].half()), "force_dtype")
    opt = wgth.create_wholememory_optimizer(emb, "sgd", {})
    module.train()
    lin = torch.nn.Linear(DIM, 3).double()
    with torch.no_grad():
        lin.weight.copy_(torch.arange(3 * DIM, dtype=torch.float64).view(3, DIM) / 10)
        lin.bias.zero_()
    ids = batch(1, r)
    out = module(ids, force_dtype=torch.float64)
    (lin(out) ** 2).sum().backward()
    lin_ref = torch.nn.Linear(DIM, 3).double()
    lin_ref.load_state_dict(lin.state_dict())
    mine = table.double()[ids].clone().requires_grad_()
    (lin_ref(mine) ** 2).sum().backward()
    rep.check(torch.allclose(lin.weight.grad, lin_ref.weight.grad), "the dense layer's gradient")
    rep.check(len(emb.sparse_grads) == 1 and torch.allclose(emb.sparse_grads[0].double(), mine.grad),
              "the rows' gradients kept for the step")
    # one process: every rank's loss over the whole table
    full = table.double().clone().requires_grad_()
    total = sum((lin_ref(full[batch(1, q)]) ** 2).sum() for q in range(n))
    (full_grad,) = torch.autograd.grad(total, full)
    opt.step(1.0)
    got = emb.gather(torch.arange(ROWS))
    rep.check(close(got, table.double() - full_grad), "the table after one sgd step of lr 1 is minus the summed grads")
    rep.check(not emb.sparse_grads and not emb.need_apply, "gradients are used once")
    # a step with no lookup on any rank changes nothing; one with lookups on one rank only works
    opt.step(1.0)
    rep.check(torch.equal(emb.gather(torch.arange(ROWS)), got), "a step without gradients")
    ids = torch.tensor([0, 0, 1]) if r == 0 else torch.tensor([], dtype=torch.int64)  # (a collective lookup)
    out = emb.gather(ids, is_training=r == 0)
    if r == 0:
        rep.check(out.requires_grad and emb.need_apply, "gather(is_training=True)")
        emb.add_gradients(ids, torch.ones(3, DIM))
    opt.step(0.5)
    want = got.clone()
    want[0] -= 1.0
    want[1] -= 0.5
    rep.check(close(emb.gather(torch.arange(ROWS)), want), "a step with gradients from rank 0 alone")
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("size", [1, 2, 3])
def test_module_forward_backward(run, size):
    assert_reports(run(size, body_module, timeout=120))


def _uneven(n):
    return {1: [ROWS], 2: [ROWS - 20, 20], 3: [ROWS - 30, 0, 30], 4: [10, 0, ROWS - 30, 20]}[n]


@one_thread
def body_layouts(ctx, memory_type):
    """Rows per rank as embedding_entry_partition gives them, and round-robin sharding from a file
    list: the same training comes out."""
    wgth, comm = start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    table = init_table()
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM],
                                embedding_entry_partition=_uneven(n))
    local, first = emb.get_embedding_tensor().get_local_tensor()
    if memory_type != "continuous":
        rep.check((first, local.shape[0]) == (sum(_uneven(n)[:r]), _uneven(n)[r]), f"partition {first}+{local.shape}")
    fill(emb, table)
    train_and_check(rep, wgth, emb, "adam", {"weight_decay": 0.01}, n, what=f"{memory_type} partition")
    # round robin: blocks of 4 rows dealt to the ranks in turn, the table read from two files
    where = _share(ctx, "rr")
    files = [os.path.join(where, "a.bin"), os.path.join(where, "b.bin")]
    if r == 0:
        table[:31].numpy().tofile(files[0] + ".tmp")
        table[31:].numpy().tofile(files[1] + ".tmp")
        for f in files:
            os.replace(f + ".tmp", f)
    dist.barrier()
    for rr in (0, 4):
        emb2 = wgth.create_embedding_from_filelist(comm, memory_type, "cpu", files, torch.float32, DIM,
                                                   round_robin_size=rr)
        per = ROWS // (n * 4) * 4 + min(ROWS % (n * 4), 4)
        rep.check(emb2.shape[0] == (per * n if rr else ROWS), f"rr {rr}: shape {emb2.shape}")
        rep.check(torch.equal(emb2.gather(torch.arange(ROWS)), table), f"rr {rr}: rows read from the files")
        if rr:
            raw, first = emb2.get_embedding_tensor().get_local_tensor()
            block = (torch.arange(first, first + raw.shape[0]) % per) // 4 * n + r
            storage = block * 4 + torch.arange(first, first + raw.shape[0]) % 4
            mine = storage < ROWS
            rep.check(torch.equal(raw[mine], table[storage[mine]]), "rr: the storage rows this rank holds")
            s = torch.arange(ROWS)
            placed = (s // 4 % n) * per + s // 4 // n * 4 + s % 4
            train_and_check(rep, wgth, emb2, "adam", {}, n, what=f"{memory_type} round robin", state_rows=placed)
            expect(rep, "rr: a storage row past the table", lambda: emb2.gather(torch.tensor([ROWS])), IndexError,
                   f"index {ROWS}", f"(rank {r})")
    _unshare(ctx, where)
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_partitions_and_round_robin(run, size, memory_type):
    assert_reports(run(size, body_layouts, memory_type, timeout=240))


@one_thread
def body_save_load(ctx, memory_type):
    wgth, comm = start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    prefix = os.path.join(_share(ctx, "save"), "emb")
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM])
    fill(emb, init_table())
    ref, opt = train_and_check(rep, wgth, emb, "adam", {}, n, steps=2, what="before save")
    emb.save(prefix)
    for name in ["embedding_tensor"] + STATES["adam"]:
        rep.check(os.path.exists(f"{prefix}_{name}_part_{r}_of_{n}"), f"file of {name}")
    emb2 = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM])
    opt2 = wgth.create_wholememory_optimizer(emb2, "adam", {})
    emb2.load(prefix, part_count=n)
    every = torch.arange(ROWS)
    rep.check(torch.equal(emb2.gather(every), emb.gather(every)), "the table round trip")
    for name in STATES["adam"]:
        st, st2 = emb.get_optimizer_state(name), emb2.get_optimizer_state(name)
        rep.check(torch.equal(st2.gather(every), st.gather(every)),
                  f"state {name} round trip")
    for e, o in ((emb, opt), (emb2, opt2)):  # the same next step from both
        ids = batch(2, r)
        rows = e.gather(ids, is_training=True)  # by hand: the gradient of the rows handed over
        rep.check(rows.requires_grad and e.need_apply, "gather for training")
        e.add_gradients(ids, weights(2, r, ids.numel()))
        o.step(LR)
    ref.train_step(2, n)
    rep.check(torch.equal(emb2.gather(every), emb.gather(every)) and close(emb.gather(every), ref.w),
              "the step after loading")
    emb3 = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM])
    emb3.load(prefix)  # no optimizer: the table alone, as many parts as ranks
    rep.check(torch.equal(emb3.gather(every), emb2.gather(every)) is False, "the table as saved, not as trained on")
    emb2.save(prefix)
    emb3.load(prefix)
    rep.check(torch.equal(emb3.gather(every), emb2.gather(every)), "a table without optimizer loads the table")
    _unshare(ctx, os.path.dirname(prefix))
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_save_load_round_trip(run, size, memory_type):
    assert_reports(run(size, body_save_load, memory_type, timeout=180))


@one_thread
def body_errors(ctx, memory_type):
    """Each bad input raises on every rank, naming the op, the rank and the offending value; the
    job goes on (the embedding trains afterwards as if nothing happened)."""
    wgth, comm = start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    me = f"(rank {r})"
    f32 = torch.float32
    ce = wgth.create_embedding
    expect(rep, "an unknown memory type", lambda: ce(comm, "striped", "cpu", f32, [ROWS, DIM]), ValueError,
           "create_embedding", me, "'striped'")
    expect(rep, "an unknown location", lambda: ce(comm, memory_type, "tpu", f32, [ROWS, DIM]), ValueError, me, "'tpu'")
    expect(rep, "a 1-D embedding", lambda: ce(comm, memory_type, "cpu", f32, [ROWS]), ValueError, me, "2-D",
           f"[{ROWS}]")
    expect(rep, "a row count of 0", lambda: ce(comm, memory_type, "cpu", f32, [0, DIM]), ValueError, me, "[0, 6]")
    expect(rep, "a bad partition", lambda: ce(comm, memory_type, "cpu", f32, [ROWS, DIM],
                                              embedding_entry_partition=[1] * (n + 1)), ValueError, me, "partition")
    expect(rep, "a comm that is not one", lambda: ce("world", memory_type, "cpu", f32, [ROWS, DIM]), TypeError,
           "str 'world'")
    if n > 1:  # one rank's bad argument: the others raise too, naming it
        bad = (lambda: ce(comm, "striped" if r == 1 else memory_type, "cpu", f32, [ROWS, DIM]))
        expect(rep, "one rank's unknown type", bad, ValueError, me, "'striped'" if r == 1 else "rank 1")
    emb = ce(comm, memory_type, "cpu", f32, [ROWS, DIM])
    fill(emb, init_table())
    co = wgth.create_wholememory_optimizer
    expect(rep, "an unknown optimizer", lambda: co(emb, "adamax", {}), ValueError, "create_wholememory_optimizer", me,
           "'adamax'", "sgd, adam, adagrad, rmsprop")
    expect(rep, "a parameter of another optimizer", lambda: co(emb, "adam", {"alpha": 0.9}), ValueError, me,
           "'alpha'", "LazyAdam", "beta1")
    expect(rep, "lr is step's, not a parameter", lambda: co(emb, "sgd", {"lr": 0.1}), ValueError, me, "'lr'", "SGD")
    expect(rep, "a parameter that is not a number", lambda: co(emb, "rmsprop", {"alpha": "high"}), TypeError, me,
           "'alpha'", "'high'")
    expect(rep, "an unknown state", lambda: emb.get_optimizer_state("m"), ValueError, me, "'m'")
    opt = co(emb, "adam", {"beta2": 0.99})
    expect(rep, "a second optimizer", lambda: co(emb, "sgd", {}), ValueError, me, "only be set once")
    half = ce(comm, memory_type, "cpu", torch.float16, [ROWS, DIM])
    expect(rep, "a float16 embedding trained", lambda: co(half, "sgd", {}), ValueError, me, "float32", "float16")
    wgth.destroy_embedding(half)
    expect(rep, "a destroyed embedding", lambda: half.gather(torch.tensor([0])), ValueError, "destroyed")
    collective = memory_type == "distributed"
    for ids, exc, text in [(torch.tensor([0, ROWS + r]), IndexError, f"index {ROWS + r}"),
                           (torch.tensor([-1]), IndexError, "index -1"),
                           (torch.tensor([[0, 1]]), ValueError, "1-D"),
                           (torch.tensor([0.5]), TypeError, "float")]:
        expect(rep, f"lookup {ids.tolist()}", lambda: emb.gather(ids), exc, "gather", me, text)
        if n > 1:  # a bad id on rank 0 alone: a collective lookup fails everywhere, a local one only there
            mine = ids if r == 0 else torch.tensor([1])
            if r == 0:
                expect(rep, f"rank 0's lookup {ids.tolist()}", lambda: emb.gather(mine), exc, me, text)
            elif collective:
                expect(rep, f"rank 0's lookup {ids.tolist()} seen by a peer", lambda: emb.gather(mine), ValueError,
                       "rank 0")
            else:
                rep.check(torch.equal(emb.gather(mine), init_table()[1:2]), "a local lookup beside rank 0's bad one")
    # a gradient for a row past the table: the step fails on every rank, the next one works
    emb.add_gradients(torch.tensor([ROWS + 3 if r == 0 else 1]), torch.ones(1, DIM))
    expect(rep, "a gradient for a row past the table", lambda: opt.step(LR), (IndexError, ValueError),
           "apply_gradients", me, f"index {ROWS + 3}" if r == 0 else "rank 0")
    expect(rep, "a gradient of the wrong width", lambda: emb.add_gradients(torch.tensor([0]), torch.ones(1, DIM + 1)),
           ValueError, "add_gradients", me, f"[1, {DIM}]", f"[1, {DIM + 1}]")
    expect(rep, "lr not a number", lambda: emb.apply_gradients("fast"), TypeError, "apply_gradients", me, "'fast'")
    # caches: bad policies
    cp = wgth.create_wholememory_cache_policy
    expect(rep, "a cache ratio of 0", lambda: cp(comm, memory_type="chunked", memory_location="cpu", ratio=0.0),
           ValueError, "create_wholememory_cache_policy", me, "ratio", "0.0")
    expect(rep, "an unknown access type", lambda: cp(comm, memory_location="cpu", access_type="wo"), ValueError, me,
           "'wo'")
    expect(rep, "an unknown builtin cache", lambda: wgth.create_builtin_cache_policy("l2", memory_type, "cpu",
                                                                                      "readonly", 0.5),
           ValueError, "create_builtin_cache_policy", "'l2'")
    rep.check(wgth.create_builtin_cache_policy("none", memory_type, "cpu", "readonly", 0.5) is None, "none: no cache")
    small = cp(comm, memory_type="continuous", memory_location="cpu", access_type="readwrite", ratio=0.5)
    if memory_type != "continuous":
        expect(rep, "a cache that does not cover the table's memory",
               lambda: ce(comm, memory_type, "cpu", f32, [ROWS, DIM], cache_policy=small), ValueError, me, "cache")
    ro = cp(comm, memory_type="distributed", memory_location="cpu", access_type="readonly", ratio=0.5)
    cached = ce(comm, memory_type, "cpu", f32, [ROWS, DIM], cache_policy=ro)
    expect(rep, "a read-only cache trained", lambda: co(cached, "sgd", {}), ValueError, me, "readwrite")
    # the job goes on: the embedding trains as the reference
    ref = Reference("adam", {"beta2": 0.99}, init_table())
    for step in range(2):
        ids = batch(step, r)
        emb.gather(ids, is_training=True)
        emb.add_gradients(ids, weights(step, r, ids.numel()))
        opt.step(LR)
        ref.train_step(step, n)
    rep.check(close(emb.gather(torch.arange(ROWS)), ref.w), "training after the errors")
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_input_fails_on_every_rank(run, size, memory_type):
    assert_reports(run(size, body_errors, memory_type, timeout=180))
