"""Collective benchmark: myccl against the baseline (gloo on CPU, torch's nccl on CUDA), both
measured in the same run, every op x sizes.

    python benchmarks/collbench.py --world-size 2            # spawns its own ranks
    torchrun --nproc-per-node 4 benchmarks/collbench.py      # or under torchrun
    python benchmarks/collbench.py --world-size 2 --check --ops all_reduce --max-size 1M

Per row: median time per op, algbw and busbw (nccl-tests formulas), the baseline's figures
and the speed-up. Every backend has its own process group, all created up front; each row times
them one after the other on the same tensors, and the backend that goes first changes from row
to row, so none is favoured by running first or by where its buffers happen to lie in memory.
The machine's single-core copy bandwidth is measured too, and every busbw is also printed as a
fraction of it. Writes JSON (--out) and, if matplotlib is there, a PNG plot.

send_recv is a stream (rank 0 sends, rank 1 receives, back to back); ping_pong is a round trip
between ranks 0 and 1 where each waits for the other's message before it answers (time per
round trip; its busbw counts both messages), the latency a pipeline stage sees.

On CUDA (--device cuda) every timing ends with torch.cuda.synchronize(), so a figure is issue plus
completion on the GPU; "issue us" is the host time to enqueue one op (the loop before that sync),
the host overhead of the backend. More ranks than GPUs share them: each rank then poses as a host
of its own to NCCL (SHARED_GPU), over loopback sockets, so busbw there measures NCCL's
socket path, the same for myccl and the baseline.

    python benchmarks/collbench.py --device cuda --world-size 2 \
        --ops all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,send_recv --sizes 8,1M,16M,256M,1G
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import SHARED_GPU, free_port  # noqa: E402  (others import free_port from here too)

OPS = ["all_reduce", "all_reduce_bf16", "all_reduce_i32", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
       "gather", "scatter", "send_recv", "ping_pong", "barrier"]


# torch 2.13 renamed the tensor forms (all_gather_into_tensor -> all_gather_single, likewise for
# reduce_scatter); the old names still work but warn through a wrapper on every call, which
# costs both backends a few microseconds. Same backend op underneath.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def share_gpus(rank: int, local_world: int) -> bool:
    """Sets SHARED_GPU in this process when the host's ranks outnumber its GPUs (before
    any communicator exists; values already in the environment win). Returns whether it did."""
    if local_world <= torch.cuda.device_count():
        return False
    for k, v in SHARED_GPU.items():
        os.environ.setdefault(k, v.replace("{rank}", str(rank)))
    return True


def cuda_problem() -> str | None:
    """Why --device cuda cannot run here, or None."""
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA GPU"
                + ("" if torch.version.cuda else " (a CPU-only build)"))
    import c10d_ext

    if not c10d_ext.build_info().get("with_nccl"):
        return "c10d_ext was built without the NCCL engine (rebuild with MYCCL_WITH_NCCL=1)"
    return None


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for suffix, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if s.endswith(suffix):
            return int(float(s[:-1]) * mult)
    return int(s)


def fmt_size(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor (ping_pong: two messages per round trip)."""
    if op.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if op == "ping_pong":
        return 2.0
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


class Case:
    """One op at one size: tensors, the call, and a result check."""

    def __init__(self, op: str, nbytes: int, rank: int, n: int, device: torch.device, alloc=None):
        self.op, self.rank, self.n = op, rank, n
        self.group = None  # the process group the op runs on (None: the default group)
        # int32: the order of a sum cannot change it, so algorithms that fold in other orders may run
        dtype = {"bf16": torch.bfloat16, "i32": torch.int32}.get(op.rsplit("_", 1)[-1], torch.float32)
        es = torch.tensor([], dtype=dtype).element_size()
        new = alloc or (lambda numel, dt: torch.empty(numel, dtype=dt, device=device))
        # "size" follows nccl-tests: the buffer for all_reduce/broadcast/reduce/send, the full
        # gathered output for all_gather/gather, the full input for reduce_scatter/scatter,
        # the per-rank buffer for all_to_all.
        count = max(1, nbytes // es)
        if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
            count = max(n, count // n * n)
        self.count, self.dtype, self.es = count, dtype, es
        self.nbytes = count * es
        blk = count // n
        if op in ("all_gather", "gather"):
            self.inp = new(blk, dtype).fill_(rank + 1)
            self.out = new(count, dtype)
        elif op in ("reduce_scatter", "scatter"):
            self.inp = new(count, dtype).fill_(rank + 1)
            self.out = new(blk, dtype)
        elif op in ("all_to_all", "ping_pong"):
            self.inp = new(count, dtype).fill_(rank + 1)
            self.out = new(count, dtype)
        else:
            self.inp = new(count, dtype).fill_(rank + 1)
            self.out = None
        self.blk = blk
        if op in ("scatter",):
            self.chunks = list(self.inp.split(blk)) if rank == 0 else None
        if op == "gather":
            self.glist = list(self.out.split(blk)) if rank == 0 else None

    def __call__(self) -> None:
        op, g = self.op, self.group
        if op.startswith("all_reduce"):
            dist.all_reduce(self.inp, group=g)
        elif op == "broadcast":
            dist.broadcast(self.inp, src=0, group=g)
        elif op == "reduce":
            dist.reduce(self.inp, dst=0, group=g)
        elif op == "all_gather":
            ALL_GATHER_SINGLE(self.out, self.inp, group=g)
        elif op == "reduce_scatter":
            REDUCE_SCATTER_SINGLE(self.out, self.inp, group=g)
        elif op == "all_to_all":
            dist.all_to_all_single(self.out, self.inp, group=g)
        elif op == "gather":
            dist.gather(self.inp, gather_list=self.glist, dst=0, group=g)
        elif op == "scatter":
            dist.scatter(self.out, scatter_list=self.chunks, src=0, group=g)
        elif op == "send_recv":
            if self.rank == 0:
                dist.send(self.inp, 1, group=g)
            elif self.rank == 1:
                dist.recv(self.inp, 0, group=g)
        elif op == "ping_pong":
            if self.rank == 0:
                dist.send(self.inp, 1, group=g)
                dist.recv(self.out, 1, group=g)
            elif self.rank == 1:
                dist.recv(self.out, 0, group=g)
                dist.send(self.inp, 0, group=g)
        elif op == "barrier":
            dist.barrier(group=g)

    def check(self) -> bool:
        """Re-initialises the inputs, runs once, compares with what the op must produce."""
        n, r = self.n, self.rank
        self.inp.fill_(r + 1)
        self()
        total = n * (n + 1) / 2
        op = self.op
        if op.startswith("all_reduce"):
            return bool((self.inp == total).all())
        if op == "broadcast":
            return bool((self.inp == 1).all())
        if op == "reduce":
            return r != 0 or bool((self.inp == total).all())
        if op == "all_gather":
            want = torch.arange(1, n + 1, dtype=self.dtype, device=self.inp.device).repeat_interleave(self.blk)
            return bool(torch.equal(self.out, want))
        if op == "reduce_scatter":
            return bool((self.out == total).all())
        if op == "all_to_all":
            want = torch.arange(1, n + 1, dtype=self.dtype, device=self.inp.device).repeat_interleave(self.blk)
            return bool(torch.equal(self.out, want))
        if op == "gather":
            if r != 0:
                return True
            want = torch.arange(1, n + 1, dtype=self.dtype, device=self.inp.device).repeat_interleave(self.blk)
            return bool(torch.equal(self.out, want))
        if op == "scatter":
            return bool((self.out == 1).all())
        if op == "send_recv":
            return r != 1 or bool((self.inp == 1).all())
        if op == "ping_pong":
            return r > 1 or bool((self.out == 2 - r).all())
        return True


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_case(case: Case, device, trials: int, budget_s: float) -> tuple[float, float]:
    """Median over `trials` runs of back-to-back ops (ranks agree on counts) of the seconds per op
    of the slowest rank, and the median host time to issue one (before the closing sync; on CPU
    the two are the same)."""
    for _ in range(2):
        case()
    sync(device)
    t0 = time.perf_counter()
    case()
    sync(device)
    one = time.perf_counter() - t0
    # on the op's device: torch's nccl group takes no CPU tensors
    est = torch.tensor([one], dtype=torch.float64, device=device)
    dist.all_reduce(est, op=dist.ReduceOp.MAX, group=case.group)  # every rank must run the same number of ops
    # On CUDA at most 256 ops in flight, below the launch queue's depth: past it, issuing blocks
    # on the GPU and the issue time would measure the GPU instead of the host.
    most = 256 if device.type == "cuda" else 2000
    iters = int(max(1, min(most, budget_s / trials / max(est.item(), 1e-7))))
    times, issue = [], []
    for _ in range(trials):
        dist.barrier(group=case.group)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            case()
        t1 = time.perf_counter()
        sync(device)
        times.append((time.perf_counter() - t0) / iters)
        issue.append((t1 - t0) / iters)
    # Until the last rank is done: a rooted op's root (broadcast, scatter) finishes when its sends
    # are in socket buffers, long before the data has arrived, so one rank's clock can undercount.
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=case.group)
    return statistics.median(slowest.tolist()), statistics.median(issue)


def copy_bandwidth() -> float:
    """Single-core memcpy rate, GB/s of payload (what one rank can move alone)."""
    a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, a.numel() / (time.perf_counter() - t0) / 1e9)
    torch.set_num_threads(prev)
    return best


def _flat_options():
    import c10d_ext

    return c10d_ext.Options(hierarchical=False)


# Extra myccl configurations measured in the same run (--variants): label -> (backend, pg_options)
BACKEND_VARIANTS = {
    "myccl-flat": ("myccl", _flat_options),  # across hosts: every rank over TCP, no per-host level
    # across hosts: two levels forced (the default, MYCCL_HIERARCHICAL=auto, measures the link to choose)
    "myccl-hier": ("myccl", lambda: __import__("c10d_ext").Options(hierarchical=True)),
    "myccl-tcp": ("myccl", lambda: __import__("c10d_ext").Options(transport="tcp")),
    # one socket per peer (MYCCL_SOCKETS_PER_PEER=1): large messages between hosts not striped
    "myccl-1sock": ("myccl", lambda: __import__("c10d_ext").Options(sockets_per_peer=1)),
    "myccl-flat-1sock": ("myccl", lambda: __import__("c10d_ext").Options(hierarchical=False, sockets_per_peer=1)),
    "myccl-2sock": ("myccl", lambda: __import__("c10d_ext").Options(sockets_per_peer=2)),
    # float16/bfloat16 partial sums cross hosts in float32 (MYCCL_FLOAT32_PARTIALS=1)
    "myccl-f32partials": ("myccl", lambda: __import__("c10d_ext").Options(float32_partials=True)),
    # across hosts, large all-gathers and order-free sums go directly from every rank to every other
    # (MYCCL_CROSS_HOST_RING=0)
    "myccl-noring": ("myccl", lambda: __import__("c10d_ext").Options(cross_host_ring=False)),
    "myccl-flat-noring": ("myccl", lambda: __import__("c10d_ext").Options(hierarchical=False, cross_host_ring=False)),
    # across hosts, large float sums may go around the ring, not folded in rank order (MYCCL_ORDERED_SUMS=0)
    "myccl-unordered": ("myccl", lambda: __import__("c10d_ext").Options(ordered_sums=False)),
    # results written with plain memcpy at every size (MYCCL_STREAM_STORE_BYTES=off)
    "myccl-nostream": ("myccl", lambda: __import__("c10d_ext").Options(stream_store_bytes=0)),
}


def run_rank(rank: int, world: int, args, port: int, device_type: str) -> list[dict] | None:
    import c10d_ext  # noqa: F401

    if device_type == "cuda":
        share_gpus(rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.set_num_threads(1)
    copy_bw = copy_bandwidth() if device_type == "cpu" else None
    sizes = size_list(args)
    rows = []
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    groups, kinds = {}, {}
    timeout = timedelta(seconds=300)
    for bi, label in enumerate(args.backends):
        backend, pg_options = BACKEND_VARIANTS.get(label, (label, None))
        if callable(pg_options):
            pg_options = pg_options()
        if bi == 0:
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world, timeout=timeout, pg_options=pg_options)
            groups[label] = dist.group.WORLD
        else:
            groups[label] = dist.new_group(backend=backend, timeout=timeout, pg_options=pg_options)
        kinds[label] = backend
    nb = len(args.backends)
    for op in args.ops:
        if op in ("send_recv", "ping_pong") and world < 2:
            continue
        op_sizes = [0] if op == "barrier" else sizes
        for si, nbytes in enumerate(op_sizes):
            shared = Case(op, nbytes, rank, world, device) if args.alloc == "torch" else None
            for label in args.backends[si % nb:] + args.backends[:si % nb]:
                g = groups[label]
                case = shared
                if case is None:  # --alloc backend: myccl's tensors come from its own allocator
                    alloc = None
                    if kinds[label] == "myccl" and device_type == "cpu":
                        be = g._get_backend(device)
                        alloc = lambda numel, dt, be=be: be.allocate_tensor(numel, dtype=dt, device=device)  # noqa: E731
                    case = Case(op, nbytes, rank, world, device, alloc)
                case.group = g
                t, t_issue = time_case(case, device, args.trials, args.budget)
                ok = case.check() if args.check else None
                if args.check:
                    flag = torch.tensor([0 if ok else 1], device=device)
                    dist.all_reduce(flag, group=g)
                    ok = flag.item() == 0
                algbw = case.nbytes / t / 1e9 if op != "barrier" else 0.0
                rows.append({"backend": label, "op": op, "bytes": case.nbytes if op != "barrier" else 0,
                             "time_us": t * 1e6, "issue_us": t_issue * 1e6, "algbw_gbs": algbw,
                             "busbw_gbs": algbw * bus_factor(op, world), "check": ok})
                if rank == 0 and args.verbose:
                    print(f"{label:10} {op:16} {fmt_size(case.nbytes):>6} {t * 1e6:10.1f} us", flush=True)
    # What MYCCL_HIERARCHICAL=auto measured and chose, per myccl group (None: nothing to choose)
    models = {label: c10d_ext.link_model(g) for label, g in groups.items()
              if kinds[label] == "myccl" and device_type == "cpu"}
    dist.destroy_process_group()
    if rank == 0:
        return [{"copy_gbs": copy_bw, "link_models": models}] + rows
    return None


def size_list(args) -> list[int]:
    if args.sizes:
        return args.sizes
    sizes = []
    s = args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= args.step
    if sizes and sizes[-1] < args.max_size:
        sizes.append(args.max_size)  # the largest size always gets a row
    return sizes


def _spawn_entry(rank, world, args, port, device_type, queue):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = run_rank(rank, world, args, port, device_type)
    if rank == 0:
        queue.put(out)


def cuda_memory(args, world: int) -> tuple[int, int]:
    """(bytes one GPU needs, bytes it has): per rank the largest op's input and output, the
    result check's expectation, the previous size's tensors not yet freed, and NCCL's buffers
    and context for two communicators; times the ranks that share the GPU."""
    per_gpu = -(-world // torch.cuda.device_count())
    largest = max(size_list(args))
    need = per_gpu * (3.5 * largest + (1 << 30))
    return int(need), torch.cuda.get_device_properties(0).total_memory


def report(rows: list[dict], world: int, args, baseline: str) -> dict:
    copy_bw, models = rows[0]["copy_gbs"], rows[0].get("link_models", {})
    rows = rows[1:]
    by = {(r["backend"], r["op"], r["bytes"]): r for r in rows}
    print(f"\ncollbench: world size {world}, device {args.device}, baseline {baseline}"
          + (f", one-core copy {copy_bw:.2f} GB/s" if copy_bw else ""))
    variants = [b for b in args.backends if b not in ("myccl", baseline)]
    has_base = baseline in args.backends  # --baseline none: no baseline columns
    cuda = args.device == "cuda"  # host time to issue an op differs from its time only there
    hdr = (f"{'op':16} {'size':>6} | {'myccl us':>10} " + (f"{'issue':>7} " if cuda else "") + f"{'busbw':>7} | "
           + "".join(f"{v + ' us':>14} {'busbw':>7} | " for v in variants)
           + (f"{baseline + ' us':>10} " + (f"{'issue':>7} " if cuda else "") + f"{'busbw':>7} | {'speedup':>7}"
              if has_base else "")
           + ("  bus/copy" if copy_bw else "") + ("  check" if args.check else ""))
    print(hdr)
    print("-" * len(hdr))
    table = []
    for r in rows:
        if r["backend"] != "myccl":
            continue
        b = by.get((baseline, r["op"], r["bytes"]))
        speed = b["time_us"] / r["time_us"] if b else float("nan")
        vrows = {v: by.get((v, r["op"], r["bytes"])) for v in variants}
        nan = float("nan")
        line = (f"{r['op']:16} {fmt_size(r['bytes']) if r['op'] != 'barrier' else '-':>6} | "
                f"{r['time_us']:10.1f} " + (f"{r['issue_us']:7.1f} " if cuda else "") + f"{r['busbw_gbs']:7.2f} | "
                + "".join(f"{(v['time_us'] if v else nan):14.1f} {(v['busbw_gbs'] if v else nan):7.2f} | "
                          for v in vrows.values())
                + (f"{(b['time_us'] if b else nan):10.1f} " + (f"{(b['issue_us'] if b else nan):7.1f} " if cuda else "")
                   + f"{(b['busbw_gbs'] if b else nan):7.2f} | {speed:6.1f}x" if has_base else ""))
        if copy_bw:
            line += f"  {r['busbw_gbs'] / copy_bw:8.2f}"
        if args.check:
            good = r["check"] and (not b or b["check"]) and all(v is None or v["check"] for v in vrows.values())
            line += f"  {'ok' if good else 'FAIL'}"
        print(line)
        table.append({**r, **{f"{v}_time_us": (vr["time_us"] if vr else None) for v, vr in vrows.items()},
                      "baseline_time_us": b["time_us"] if b else None,
                      "baseline_issue_us": b["issue_us"] if b else None,
                      "baseline_busbw_gbs": b["busbw_gbs"] if b else None, "speedup": speed})
    for label, m in models.items():
        if m:
            print(f"{label}: link {m['link_bytes_per_s'] / 1e6:.0f} MB/s per host"
                  f" ({'declared' if m['declared'] else 'measured'}), shared memory"
                  f" {m['local_bytes_per_s'] / 1e6:.0f} MB/s per rank:"
                  f" {'two levels' if m['hierarchical'] else 'flat TCP'} (measuring took {m['seconds'] * 1e3:.0f} ms)")
    return {"world_size": world, "device": args.device, "baseline": baseline, "copy_gbs": copy_bw,
            "torch": torch.__version__, "link_models": models, "rows": table, "raw": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--min-size", type=parse_size, default=8)
    ap.add_argument("--max-size", type=parse_size, default=256 << 20)
    ap.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    ap.add_argument("--sizes", default=None, help="explicit sizes, comma-separated (8,1M,1G): instead of min/max/step")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of timed ops per row and backend")
    ap.add_argument("--baseline", default=None, help="default: gloo on cpu, nccl on cuda; 'none' skips it")
    ap.add_argument("--alloc", choices=["torch", "backend"], default="torch",
                    help="backend: myccl tensors come from its shared-memory allocator (zero copy)")
    ap.add_argument("--variants", default="", help="extra myccl configurations in the same run, comma-separated: "
                    + ", ".join(BACKEND_VARIANTS) + " (myccl-flat: no per-host level across hosts)")
    ap.add_argument("--check", action="store_true", help="verify every op's result")
    ap.add_argument("--out", default=None, help="JSON path (default bench_out/collbench_<device>_ws<N>.json)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    unknown_ops = [o for o in args.ops if o not in OPS]
    if unknown_ops:
        ap.error(f"unknown ops {unknown_ops}; known: {', '.join(OPS)}")
    args.sizes = [parse_size(x) for x in args.sizes.split(",") if x] if args.sizes else None
    if args.device == "cuda":
        problem = cuda_problem()
        if problem:
            sys.exit(f"collbench: --device cuda: {problem}")
        if "RANK" not in os.environ:
            need, have = cuda_memory(args, args.world_size)
            if need > have:
                sys.exit(f"collbench: --device cuda: sizes up to {fmt_size(max(size_list(args)))} with "
                         f"{args.world_size} ranks on {torch.cuda.device_count()} GPU(s) need about "
                         f"{need / 2**30:.1f} GiB per GPU, {have / 2**30:.1f} GiB are there")
    baseline = args.baseline or ("nccl" if args.device == "cuda" else "gloo")
    extra = [v for v in args.variants.split(",") if v]
    for v in extra:
        if v not in BACKEND_VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(BACKEND_VARIANTS)}")
    args.backends = ["myccl"] + extra + ([] if baseline == "none" else [baseline])

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        port = int(os.environ.get("MASTER_PORT", "29500"))
        rows = run_rank(rank, world, args, port + 1, args.device)
        if rank != 0:
            return
    else:
        import multiprocessing as mp

        world = args.world_size
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_spawn_entry, args=(r, world, args, port, args.device, q)) for r in range(world)]
        for p in procs:
            p.start()
        rows = None
        while rows is None:  # a rank that dies must end the run, not hang it
            try:
                rows = q.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    sys.exit(f"collbench: rank(s) {dead} failed (exit codes {[procs[r].exitcode for r in dead]})")
        for p in procs:
            p.join()
    result = report(rows, world, args, baseline)
    out = args.out or os.path.join(ROOT, "bench_out", f"collbench_{args.device}_ws{world}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"json: {out}")
    from plot import plot_collbench

    plot_collbench(result, out[:-5] + ".png")


if __name__ == "__main__":
    main()
