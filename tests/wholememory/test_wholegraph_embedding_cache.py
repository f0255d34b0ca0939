"""Embedding caches at 1-4 ranks (hit counts a test can predict, values after write-back and
after drop), the trainable embeddings on the strict CUDA double (CPU tensors standing for CUDA
ones, every exchange through myccl's NCCL engine) and on a GPU, and the example trained over
the ranks against the same training in one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cuda_helpers import WORLD, double_world
from harness import ROOT, Report, assert_reports, one_thread
from wg_embedding_ref import DIM, HOT, LR, ROWS, STATES, Reference, batch, close, init_table, weights
from wm_helpers import TYPES, _share, _unshare, body_optimizers, expect, fill, start

SET = 32  # lines per cache set


def node_ids(step: int, node_ranks, rows: int):
    """Every rank's ids of a lookup (a rank asks for rows near its own, with repeats)."""
    out = {}
    for q in node_ranks:
        g = torch.Generator().manual_seed(100 * step + q)
        out[q] = torch.cat([torch.randint(0, rows, (20,), generator=g), torch.arange(q, rows, 9)])
    return out


@one_thread
def body_read_only(ctx, where: str, memory_type: str):
    """A read-only cache of hot rows of the whole table on this rank ("device") or shared by a
    node's ranks ("node", two ranks per node): which lookups it answers, what it loads, values."""
    local_size = 2 if where == "node" else ctx.size
    wgth, comm = start(ctx, local_size=local_size)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    cache_comm = wgth.get_local_node_communicator() if where == "node" else wgth.get_local_device_communicator()
    cw, cr = cache_comm.get_size(), cache_comm.get_rank()
    node = [r - cr + i for i in range(cw)]  # the ranks sharing this rank's cache
    table = init_table()
    owner_side = cache_comm.wmb_comm is comm.wmb_comm  # one rank: the cache is on the table's communicator
    cache_type = "distributed" if owner_side else "chunked" if where == "node" else "continuous"
    policy = wgth.create_wholememory_cache_policy(cache_comm, memory_type=cache_type, memory_location="cpu",
                                                  access_type="readonly", ratio=1.0)
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM], cache_policy=policy)
    fill(emb, table)
    per = -(-(-(-ROWS // SET)) // cw)  # sets per cache rank (ratio 1: a set is 32 rows)
    mine = range(per * cr * SET, per * (cr + 1) * SET)  # the rows this rank's sets cover

    def counters():
        return emb.cache_counters()

    # ratio 1: a set's 32 lines hold all of its 32 rows, so every row asked for is cached
    first = node_ids(0, node, ROWS)
    got = emb.gather(first[r])
    rep.check(torch.equal(got, table[first[r]]), "first lookup's values")
    c = counters()
    cached = torch.unique(torch.cat(list(first.values())))
    rep.check(c["hits"] == first[r].numel() and c["misses"] == 0, f"first lookup, after the refill: {c}")
    want_loaded = sum(1 for x in cached.tolist() if x in mine) if not owner_side else cached.numel()
    rep.check(c["loaded"] == want_loaded, f"rows loaded {c['loaded']}, expected {want_loaded}")
    # without refills: what the first lookups cached answers, the rest goes to the table
    emb.set_adjust_cache(False)
    second = node_ids(1, node, ROWS)[r]
    rep.check(torch.equal(emb.gather(second), table[second]), "second lookup's values")
    hit = int(torch.isin(second, cached).sum())
    c2 = counters()
    rep.check((c2["hits"] - c["hits"], c2["misses"] - c["misses"], c2["loaded"]) == (hit, second.numel() - hit,
                                                                                       c["loaded"]),
              f"second lookup: {c2} after {c}, {hit} of {second.numel()} cached")
    emb.drop_all_cache()
    rep.check(torch.equal(emb.gather(first[r]), table[first[r]]), "values after drop")
    c3 = counters()
    rep.check(c3["hits"] == c2["hits"] and c3["misses"] == c2["misses"] + first[r].numel(), f"after drop: {c3}")
    emb.writeback_all_cache()  # nothing to write: read-only
    rep.check(counters()["written_back"] == 0, "a read-only cache writes nothing back")
    emb.set_adjust_cache(True)
    rep.check(torch.equal(emb.gather(first[r]), table[first[r]]), "values after refill")
    c4 = counters()
    rep.check(c4["hits"] == c3["hits"] + first[r].numel() and c4["loaded"] == 2 * c["loaded"], f"refilled: {c4}")
    wgth.destroy_embedding(emb)

    # ratio 1/4: 128 rows share 32 lines; the 32 rows asked for most stay (row i asked i + 1 times
    # by each rank of the node), the others are read from the table
    policy = wgth.create_wholememory_cache_policy(cache_comm, memory_type=cache_type, memory_location="cpu",
                                                  access_type="readonly", ratio=0.25)
    big = init_table(100)
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [100, DIM], cache_policy=policy)
    fill(emb, big)
    ids = torch.cat([torch.full((i + 1,), i) for i in range(40)])[torch.randperm(820, generator=torch.Generator()
                                                                                 .manual_seed(r))]
    rep.check(torch.equal(emb.gather(ids), big[ids]), "values, cache smaller than the rows asked for")
    c = emb.cache_counters()
    hot = ids >= 8
    rep.check((c["hits"], c["misses"]) == (int(hot.sum()), int((~hot).sum())), f"LFU: {c}")
    rep.check(c["loaded"] == (32 if cr == 0 or owner_side else 0), f"LFU loaded {c['loaded']}")
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_read_only_cache_on_each_rank(run, size, memory_type):
    assert_reports(run(size, body_read_only, "device", memory_type, timeout=180))


@pytest.mark.parametrize("memory_type", ["continuous", "distributed"])
def test_read_only_cache_shared_by_a_node(run, memory_type):
    assert_reports(run(4, body_read_only, "node", memory_type, timeout=240))


@one_thread
def body_lookups_answered_here(ctx, memory_type: str, exchange: bool):
    """A read-only cache of this rank alone: a lookup that every rank's cache answers reads nothing
    from the table; one rank's misses are read while the others' caches answer theirs; bad ids
    on rank 0 fail on every rank where the table's lookup is collective (the exchange), on rank 0
    alone where it is not (its parts mapped here, or continuous memory), and the job goes on."""
    wgth, comm = start(ctx, ctx.size)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    table = init_table()
    policy = wgth.create_wholememory_cache_policy(wgth.get_local_device_communicator(), memory_type="continuous",
                                                  memory_location="cpu", access_type="readonly", ratio=1.0)
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM], cache_policy=policy)
    fill(emb, table)
    cache = emb.wmb_embedding.cache
    reads = []
    read = cache.raw_gather
    cache.raw_gather = lambda ids: reads.append(ids.numel()) or read(ids)
    warm = torch.arange(r % 3, ROWS, 3)
    rep.check(torch.equal(emb.gather(warm), table[warm]), "warming lookup")
    emb.set_adjust_cache(False)
    del reads[:]
    for _ in range(2):
        rep.check(torch.equal(emb.gather(warm.flip(0)), table[warm.flip(0)]), "a lookup the cache answers")
    rep.check(reads == [], f"every rank's lookups answered by its cache: the table read {reads}")
    c = emb.cache_counters()
    mine = warm if r == 0 else torch.arange(ROWS)  # rank 0's cache answers all, the others miss some
    rep.check(torch.equal(emb.gather(mine), table[mine]), "rank 0 all hits, the others miss")
    c2 = emb.cache_counters()
    hit = int(torch.isin(mine, warm).sum())
    rep.check((c2["hits"] - c["hits"], c2["misses"] - c["misses"]) == (hit, mine.numel() - hit), f"counts {c2}")
    collective = exchange and memory_type == "distributed" and n > 1
    want = [] if r == 0 and not collective else [0] if r == 0 else [mine.numel() - hit]
    rep.check(reads == want, f"the table read {reads}, expected {want}")
    bad = torch.tensor([1, ROWS + 2]) if r == 0 else warm
    if r == 0:
        expect(rep, "rank 0's bad id", lambda: emb.gather(bad), IndexError, "gather", f"rank {r}", f"{ROWS + 2}")
    elif collective:
        expect(rep, "rank 0's bad id seen by a peer", lambda: emb.gather(bad), ValueError, "gather", "rank 0")
    else:
        rep.check(torch.equal(emb.gather(bad), table[bad]), "a lookup beside rank 0's bad one")
    rep.check(torch.equal(emb.gather(torch.arange(ROWS)), table), "the job goes on")
    cache.raw_gather = read
    wgth.destroy_embedding(emb)
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("memory_type,exchange", [("distributed", False), ("distributed", True),
                                                  ("continuous", False)])
@pytest.mark.parametrize("size", [2, 3])
def test_read_only_lookups_answered_here(run, size, memory_type, exchange):
    env = {"MYCCL_WM_DIRECT": "0"} if exchange else None
    assert_reports(run(size, body_lookups_answered_here, memory_type, exchange, env=env, timeout=180))


@pytest.mark.parametrize("where,size", [("device", 2), ("device", 3), ("node", 4)])
def test_read_only_cache_through_the_exchange(run, where, size):
    assert_reports(run(size, body_read_only, where, "distributed", env={"MYCCL_WM_DIRECT": "0"}, timeout=240))


def _expect_raw(rep, emb, table_want, states_want, what):
    every = torch.arange(ROWS)
    raw = emb.get_embedding_tensor().gather(every)
    rep.check(close(raw, table_want), f"{what}: the table itself, largest difference "
              f"{(raw.double() - table_want.double()).abs().max().item():.3g}")
    for name, want in states_want.items():
        rep.check(close(emb.get_optimizer_state(name).gather(every), want), f"{what}: state {name} itself")


@one_thread
def body_read_write(ctx, memory_type, ratio, location, mode):
    """A trainable table with a read-write cache at the owners: lookups and steps use the cached
    rows (states too); the table gets them on write-back, on eviction and on drop."""
    wgth, comm = start(ctx, mode)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    table = init_table()
    policy = wgth.create_wholememory_cache_policy(comm, memory_type="distributed", memory_location=location,
                                                  access_type="readwrite", ratio=ratio)
    emb = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM], cache_policy=policy)
    fill(emb, table)
    opt = wgth.create_wholememory_optimizer(emb, "adam", {"weight_decay": 0.01})
    ref = Reference("adam", {"weight_decay": 0.01}, table)
    module = wgth.WholeMemoryEmbeddingModule(emb)
    _, first = emb.get_embedding_tensor().get_local_tensor()
    count = emb.get_embedding_tensor().get_local_tensor()[0].shape[0]
    asked = 0  # lookups of this rank's rows by every rank
    for step in range(4):
        ids = batch(step, r)
        out = module(ids)
        rep.check(close(out, ref.w[ids]), f"step {step}: lookup through the cache")
        (out * weights(step, r, ids.numel())).sum().backward()
        opt.step(LR)
        ref.train_step(step, n)
        every_ids = torch.cat([batch(step, q) for q in range(n)])
        asked += int(((every_ids >= first) & (every_ids < first + count)).sum())
    every = torch.arange(ROWS)
    rep.check(close(emb.gather(every), ref.w), "the table through the cache after training")
    asked += int(((every >= first) & (every < first + count)).sum()) * n
    c = emb.cache_counters()
    rep.check(c["hits"] + c["misses"] == asked, f"lookups answered at this owner: {c}, expected {asked}")
    touched = torch.unique(torch.cat([batch(s, q) for s in range(4) for q in range(n)]))
    mine = int(((touched >= first) & (touched < first + count)).sum())
    if ratio == 1.0:  # every touched row is cached: the table still holds the first values
        rep.check(c["misses"] == 0 and c["written_back"] == 0, f"ratio 1: {c}")
        # (beta12t, one pair per row, is not cached: steps write it to the table)
        _expect_raw(rep, emb, table, {"m": torch.zeros(ROWS, DIM), "beta12t": ref.states["beta12t"]},
                    "before write-back")
    else:  # 256 rows share 32 lines: rows never touched, looked up often, push modified rows out
        for _ in range(3):
            rep.check(close(emb.gather(torch.arange(HOT, ROWS).repeat(20)), ref.w[HOT:].repeat(20, 1)), "cold rows")
        if n == 1:  # (an owner of more than 32 rows, some never touched)
            c = emb.cache_counters()
            rep.check(c["written_back"] > 0, f"ratio 1/8: modified rows evicted and written back {c}")
        rep.check(close(emb.gather(every), ref.w), "the table through the cache after evictions")
    emb.writeback_all_cache()
    _expect_raw(rep, emb, ref.w, ref.states, "after write-back")
    c2 = emb.cache_counters()
    if ratio == 1.0:
        rep.check(c2["written_back"] == mine, f"written back {c2['written_back']}, expected {mine}")
    emb.writeback_all_cache()
    rep.check(emb.cache_counters()["written_back"] == c2["written_back"], "a second write-back writes nothing")
    ids = batch(5, r)  # one more step, then drop: written back and emptied
    (module(ids) * weights(5, r, ids.numel())).sum().backward()
    opt.step(LR)
    ref.train_step(5, n)
    emb.drop_all_cache()
    _expect_raw(rep, emb, ref.w, ref.states, "after drop")
    emb.set_adjust_cache(False)
    c3 = emb.cache_counters()
    rep.check(close(emb.gather(every), ref.w), "lookups after drop")
    c4 = emb.cache_counters()
    rep.check(c4["hits"] == c3["hits"] and c4["misses"] - c3["misses"] == count * n, f"after drop: {c4}")
    # save writes back first; a fresh embedding loads the trained table and states
    prefix = os.path.join(_share(ctx, "cache"), "e")
    emb.set_adjust_cache(True)
    emb.gather(batch(0, r))
    emb.save(prefix)
    fresh = wgth.create_embedding(comm, memory_type, "cpu", torch.float32, [ROWS, DIM])
    wgth.create_wholememory_optimizer(fresh, "adam", {})
    fresh.load(prefix)
    rep.check(close(fresh.gather(every), ref.w), "save / load of a cached embedding")
    for name in STATES["adam"]:
        rep.check(close(fresh.get_optimizer_state(name).gather(every), ref.states[name]), f"loaded state {name}")
    _unshare(ctx, os.path.dirname(prefix))
    wgth.finalize()
    return rep.result()


@pytest.mark.parametrize("ratio", [1.0, 0.125])
@pytest.mark.parametrize("memory_type", TYPES)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_read_write_cache(run, size, memory_type, ratio):
    assert_reports(run(size, body_read_write, memory_type, ratio, "cpu", "cpu", timeout=180))


# -- the CUDA double and a GPU ----------------------------------------------------------------------

@pytest.mark.parametrize("memory_type,location", [("chunked", "cuda"), ("continuous", "cuda"),
                                                  ("distributed", "cpu")])
def test_optimizers_on_cuda_double(run, memory_type, location):
    assert_reports(run(2, body_optimizers, memory_type, location, "double", world_env=WORLD["double"], timeout=240))


def test_read_write_cache_on_cuda_double(run):
    assert_reports(run(2, body_read_write, "distributed", 0.125, "cuda", "double", world_env=WORLD["double"],
                       timeout=240))


@pytest.mark.cuda
@pytest.mark.parametrize("memory_type,location", [("chunked", "cuda"), ("distributed", "cuda"),
                                                  ("continuous", "cpu")])
def test_optimizers_on_gpu(run, memory_type, location):
    assert_reports(run(2, body_optimizers, memory_type, location, "gpu", world_env=WORLD["gpu"], timeout=240))


# -- the example ----------------------------------------------------------------------------------

EXAMPLE = os.path.join(ROOT, "examples", "gnn_embedding_train.py")
EXAMPLE_STEPS = 12


def _example(nproc: int, out: str, steps: int) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), EXAMPLE,
           "--steps", str(steps), "--out", out]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> str:
    """The example's training in one process (torchrun, one rank): where its result is."""
    out = str(tmp_path_factory.mktemp("example") / "one.pt")
    _example(1, out, EXAMPLE_STEPS)
    return out


def _same_training(got: dict, want: dict) -> list[str]:
    """What differs between two results of the example (empty: the same training)."""
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [f"{key}: largest difference {(got[key] - want[key]).abs().max().item():.3g}" for key in want
            if not torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-5)]


@pytest.mark.parametrize("nproc", [2, 4])
def test_example_equals_one_process(tmp_path, one_process, nproc):
    """examples/gnn_embedding_train.py: adam on a node-embedding table under a DDP model, at 2 and 4
    ranks and in one process, ends with the same table and model."""
    _example(nproc, str(tmp_path / "n.pt"), EXAMPLE_STEPS)
    one, n = torch.load(one_process), torch.load(tmp_path / "n.pt")
    assert not torch.allclose(one["table"], one["table0"], atol=1e-3), "the table did not train"
    assert not _same_training(n, one), _same_training(n, one)


@one_thread
def body_example(ctx, mode: str, memory_type: str, one_path: str):
    """The example's training (its own train(), as torchrun would run it) with the table in CUDA
    memory: on the strict double, or on one GPU whose ranks each play a host of their own (the
    GPU world's NCCL_HOSTID); against the same training in one process."""
    import importlib.util

    import c10d_ext.wholememory as wgth

    wgth.finalize()
    ctx.init(timeout=60)
    rep = Report(ctx)
    local_rank, local_size = ctx.rank, ctx.size
    if mode == "double":
        import cuda_double

        cuda_double.set_device(ctx.rank % 2)
        before = cuda_double.counters()
    else:
        local_rank, local_size = 0, 1
    spec = importlib.util.spec_from_file_location("gnn_embedding_train", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--steps", str(EXAMPLE_STEPS), "--memory-type", memory_type,
                               "--memory-location", "cuda"])
    got = example.train(args, ctx.rank, ctx.size, local_rank, local_size)
    for problem in _same_training(got, torch.load(one_path)) or [None]:
        rep.check(problem is None, f"{memory_type} cuda against one process: {problem}")
    if mode == "double":  # the table's exchanges ran on the CUDA engine, and broke none of CUDA's rules
        after = cuda_double.counters()
        rep.check(after.get("sends", 0) > before.get("sends", 0), f"no NCCL sends: {after}")
        rep.check(not cuda_double.violations(), f"violations on the double: {cuda_double.violations()}")
    return rep.result()


@pytest.mark.parametrize("memory_type", ["chunked", "continuous"])
def test_example_in_cuda_memory_on_cuda_double(run, one_process, memory_type):
    assert_reports(run(2, body_example, "double", memory_type, one_process, world_env=double_world(), timeout=300))


@pytest.mark.cuda
def test_example_in_cuda_memory_on_gpu(run, one_process):
    assert_reports(run(2, body_example, "gpu", "distributed", one_process, world_env=WORLD["gpu"], timeout=300))
