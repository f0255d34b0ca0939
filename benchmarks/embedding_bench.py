"""A training step of an embedding table, three ways, and cached lookups, in one run:

- WholeMemoryEmbedding (pylibwholegraph.torch's names): each rank holds 1/n of the table; a step
  looks rows up, hands their gradients back, and the optimizer sends every (row, gradient) to the
  row's owner, which sums them and steps each touched row once (sgd, and lazy adam as another
  row; distributed memory's sgd both ways: one host, reading the parts where they lie, and the
  exchange, the path across hosts);
- the same table replicated on every rank, its dense gradient all-reduced (myccl, and gloo: the
  baseline), then a dense sgd step;
- torch.nn.Embedding(sparse=True) on every rank, its sparse gradient all-reduced (myccl, gloo).

The sgd variants apply the same update from the same rows and gradients, so they end with the same
table (checked). Reported per method: the median step time on rank 0 (every rank its own batch of
--batch ids, uniform over the table with repeats; a barrier before each step, not timed) and the
bytes per rank of table, gradient and optimizer state (from the tensors). The whole-memory and
sparse methods take each batch in turn, so that a shared machine's load falls on all of them
alike; each dense replica (two tables per rank) runs alone, last.

Cached lookups: every rank looks up --lookup ids drawn from a hot set (--hot of the rows); a
WholeMemoryEmbedding of distributed memory with a read-only cache on this rank (warmed once, then
every lookup a hit) against the same table without a cache and index_select on a private copy
(the limit, each call timed next to one of the row's, in turn first; medians of the calls), each
read two ways: one host
(the parts read where they lie) and the exchange (the path across hosts, MYCCL_WM_DIRECT=0).

    python benchmarks/embedding_bench.py                        # 2 ranks, 1M rows x 128
    python benchmarks/embedding_bench.py --world-size 4         # 4 ranks
    python benchmarks/embedding_bench.py --part lookups         # the cached lookups alone
    python benchmarks/embedding_bench.py --rows 200000 --world-size 2

Host memory per rank at the peak: the first table, two sparse replicas and the whole-memory parts
(about three tables), or a dense replica, its gradient and the all-reduce's buffers.

Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from _ranks import run_env_ranks, write_json  # noqa: E402

MB = 1 << 20


def _batches(args, rank):
    """Each step's ids and output gradients for this rank (the same for every method)."""
    out = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append((torch.randint(0, args.rows, (args.batch,), generator=g),
                    torch.randn(args.batch, args.dim, generator=g)))
    return out


def _together(batches, warmup, methods: dict, group) -> dict:
    """Every batch through every method in turn (the order turned by one each batch, alike on
    every rank), a barrier before each step (not timed): methods measured minutes apart on a
    shared machine would see different loads. ``methods``: name -> step(ids, w). Returns name ->
    the step times after the warmup."""
    names = list(methods)
    times = {name: [] for name in names}
    for i, (ids, w) in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            methods[name](ids, w)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    dist.barrier(group=group)
    return times


def wholememory_method(wgth, comm, args, init, kind, direct=True):
    """(step, finish) of a WholeMemoryEmbedding; finish() -> (bytes per rank, the first rows).
    direct=False: distributed memory through the exchange (MYCCL_WM_DIRECT=0), the path across
    hosts, where one host's lookups would read the other ranks' parts in place."""
    os.environ["MYCCL_WM_DIRECT"] = "1" if direct else "0"  # (read when a tensor is made, alike on every rank)
    emb = wgth.create_embedding(comm, args.memory_type, "cpu", torch.float32, [args.rows, args.dim])
    os.environ.pop("MYCCL_WM_DIRECT")
    local, first = emb.get_embedding_tensor().get_local_tensor()
    local.copy_(init[first:first + local.shape[0]])
    comm.barrier()
    opt = wgth.create_wholememory_optimizer(emb, kind, {})
    module = wgth.WholeMemoryEmbeddingModule(emb)

    def step(ids, w):
        module(ids).backward(w)
        opt.step(args.lr)

    def finish():
        state = sum(emb.get_optimizer_state(s).get_local_tensor()[0].numel() * 4
                    for s in emb.get_optimizer_state_names())
        sample = emb.gather(torch.arange(min(args.rows, 4096)))
        nbytes = local.numel() * 4 + state
        wgth.destroy_embedding(emb)
        return nbytes, sample

    return step, finish


def replicated_method(args, table, group):
    """(step, finish) of the replicated table ``table`` (a fresh copy of the first table, its own)."""
    table.requires_grad_()

    def step(ids, w):
        F.embedding(ids, table).backward(w)
        dist.all_reduce(table.grad, group=group)
        with torch.no_grad():
            table.sub_(table.grad, alpha=args.lr)
        table.grad = None

    return step, lambda: (2 * table.numel() * 4, table.detach()[:min(args.rows, 4096)].clone())


def sparse_method(args, init, group):
    emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    grad_bytes = []

    def step(ids, w):
        emb(ids).backward(w)
        g = emb.weight.grad
        dist.all_reduce(g, group=group)
        grad_bytes.append(g._values().numel() * 4 + g._indices().numel() * 8)
        with torch.no_grad():
            emb.weight.add_(g, alpha=-args.lr)
        emb.weight.grad = None

    return step, lambda: (emb.weight.numel() * 4 + max(grad_bytes), emb.weight.detach()[:min(args.rows, 4096)].clone())


def cached_lookups(wgth, comm, args, init, rank, gloo):
    """Lookups of hot rows: (name -> (median seconds per lookup, hit fraction or None, median
    seconds of index_select on the private copy, called beside them))."""
    g = torch.Generator().manual_seed(7)
    hot = torch.randperm(args.rows, generator=g)[:max(1, int(args.rows * args.hot))]
    ids = hot[torch.randint(0, hot.numel(), (args.lookup,), generator=torch.Generator().manual_seed(8 + rank))]
    want = init.index_select(0, ids)
    out = {}

    def limit():
        return init.index_select(0, ids)

    def run(name, fn, emb=None):
        """Each call of fn timed next to a call of the limit (in turn first), so that both see the
        same load; a call the machine preempted is an outlier the medians leave out."""
        if not torch.equal(fn(), want):
            raise AssertionError(f"{name}: wrong rows (rank {rank})")
        before = emb.cache_counters() if emb is not None else None
        ts, lim = [], []
        for i in range(args.rounds):
            dist.barrier(group=gloo)
            for j in range(args.reps):
                pair = [(ts, fn), (lim, limit)]
                for acc, f in (pair if (i + j) % 2 == 0 else pair[::-1]):
                    t0 = time.perf_counter()
                    f()
                    acc.append(time.perf_counter() - t0)
        hits = None
        if before is not None:
            after = emb.cache_counters()
            asked = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
            hits = (after["hits"] - before["hits"]) / asked
        out[name] = (statistics.median(ts), hits, statistics.median(lim))

    run("index_select (private copy)", limit)
    for env, label in (("1", "one host"), ("0", "exchange")):
        os.environ["MYCCL_WM_DIRECT"] = env  # (read when a tensor is made, alike on every rank)
        emb = wgth.create_embedding(comm, "distributed", "cpu", torch.float32, [args.rows, args.dim])
        policy = wgth.create_wholememory_cache_policy(wgth.get_local_device_communicator(), memory_type="continuous",
                                                      memory_location="cpu", access_type="readonly",
                                                      ratio=args.cache_ratio)
        cached = wgth.create_embedding(comm, "distributed", "cpu", torch.float32, [args.rows, args.dim],
                                       cache_policy=policy)
        os.environ.pop("MYCCL_WM_DIRECT")
        for e in (emb, cached):
            local, first = e.get_embedding_tensor().get_local_tensor()
            local.copy_(init[first:first + local.shape[0]])
        comm.barrier()
        run(f"no cache, distributed ({label})", lambda: emb.gather(ids))
        cached.gather(ids)  # warms the cache (counts the accesses, loads the rows)
        cached.set_adjust_cache(False)
        run(f"read-only cache on this rank, warm ({label})", lambda: cached.gather(ids), cached)
        if label == "one host":
            cached.set_adjust_cache(True)
            run(f"read-only cache, counting accesses ({label})", lambda: cached.gather(ids), cached)
        wgth.destroy_embedding(cached)
        wgth.destroy_embedding(emb)
        gc.collect()
    return out


def worker(args) -> dict:
    import c10d_ext  # noqa: F401
    import c10d_ext.wholememory as wgth

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wgth.init_torch_env(rank, size, rank, size)  # myccl's default group, one thread per rank
    gloo = dist.new_group(backend="gloo")
    comm = wgth.get_global_communicator()
    def first_table():
        return torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(1)).mul_(0.1)

    init = first_table()
    batches = _batches(args, rank)
    results, samples = [], {}

    def record(name, times, nbytes, sample=None):
        results.append({"method": name, "step_s": statistics.median(times), "bytes_per_rank": nbytes})
        if sample is not None:
            samples[name] = sample
        if rank == 0:
            print(f"  {name}: {statistics.median(times) * 1e3:.1f} ms", flush=True)
        gc.collect()

    def run_phase(phase: dict) -> None:
        made = {name: make() for name, make in phase.items()}
        times = _together(batches, args.warmup, {name: m[0] for name, m in made.items()}, gloo)
        for name, (_, finish) in made.items():
            nbytes, sample = finish()
            record(name, times[name], nbytes, None if "adam" in name else sample)

    steps = args.part in ("all", "steps")
    if steps:  # the light methods together: the goals compare them
        light = {"WholeMemoryEmbedding, sgd": lambda: wholememory_method(wgth, comm, args, init, "sgd")}
        if args.memory_type == "distributed":
            light["WholeMemoryEmbedding, sgd, exchange"] = lambda: wholememory_method(wgth, comm, args, init, "sgd",
                                                                                      direct=False)
        light["WholeMemoryEmbedding, lazy adam"] = lambda: wholememory_method(wgth, comm, args, init, "adam")
        for label, group in (("myccl", None), ("gloo", gloo)):
            light[f"nn.Embedding(sparse), sparse all_reduce ({label})"] = \
                lambda group=group: sparse_method(args, init, group)
        run_phase(light)
    lookups = cached_lookups(wgth, comm, args, init, rank, gloo) if args.part in ("all", "lookups") else {}
    del init  # each replica below is a table and its dense gradient per rank: nothing else held
    gc.collect()
    if steps:
        for label, group in (("myccl", None), ("gloo", gloo)):
            run_phase({f"replicated, dense all_reduce ({label})": lambda group=group: replicated_method(
                args, first_table(), group)})
        ref = samples["WholeMemoryEmbedding, sgd"]
        for name, s in samples.items():
            if not torch.allclose(s, ref, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{name} ends with another table than WholeMemoryEmbedding (rank {rank})")
    wgth.finalize()
    return {"rank": rank, "size": size, "config": {k: v for k, v in vars(args).items() if k != "out"},
            "steps": results,
            "lookups": [{"config": k, "time_s": t, "hit_fraction": h, "index_select_s": lim,
                         "gbps": args.lookup * args.dim * 4 / t / 1e9} for k, (t, h, lim) in lookups.items()]}


def report(res: dict, out: str) -> None:
    c = res["config"]
    if res["steps"]:
        _report_steps(res, c)
    if res["lookups"]:
        _report_lookups(res, c)
    write_json(res, out)


def _report_steps(res: dict, c: dict) -> None:
    n = res["size"]
    print(f"\ntraining step of a {c['rows']} x {c['dim']} float32 table, {n} ranks, "
          f"{c['batch']} ids per rank per step (median of {c['steps']} steps, rank 0)")
    base = {r["method"]: r["step_s"] for r in res["steps"]}
    dense = base["replicated, dense all_reduce (gloo)"]
    sparse = {b: base[f"nn.Embedding(sparse), sparse all_reduce ({b})"] for b in ("gloo", "myccl")}
    print(f"{'method':<48} {'step ms':>9} {'MB/rank':>9} {'vs dense gloo':>14} {'vs sparse gloo':>15} "
          f"{'vs sparse myccl':>16}")
    for r in res["steps"]:
        r["vs_dense_gloo"] = dense / r["step_s"]
        r["vs_sparse_gloo"] = sparse["gloo"] / r["step_s"]
        r["vs_sparse_myccl"] = sparse["myccl"] / r["step_s"]
        print(f"{r['method']:<48} {r['step_s'] * 1e3:9.1f} {r['bytes_per_rank'] / MB:9.1f} "
              f"{r['vs_dense_gloo']:13.2f}x {r['vs_sparse_gloo']:14.2f}x {r['vs_sparse_myccl']:15.2f}x")
    table = c["rows"] * c["dim"] * 4
    sgd = next(r for r in res["steps"] if r["method"] == "WholeMemoryEmbedding, sgd")
    res["goals"] = {"memory_per_rank_of_table": sgd["bytes_per_rank"] / table,
                    "memory_limit_of_table": 1 / n + 0.1,
                    "vs_dense_gloo": sgd["vs_dense_gloo"], "vs_sparse_gloo": sgd["vs_sparse_gloo"],
                    "vs_sparse_myccl": sgd["vs_sparse_myccl"]}
    g = res["goals"]
    print(f"goals (WholeMemoryEmbedding, sgd): memory per rank {g['memory_per_rank_of_table']:.3f} of the table "
          f"(at most 1/{n} + 0.1 = {g['memory_limit_of_table']:.3f}); step {g['vs_dense_gloo']:.1f}x the dense "
          f"replica (at least 5x); {g['vs_sparse_gloo']:.2f}x / {g['vs_sparse_myccl']:.2f}x the sparse replica "
          "on gloo / myccl (above 1x)")


def _report_lookups(res: dict, c: dict) -> None:
    print(f"\nlookups of {c['lookup']} ids from a hot set of {c['hot']:.0%} of the rows (median per lookup, rank 0; "
          "index_select timed beside each row's calls)")
    print(f"{'lookup':<46} {'ms':>8} {'GB/s':>8} {'hits':>6} {'index_select ms':>16} {'vs index_select':>16}")
    for r in res["lookups"]:
        r["vs_index_select"] = r["index_select_s"] / r["time_s"]
        hits = "" if r["hit_fraction"] is None else f"{r['hit_fraction']:.0%}"
        print(f"{r['config']:<46} {r['time_s'] * 1e3:8.2f} {r['gbps']:8.2f} {hits:>6} "
              f"{r['index_select_s'] * 1e3:16.2f} {r['vs_index_select']:15.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16384, help="ids per rank per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--memory-type", default="distributed", choices=["continuous", "chunked", "distributed"])
    ap.add_argument("--lookup", type=int, default=16384, help="ids per rank per cached lookup")
    ap.add_argument("--hot", type=float, default=0.05, help="the hot set, a fraction of the rows")
    ap.add_argument("--cache-ratio", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--part", default="all", choices=["all", "steps", "lookups"],
                    help="the training steps, the cached lookups, or both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or os.path.join(ROOT, "bench_out", f"embedding_bench_{args.world_size}ranks.json")
    report(run_env_ranks(worker, args.world_size, args, timeout=3600), out)


if __name__ == "__main__":
    main()
