"""The CUDA engine's host cost per op: what myccl's own code costs the host, measured without a
GPU (the default), and on a GPU against torch's nccl (--device cuda).

Every op kind at 8 bytes, synchronous and asynchronous, runs on the strict CUDA double with its
stream delays at zero (MYCCL_TEST_CUDA_DOUBLE_DELAY_US=0): the double stands for CUDA and NCCL.
At the default world size of 1 its NCCL moves nothing between processes (ops on one rank are
local copies; batch_isend_irecv sends to itself), so the time left is the engine's launch path,
its Work and its completion. At 2 ranks and more the double's NCCL carries bytes through the
store, whose round trips then dominate the times (the allocation counts stay the engine's).
For each op:

- ``sync us``: one op with async_op=False, issue to completion (median over rounds);
- ``issue us``: an async op's issue alone (16 issued back to back, then waited for);
- ``async us``: the same 16 per op, issue to the last completion;
- ``allocs``: heap allocations on the issuing thread per op (sync / async), counted by a
  preloaded wrapper of glibc's allocator (benchmarks/alloc_count.c, built here with cc). They
  include torch's own per-op allocations above the backend, the same in every build.

``--trace`` also records the call stack of every allocation on the issuing thread during 32
synchronous ops of each kind and prints, per op, the functions that allocate (the first frame
outside the allocator and the C++ runtime, resolved with addr2line) and how often per op: where
the allocations of the launch path come from.

``--before REV`` measures the tree at git revision REV too, in the same run (a worktree under
bench_out/, built once with MYCCL_BUILD_TESTS=1; `git worktree remove` it when done), and adds
after/before ratios: the figures of a change to the launch path, before and after, from one run
on one machine. The two trees are measured in turn, ``--passes`` times each, and every figure is
the median over the passes, so that the machine's drift during the run falls on both.

    python benchmarks/cuda_host_cost.py
    python benchmarks/cuda_host_cost.py --before main~3 --rounds 7

``--device cuda`` (what ``make gpu-check`` runs): on this machine's GPUs (ranks share one when
they outnumber them, as collbench arranges), every collective, send/recv and batch_isend_irecv
at 8 B and 1 MiB, sync and async, over myccl and over torch's nccl in the same processes (a
nccl group beside the myccl default group), the two measured in turn in every round: the host
time to issue one op (sync: the call, which returns once the op is enqueued; async: 16 issued
back to back), with the GPU drained outside the timed part; allocations on the issuing thread
for both; and myccl / nccl ratios (the goal: at most 1.0 at 8 B).

    python benchmarks/cuda_host_cost.py --device cuda --rounds 7

Without --device cuda, needs a build with the test double (MYCCL_BUILD_TESTS=1, what scripts/setup.sh makes). Prints a
table and writes JSON (--out). Compare the columns of one run: this VM is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_ranks  # noqa: E402

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv",
       "batch_isend_irecv"]
ASYNC_BATCH = 16


def _shim(out_dir: str) -> str | None:
    """benchmarks/alloc_count.c built into out_dir (None without a C compiler)."""
    src = os.path.join(ROOT, "benchmarks", "alloc_count.c")
    lib = os.path.join(out_dir, "alloc_count.so")
    if os.path.exists(lib) and os.path.getmtime(lib) >= os.path.getmtime(src):
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    return lib


def _before_tree(rev: str, out_dir: str) -> str:
    """A worktree of `rev` with its extension and test double built in place (once)."""
    sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = os.path.join(out_dir, f"before-{sha}")
    if not os.path.isdir(os.path.join(tree, "c10d_ext")):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, sha], check=True)
    built = [f for f in os.listdir(os.path.join(tree, "c10d_ext")) if f.startswith("_test_double") and f.endswith(".so")]
    if not built:
        log = os.path.join(out_dir, f"before-{sha}-build.log")
        print(f"building {rev} ({sha}) in {tree} (once; several minutes; log: {log})", flush=True)
        env = dict(os.environ, MYCCL_BUILD_TESTS="1", MAX_JOBS=str(os.cpu_count() or 2))
        with open(log, "w") as f:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env, check=True,
                           stdout=f, stderr=subprocess.STDOUT)
    return tree


def _tensors(torch, op: str, rank: int, world: int, n: int = 2, device=None):
    """(input, output) of n float32 per rank (8 bytes by default); for gather and scatter, the
    root's list of blocks on the side that has one."""
    t = torch.full((n,), float(rank + 1), device=device)
    if op == "all_gather":
        return t, torch.empty(n * world, device=device)
    if op == "reduce_scatter":
        return torch.ones(n * world, device=device), torch.empty(n, device=device)
    if op == "all_to_all":
        return torch.ones(n * world, device=device), torch.empty(n * world, device=device)
    if op == "gather":
        return t, [torch.empty(n, device=device) for _ in range(world)] if rank == 0 else None
    if op == "scatter":
        return [torch.ones(n, device=device) for _ in range(world)] if rank == 0 else None, torch.empty(n, device=device)
    return t, torch.empty(n, device=device)


def _issue(dist, op: str, inp, out, rank: int, world: int, async_op: bool, group=None):
    """One op (on `group`, whose ranks are the default group's); returns its Work (or a list of
    Works) when async."""
    g = group
    if op == "all_reduce":
        return dist.all_reduce(inp, async_op=async_op, group=g)
    if op == "broadcast":
        return dist.broadcast(inp, 0, async_op=async_op, group=g)
    if op == "reduce":
        return dist.reduce(inp, 0, async_op=async_op, group=g)
    if op == "all_gather":
        return dist.all_gather_into_tensor(out, inp, async_op=async_op, group=g)
    if op == "reduce_scatter":
        return dist.reduce_scatter_tensor(out, inp, async_op=async_op, group=g)
    if op == "all_to_all":
        return dist.all_to_all_single(out, inp, async_op=async_op, group=g)
    if op == "gather":
        return dist.gather(inp, out, dst=0, async_op=async_op, group=g)
    if op == "scatter":
        return dist.scatter(out, inp, src=0, async_op=async_op, group=g)
    peer = rank ^ 1 if world > 1 else rank
    if op == "send_recv":  # even ranks send, odd ranks receive (not on one rank: a self-send
        if peer >= world or peer == rank:  # outside a group hangs, as in NCCL)
            return None
        if rank % 2 == 0:
            w = dist.isend(inp, peer, group=g)
        else:
            w = dist.irecv(out, peer, group=g)
        if not async_op:
            w.wait()
            return None
        return w
    if op == "batch_isend_irecv":
        if peer >= world:
            return None
        ws = dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, peer, g), dist.P2POp(dist.irecv, out, peer, g)])
        if not async_op:
            for w in ws:
                w.wait()
            return None
        return ws
    raise ValueError(op)


def _allocation_counter(shim: str | None):
    """(the shim library, a function giving this thread's allocations so far); (None, 0) without
    the shim. The counts are real only where the process started with the shim preloaded
    (_preloaded)."""
    if not shim:
        return None, lambda: 0
    import ctypes

    lib = ctypes.CDLL(shim)
    counted = lib.myccl_thread_allocations
    counted.restype = ctypes.c_ulonglong
    return lib, counted


def _preloaded(shim: str | None, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the shim in LD_PRELOAD, which the spawned ranks get at exec."""
    if shim:
        os.environ["LD_PRELOAD"] = shim
    try:
        return fn(*args, **kwargs)
    finally:
        os.environ.pop("LD_PRELOAD", None)


def _wait(work) -> None:
    if work is None:
        return
    for w in work if isinstance(work, list) else [work]:
        w.wait()


_RUNTIME = ("libc.so", "libstdc++", "alloc_count.so", "libgcc_s", "ld-linux")


def _owner(stack, maps) -> str:
    """Whose code asked: the first c10d_ext module on the stack from the allocation up."""
    for addr in stack[1:]:
        path = next((p for lo, hi, p in maps if lo <= addr < hi), "")
        if "/c10d_ext/_test_double" in path:
            return "double"
        if "/c10d_ext/_C" in path:
            return "myccl"
    return "above"


def _resolve(stacks: list[list[int]]) -> tuple[list[str], list[str]]:
    """For each stack: the first frame outside the allocator and the C++ runtime, as a function
    name (addr2line on the mapped file; '?' when unknown), and whose code asked (_owner)."""
    maps = []  # (start, end, path, base)
    bases: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5]
            bases[path] = min(bases.get(path, lo), lo)
            maps.append((lo, hi, path))
    picks = []
    for stack in stacks:
        pick = None
        for addr in stack[1:]:  # frame 0 is the shim's own count()
            where = next(((path, addr - bases[path]) for lo, hi, path in maps if lo <= addr < hi), None)
            if where is None:
                continue
            if not any(r in where[0] for r in _RUNTIME):
                pick = where
                break
        picks.append(pick)
    names: dict[tuple, str] = {}
    by_file: dict[str, set] = {}
    for p in picks:
        if p:
            by_file.setdefault(p[0], set()).add(p[1])
    for path, offs in by_file.items():
        offs = sorted(offs)
        try:
            out = subprocess.run(["addr2line", "-f", "-C", "-e", path] + [hex(o - 1) for o in offs],
                                 capture_output=True, text=True, timeout=120).stdout.split("\n")
        except (OSError, subprocess.TimeoutExpired):
            out = []
        for i, o in enumerate(offs):
            fn = out[2 * i] if 2 * i < len(out) else "?"
            names[(path, o)] = f"{os.path.basename(path)}: {fn[:110]}"
    return [names.get(p, "?") if p else "?" for p in picks], [_owner(s, maps) for s in stacks]


def _trace(dist, lib, op, inp, out, rank, world, n: int = 32) -> dict:
    """Per op of n synchronous ones: allocations by whose code asked (myccl, the double, torch
    and Python above the backend) and, for myccl's, by the function that asked, most first."""
    import collections
    import ctypes
    import tempfile

    path = tempfile.mktemp(prefix="myccl-alloc-trace-")
    lib.myccl_trace_allocations(1)
    for _ in range(n):
        _issue(dist, op, inp, out, rank, world, False)
    lib.myccl_trace_dump(ctypes.c_char_p(path.encode()))
    with open(path) as f:
        stacks = [[int(x, 16) for x in line.split()] for line in f if line.strip()]
    os.unlink(path)
    names, owners = _resolve(stacks)
    by_owner = collections.Counter(owners)
    mine = collections.Counter(fn for fn, o in zip(names, owners) if o == "myccl")
    return {"by_owner": {k: v / n for k, v in by_owner.items()},
            "myccl": [(fn, c / n) for fn, c in mine.most_common(20)]}


def _rank(rank: int, world: int, port: int, args: dict, queue) -> None:
    os.environ.update(args["env"])
    sys.path.insert(0, args["tree"])
    import torch
    import torch.distributed as dist

    import c10d_ext
    from c10d_ext import _C, _test_double

    assert os.path.dirname(os.path.dirname(os.path.abspath(c10d_ext.__file__))) == os.path.abspath(args["tree"]), \
        f"imported c10d_ext from {c10d_ext.__file__}, expected the tree {args['tree']}"
    torch.set_num_threads(1)
    capsule = _test_double.configure(2, 100 + rank, 0, 64 * 1024, 20000, 90, 100)  # delays at zero
    _C._install_cuda_platform(capsule)
    lib, allocs = _allocation_counter(args["shim"])
    dist.init_process_group("myccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _test_double.set_device(rank % 2)
    n, rounds = args["reps"], args["rounds"]
    results = {}
    for op in OPS:
        if op == "send_recv" and world == 1:
            continue
        inp, out = _tensors(torch, op, rank, world)
        for _ in range(20):  # warm up: communicators, staging, caches
            _wait(_issue(dist, op, inp, out, rank, world, True))
        sync_t, issue_t, async_t, sync_a, async_a = [], [], [], [], []
        for _ in range(rounds):
            dist.barrier()
            a0, t0 = allocs(), time.perf_counter()
            for _ in range(n):
                _issue(dist, op, inp, out, rank, world, False)
            sync_t.append((time.perf_counter() - t0) / n)
            sync_a.append((allocs() - a0) / n)
            dist.barrier()
            batches = max(1, n // ASYNC_BATCH)
            issue = total = 0.0
            a0 = allocs()
            for _ in range(batches):
                t0 = time.perf_counter()
                works = [_issue(dist, op, inp, out, rank, world, True) for _ in range(ASYNC_BATCH)]
                t1 = time.perf_counter()
                for w in works:
                    _wait(w)
                issue += t1 - t0
                total += time.perf_counter() - t0
            async_a.append((allocs() - a0) / (batches * ASYNC_BATCH))
            issue_t.append(issue / (batches * ASYNC_BATCH))
            async_t.append(total / (batches * ASYNC_BATCH))
        med = statistics.median
        results[op] = {"sync_us": med(sync_t) * 1e6, "issue_us": med(issue_t) * 1e6, "async_us": med(async_t) * 1e6,
                       "sync_allocs": med(sync_a), "async_allocs": med(async_a)}
        if args["trace"] and lib is not None:
            dist.barrier()
            results[op]["trace"] = _trace(dist, lib, op, inp, out, rank, world)
    violations = _test_double.violations()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"ops": results, "violations": violations, "module": c10d_ext.__file__})


GPU_OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
           "send_recv", "batch_isend_irecv"]
GPU_SIZES = {"8 B": 2, "1 MiB": 1 << 18}  # float32 elements per rank


def _rank_gpu(rank: int, world: int, port: int, args: dict, queue) -> None:
    """--device cuda: myccl against torch's nccl on the same ranks and GPUs, in one process each:
    host time to issue one op (sync: the call itself, which returns once the op is enqueued;
    async: 16 issued back to back), the GPU drained outside the timed part; the two backends
    measured in turn within every round, in alternating order."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import torch
    import torch.distributed as dist

    import c10d_ext  # noqa: F401  (registers myccl)
    from collbench import share_gpus

    share_gpus(rank, world)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.set_num_threads(1)
    _, allocs = _allocation_counter(args["shim"])
    dist.init_process_group("myccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = {"myccl": None, "nccl": dist.new_group(backend="nccl")}
    n, rounds = args["reps"], args["rounds"]
    results = []
    for op in GPU_OPS:
        if op == "send_recv" and world % 2:
            continue
        for size, elems in GPU_SIZES.items():
            inp, out = _tensors(torch, op, rank, world, elems, dev)
            figs = {b: {"sync_us": [], "issue_us": [], "sync_allocs": [], "async_allocs": []} for b in groups}
            for b, g in groups.items():  # warm up: communicators, streams, caches
                for _ in range(10):
                    _wait(_issue(dist, op, inp, out, rank, world, True, g))
            torch.cuda.synchronize()
            for k in range(rounds):
                for b in (list(groups) if k % 2 == 0 else list(groups)[::-1]):
                    g = groups[b]
                    dist.barrier()
                    torch.cuda.synchronize()
                    a0, t0 = allocs(), time.perf_counter()
                    for _ in range(n):
                        _issue(dist, op, inp, out, rank, world, False, g)
                    figs[b]["sync_us"].append((time.perf_counter() - t0) / n * 1e6)
                    figs[b]["sync_allocs"].append((allocs() - a0) / n)
                    torch.cuda.synchronize()
                    issue, count = 0.0, 0
                    a0 = allocs()
                    for _ in range(max(1, n // ASYNC_BATCH)):
                        t0 = time.perf_counter()
                        works = [_issue(dist, op, inp, out, rank, world, True, g) for _ in range(ASYNC_BATCH)]
                        issue += time.perf_counter() - t0
                        count += ASYNC_BATCH
                        for w in works:
                            _wait(w)
                        torch.cuda.synchronize()
                    figs[b]["issue_us"].append(issue / count * 1e6)
                    figs[b]["async_allocs"].append((allocs() - a0) / count)
            med = {b: {c: statistics.median(v) for c, v in f.items()} for b, f in figs.items()}
            results.append({"op": op, "size": size, **{f"{b}_{c}": v for b, m in med.items() for c, v in m.items()}})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"rows": results, "world_size": world, "gpu": torch.cuda.get_device_name(dev),
                   "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})


def _gpu_main(args, shim: str | None) -> None:
    res = _preloaded(shim, run_ranks, _rank_gpu, args.world_size,
                     {"shim": shim, "reps": args.reps, "rounds": args.rounds}, timeout=1800)
    print(f"host time to issue one op on {res['gpu']} ({res['world_size']} ranks; torch {res['torch']}, "
          f"NCCL {res['nccl']}), median of {args.rounds} rounds x {args.reps} ops; ratio = myccl / nccl")
    print(f"{'op':<18}{'size':>7} | {'sync myccl':>10}{'nccl':>8}{'ratio':>7} | {'async myccl':>11}{'nccl':>8}"
          f"{'ratio':>7} | {'allocs myccl':>12}{'nccl':>6}")
    for r in res["rows"]:
        sr, ar = r["myccl_sync_us"] / r["nccl_sync_us"], r["myccl_issue_us"] / r["nccl_issue_us"]
        r["sync_ratio"], r["async_ratio"] = sr, ar
        print(f"{r['op']:<18}{r['size']:>7} | {r['myccl_sync_us']:10.1f}{r['nccl_sync_us']:8.1f}{sr:7.2f} | "
              f"{r['myccl_issue_us']:11.1f}{r['nccl_issue_us']:8.1f}{ar:7.2f} | "
              f"{r['myccl_sync_allocs']:12.1f}{r['nccl_sync_allocs']:6.1f}")
    worst = max(max(r["sync_ratio"], r["async_ratio"]) for r in res["rows"] if r["size"] == "8 B")
    print(f"\nworst ratio: {worst:.2f} (goal: <= 1.00 for every op at 8 B)")
    record = dict(res, date=time.strftime("%Y-%m-%d %H:%M"), reps=args.reps, rounds=args.rounds,
                  allocations_counted=bool(shim))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")


def _measure(tree: str, shim: str | None, args, trace: bool) -> dict:
    env = {"MYCCL_TEST_CUDA_DOUBLE_DELAY_US": "0", "OMP_NUM_THREADS": "1"}
    return _preloaded(shim, run_ranks, _rank, args.world_size,
                      {"env": env, "tree": tree, "shim": shim, "reps": args.reps, "rounds": args.rounds,
                       "trace": trace}, timeout=1800)


def _merge(passes: list[dict]) -> dict:
    """One tree's passes as one result: the median of each figure over the passes."""
    first = passes[0]
    ops = {}
    for op, r in first["ops"].items():
        ops[op] = dict(r)
        for col, v in r.items():
            if isinstance(v, (int, float)):
                ops[op][col] = statistics.median(p["ops"][op][col] for p in passes)
    return {"module": first["module"], "ops": ops, "violations": [v for p in passes for v in p["violations"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["double", "cuda"], default="double",
                   help="double: the engine's own cost on the strict double (no GPU); cuda: myccl against "
                        "torch's nccl on this machine's GPUs")
    p.add_argument("--world-size", type=int, default=None, help="default: 1 on the double, 2 on a GPU")
    p.add_argument("--reps", type=int, default=160, help="ops per round and mode")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", help="also measure this git revision (built once in bench_out/)")
    p.add_argument("--trace", action="store_true", help="also print which functions allocate, per op")
    p.add_argument("--passes", type=int, default=3,
                   help="with --before: the trees are measured in turn this many times (drift on a noisy "
                        "machine falls on both alike); each figure is the median over the passes")
    p.add_argument("--out", help="JSON (default bench_out/cuda_host_cost.json, or cuda_host_cost_gpu.json)")
    args = p.parse_args()
    if args.out is None:
        name = "cuda_host_cost_gpu.json" if args.device == "cuda" else "cuda_host_cost.json"
        args.out = os.path.join(ROOT, "bench_out", name)
    if args.device == "cuda":
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from collbench import cuda_problem

        problem = cuda_problem()
        if problem:
            sys.exit(f"cuda_host_cost --device cuda: {problem}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    shim = _shim(out_dir)
    if args.device == "cuda":
        args.world_size = args.world_size or 2
        _gpu_main(args, shim)
        return
    args.world_size = args.world_size or 1
    trees = {"after": ROOT}
    if args.before:
        trees = {"before": _before_tree(args.before, out_dir), "after": ROOT}
    passes = max(1, args.passes) if args.before else 1
    measured: dict[str, list[dict]] = {name: [] for name in trees}
    for k in range(passes):
        for name, tree in trees.items():
            measured[name].append(_measure(tree, shim, args, args.trace and k == 0))
    runs = {name: _merge(res) for name, res in measured.items()}
    cols = ["sync_us", "issue_us", "async_us", "sync_allocs", "async_allocs"]
    head = f"{'op':<18}" + "".join(f"{c:>13}" for c in cols)
    for name, res in runs.items():
        print(f"\n{name} ({res['module']}), {args.world_size} ranks on the CUDA double, delays 0, 8 B, "
              f"median of {args.rounds} rounds x {args.reps} ops"
              f"{f' (median of {passes} passes, taken in turn with the other tree)' if passes > 1 else ''}; allocations {'counted' if shim else 'not counted (no cc)'}")
        print(head)
        for op, r in res["ops"].items():
            print(f"{op:<18}" + "".join(f"{r[c]:>13.1f}" for c in cols))
        for op, r in res["ops"].items():
            if "trace" in r:
                o = r["trace"]["by_owner"]
                print(f"\n  {op}: allocations per synchronous op on the issuing thread: myccl {o.get('myccl', 0):.1f}, "
                      f"the double {o.get('double', 0):.1f}, torch and Python above the backend {o.get('above', 0):.1f}; "
                      "myccl's by the function that asked:")
                for fn, per in r["trace"]["myccl"]:
                    print(f"    {per:6.2f}  {fn}")
        if res["violations"]:
            print(f"  the double reported {len(res['violations'])} violations: {res['violations'][:3]}")
    if "before" in runs:
        print("\nafter / before")
        print(head)
        for op in runs["after"]["ops"]:
            a, b = runs["after"]["ops"][op], runs["before"]["ops"][op]
            print(f"{op:<18}" + "".join(f"{(a[c] / b[c] if b[c] else float('nan')):>13.2f}" for c in cols))
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "world_size": args.world_size, "reps": args.reps,
              "rounds": args.rounds, "passes": passes, "before": args.before, "allocations_counted": bool(shim),
              "runs": {k: {"ops": v["ops"], "violations": len(v["violations"])} for k, v in runs.items()}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
