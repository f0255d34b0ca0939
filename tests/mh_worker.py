"""Runs under torchrun on the namespaced test hosts (tests/backend/test_multihost.py): checks every op
against local expectations, then trains a small DDP model and saves its parameters.

    torchrun ... tests/mh_worker.py <out_dir> <mode>     mode: all | ops | ddp | link | wm
"""

from __future__ import annotations

import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import c10d_ext  # noqa: E402
from expect import INTS, make, reduce_all  # noqa: E402
from harness import open_sockets  # noqa: E402


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in INTS or a.dtype == torch.bool:
        return torch.equal(a, b)
    # Two-level reductions add in a different order than a flat rank-order fold, and low precision
    # rounds each host's partial (a few units of randn): a bfloat16 ulp there is 2^-7 of it. The
    # exact two-level expectation is checked apart ("folded per host").
    if a.dtype == torch.bfloat16:
        return torch.allclose(a.double(), b.double(), rtol=2e-2, atol=6e-2)
    tol = 1e-2 if a.dtype == torch.float16 else 1e-5
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


class Checks:
    """check(ok, what) records a failure as 'rank R: <prefix>what'; .count says how many ran."""

    def __init__(self, fails: list[str], prefix: str = ""):
        self.fails, self.prefix, self.count = fails, prefix, 0

    def __call__(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.fails.append(f"rank {dist.get_rank()}: {self.prefix}{what}")


def two_levels() -> bool:
    """Whether the world's large ops run in two levels: forced by MYCCL_HIERARCHICAL, or what the
    link measured at the first op chose (auto; no choice to make with one rank per host)."""
    forced = os.environ.get("MYCCL_HIERARCHICAL", "auto")
    if forced in ("0", "1"):
        return forced == "1"
    m = c10d_ext.link_model()
    return bool(m and m["hierarchical"])


def check_ops(fails: list[str]) -> int:
    r, n = dist.get_rank(), dist.get_world_size()
    check = Checks(fails)

    for numel in (7, 20_000, 600_001):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in ("SUM", "MAX", "AVG"):
                xs = [make(q, (numel,), dtype, numel) for q in range(n)]
                t = xs[r].clone()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                check(close(t, reduce_all(xs, op)), f"all_reduce {op} {dtype} {numel}")
        xs = [make(q, (numel,), torch.float32, 1) for q in range(n)]
        for root in range(n):
            t = xs[r].clone()
            dist.broadcast(t, src=root)
            check(torch.equal(t, xs[root]), f"broadcast root {root} {numel}")
            t = xs[r].clone()
            dist.reduce(t, dst=root)
            check(close(t, reduce_all(xs, "SUM")) if r == root else torch.equal(t, xs[r]), f"reduce root {root} {numel}")
        outs = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(outs, xs[r])
        check(all(torch.equal(outs[q], xs[q]) for q in range(n)), f"all_gather {numel}")
        cat = torch.empty(numel * n)
        dist.all_gather_into_tensor(cat, xs[r])
        check(torch.equal(cat, torch.cat(xs)), f"all_gather_into_tensor {numel}")
        big = [make(q, (numel * n,), torch.float32, 2) for q in range(n)]
        out = torch.empty(numel)
        dist.reduce_scatter_tensor(out, big[r])
        check(close(out, reduce_all(big, "SUM")[r * numel:(r + 1) * numel]), f"reduce_scatter_tensor {numel}")
        out = torch.empty(numel)
        dist.reduce_scatter(out, list(big[r].split(numel)))
        check(close(out, reduce_all(big, "SUM")[r * numel:(r + 1) * numel]), f"reduce_scatter {numel}")
        a2a = torch.empty(numel * n)
        dist.all_to_all_single(a2a, big[r])
        want = torch.cat([big[q][r * numel:(r + 1) * numel] for q in range(n)])
        check(torch.equal(a2a, want), f"all_to_all_single {numel}")
        g = [torch.empty(numel) for _ in range(n)] if r == 0 else None
        dist.gather(xs[r], gather_list=g, dst=0)
        check(r != 0 or all(torch.equal(g[q], xs[q]) for q in range(n)), f"gather {numel}")
        s = torch.empty(numel)
        dist.scatter(s, scatter_list=[x.clone() for x in xs] if r == n - 1 else None, src=n - 1)
        check(torch.equal(s, xs[r]), f"scatter {numel}")
    for _ in range(3):
        dist.barrier()
    # broadcasts large enough to be pipelined (more than MYCCL_TCP_CHUNK_BYTES, 4 MiB), from every root
    numel = 1_500_003
    for root in range(n):
        want = make(root, (numel,), torch.float32, 4)
        t = want.clone() if r == root else torch.zeros(numel)
        dist.broadcast(t, src=root)
        check(torch.equal(t, want), f"broadcast root {root} {numel}")
    # Floating-point sums fold each host's ranks in rank order, then the hosts in order, in
    # float32; low precision rounds each host's partial and then the total (one rounding with
    # MYCCL_FLOAT32_PARTIALS=1): bit-exact, whichever path (leader or striped). Flat groups fold
    # all ranks in rank order.
    hosts = [None] * n
    dist.all_gather_object(hosts, c10d_ext.cross_rank())
    if not two_levels():
        hosts = [0] * n
    # float16/bfloat16 partial sums cross hosts in float32 (one rounding) or in their own type
    wide = os.environ.get("MYCCL_FLOAT32_PARTIALS", "0") == "1"
    # MYCCL_ORDERED_SUMS=0: large sums across hosts go around the ring, each slice folded from
    # another rank. Not a rank-order sum, but the same bits on every rank.
    ordered = os.environ.get("MYCCL_ORDERED_SUMS", "1") != "0"

    def same_everywhere(t: torch.Tensor) -> bool:
        got = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(got, t)
        return all(torch.equal(g, t) for g in got)

    def folded(t: torch.Tensor, want: torch.Tensor, what: str, everywhere: bool) -> None:
        if ordered:
            check(torch.equal(t, want), what)
        elif everywhere:
            check(close(t, want) and same_everywhere(t), f"{what}: close, and the same bits on every rank")
        else:
            check(close(t, want), f"{what}: close")
    for numel in (20_000, 600_001):
        for dtype in (torch.float32, torch.bfloat16):
            xs = [make(q, (numel,), dtype, 5) for q in range(n)]
            want = None
            for h in sorted(set(hosts)):
                part = None
                for q in range(n):
                    if hosts[q] == h:
                        part = xs[q].float() if part is None else part + xs[q].float()
                if not wide and len(set(hosts)) > 1:
                    part = part.to(dtype).float()  # each host's partial crosses in its own type
                want = part if want is None else want + part
            how = "rounded once" if wide else "rounded per level"
            t = xs[r].clone()
            dist.all_reduce(t)
            folded(t, want.to(dtype), f"all_reduce {dtype} {numel} folded per host, {how}", True)
            # the same sums, each rank keeping its block
            blk = numel // n
            out = torch.empty(blk, dtype=dtype)
            dist.reduce_scatter_tensor(out, xs[r][: blk * n].clone())
            folded(out, want[r * blk:(r + 1) * blk].to(dtype),
                   f"reduce_scatter_tensor {dtype} {numel} folded per host, {how}", False)
    # point-to-point across hosts: a ring
    x = make(r, (100_000,), torch.float32, 3)
    y = torch.empty(100_000)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % n), dist.P2POp(dist.irecv, y, (r - 1) % n)])
    for q in reqs:
        q.wait()
    check(torch.equal(y, make((r - 1) % n, (100_000,), torch.float32, 3)), "ring send/recv")
    st = c10d_ext.stats()
    if not two_levels():
        # flat across hosts: large broadcasts go down a chain (each host's link carries them once)
        check("broadcast/tcp-pipelined-chain" in st, f"chained broadcast never ran: {sorted(st)}")
        # large all-gathers across hosts go around a ring (each rank sends only to the next), and
        # so do large sums whose order cannot matter (int64), or may not (MYCCL_ORDERED_SUMS=0)
        ring_ops = ["all_gather", "all_gather_into_tensor", "all_reduce"]
        if ordered:
            check("all_reduce/tcp-direct-reduce-scatter-ring-all-gather" in st, f"ring all-gather never ran: {sorted(st)}")
            check("reduce_scatter_tensor/tcp-direct" in st, f"rank-order reduce_scatter never ran: {sorted(st)}")
        else:
            ring_ops += ["reduce_scatter", "reduce_scatter_tensor"]
            check("all_reduce/tcp-direct-reduce-scatter-ring-all-gather" not in st,
                  f"a large rank-order sum ran with MYCCL_ORDERED_SUMS=0: {sorted(st)}")
        for op in ring_ops:
            check(f"{op}/tcp-ring" in st, f"ring {op} never ran: {sorted(st)}")
    else:
        # small all_reduces through one leader per host, large ones striped across local ranks
        check("all_reduce/hierarchical-shm-tcp" in st, f"hierarchical all_reduce never ran: {sorted(st)}")
        check("all_reduce/hierarchical-striped-shm-tcp" in st, f"striped all_reduce never ran: {sorted(st)}")
        check("broadcast/hierarchical-pipelined-shm-tcp" in st, f"pipelined broadcast never ran: {sorted(st)}")
        for op in ("reduce_scatter_tensor", "reduce_scatter", "all_gather", "all_gather_into_tensor"):
            check(f"{op}/hierarchical-striped-shm-tcp" in st, f"striped {op} never ran: {sorted(st)}")
            check(f"{op}/hierarchical-shm-tcp" in st, f"leader {op} never ran: {sorted(st)}")
    return check.count


def check_link(fails: list[str]) -> int:
    """MYCCL_HIERARCHICAL=auto: the link is measured once, at the first op with a two-level
    version, every rank gets the same figures, and the ops then run the path they chose.
    MH_EXPECT says which path ("two-levels" or "flat"); MH_LINK_CAP_MBIT, the cap put on every
    host's link (the measurement may not exceed it by more than the token bucket's burst)."""
    r, n = dist.get_rank(), dist.get_world_size()
    check = Checks(fails, "link: ")
    check(c10d_ext.link_model() is None, "a link model before any op")
    x = make(r, (1000,), torch.float32, 6)
    g = [torch.empty(1000) for _ in range(n)]
    dist.all_gather(g, x)  # the first op with a two-level version: it measures
    m = c10d_ext.link_model()
    check(m is not None, "no link model after the first all_gather")
    if m is None:
        return check.count
    models = [None] * n
    dist.all_gather_object(models, m)
    same = ("hierarchical", "declared", "link_bytes_per_s", "local_bytes_per_s", "hosts", "ranks_per_host")
    check(all(all(o[k] == m[k] for k in same) for o in models), f"ranks measured different figures: {models}")
    want = os.environ["MH_EXPECT"] == "two-levels"
    check(m["hierarchical"] == want, f"chose {'two levels' if m['hierarchical'] else 'flat'}: {m}")
    check(m["hosts"] == c10d_ext.cross_size() and m["ranks_per_host"] == n / c10d_ext.cross_size(), f"layout: {m}")
    check(m["local_bytes_per_s"] > 0, f"no shared-memory rate: {m}")
    declared = os.environ.get("MYCCL_LINK_MBIT")
    if declared:
        check(m["declared"] and m["link_bytes_per_s"] == int(declared) * 1e6 / 8, f"declared link: {m}")
    else:
        check(not m["declared"] and m["link_bytes_per_s"] > 0, f"measured link: {m}")
        cap = os.environ.get("MH_LINK_CAP_MBIT")
        if cap:
            # 2 ranks x 1 MiB per host through a bucket of 256 KiB burst: at most ~1.15x the rate
            check(m["link_bytes_per_s"] <= 1.5 * int(cap) * 1e6 / 8, f"measured faster than the cap: {m}")
    for numel in (7, 600_001):
        xs = [make(q, (numel,), torch.float32, 7) for q in range(n)]
        t = xs[r].clone()
        dist.all_reduce(t)
        check(close(t, reduce_all(xs, "SUM")), f"all_reduce {numel}")
        outs = [torch.empty(numel) for _ in range(n)]
        dist.all_gather(outs, xs[r])
        check(all(torch.equal(outs[q], xs[q]) for q in range(n)), f"all_gather {numel}")
        t = xs[r].clone()
        dist.broadcast(t, src=n - 1)
        check(torch.equal(t, xs[n - 1]), f"broadcast {numel}")
    dist.barrier()
    st = c10d_ext.stats()
    choice = "hierarchical" if want else "flat"
    probes = {k: v for k, v in st.items() if k.startswith("link_probe/")}
    check(list(probes) == [f"link_probe/{choice}"] and probes[f"link_probe/{choice}"]["count"] == 1,
          f"measured more than once, or recorded another choice: {probes}")
    two = [k for k in st if "/hierarchical" in k]
    if want:
        check("all_reduce/hierarchical-striped-shm-tcp" in st, f"striped all_reduce never ran: {sorted(st)}")
    else:
        check(not two, f"two-level ops ran after choosing flat: {two}")
    return check.count


def check_split(fails: list[str]) -> int:
    """split_group across hosts, as a 2-D mesh: a group per host and a group per local rank across
    the hosts, both on the world's connections (no socket of their own), each checked while the
    world runs ops of its own at the same time."""
    r, n = dist.get_rank(), dist.get_world_size()
    check = Checks(fails, "split: ")

    hosts = [None] * n
    dist.all_gather_object(hosts, c10d_ext.cross_rank())
    by_host = [[q for q in range(n) if hosts[q] == h] for h in sorted(set(hosts))]
    if any(len(g) != len(by_host[0]) for g in by_host):
        return 0
    across = [list(col) for col in zip(*by_host)]  # local rank i of every host
    dist.barrier()
    before = open_sockets()
    host_g = dist.split_group(split_ranks=by_host)
    cross_g = dist.split_group(split_ranks=across)
    check(open_sockets() == before, f"the splits opened sockets: {before} -> {open_sockets()}")
    for g, ranks, what in ((host_g, next(h for h in by_host if r in h), "per host"),
                           (cross_g, next(c for c in across if r in c), "across hosts")):
        for numel in (7, 600_001):
            xs = {q: make(q, (numel,), torch.float32, numel) for q in ranks}
            t = xs[r].clone()
            w = make(r, (numel,), torch.float32, 9)
            a = dist.all_reduce(w, async_op=True)  # the world's op at the same time
            dist.all_reduce(t, group=g)
            a.wait()
            check(close(t, reduce_all([xs[q] for q in ranks], "SUM")), f"all_reduce {what} {numel}")
            check(close(w, reduce_all([make(q, (numel,), torch.float32, 9) for q in range(n)], "SUM")),
                  f"the world's all_reduce beside the split's {what} {numel}")
            for root in ranks:
                b = xs[r].clone()
                dist.broadcast(b, src=root, group=g)
                check(torch.equal(b, xs[root]), f"broadcast {what} from {root} {numel}")
            outs = [torch.empty(numel) for _ in ranks]
            dist.all_gather(outs, xs[r], group=g)
            check(all(torch.equal(o, xs[q]) for o, q in zip(outs, ranks)), f"all_gather {what} {numel}")
        links = g._get_backend(torch.device("cpu")).describe_links()
        check("links shared with" in links, f"{what}: not on the world's links: {links!r}")
    return check.count


def train(out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(5):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, "ddp_params.pt"))


def check_wholememory(fails: list[str], out_dir: str) -> int:
    """Whole-memory tensors across hosts: HOST is one copy per host, DISTRIBUTED spans the hosts
    (gather / scatter / files against the table one process would hold), CHUNKED is refused."""
    import c10d_ext.wholememory as wm

    check = Checks(fails, "wholememory: ")
    r, n = dist.get_rank(), dist.get_world_size()
    rows, dim = 41, 6
    ref = torch.arange(rows * dim, dtype=torch.float32).view(rows, dim)
    h = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.HOST)
    part, first = wm.local_partition(h)
    host = c10d_ext.cross_rank()
    part.copy_(ref[first:first + part.shape[0]] + 1000 * host)  # each host's copy is its own
    dist.barrier()
    check(torch.equal(h, ref + 1000 * host), f"HOST copy of host {host}")
    d = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
    part, first = wm.local_partition(d)
    part.copy_(ref[first:first + part.shape[0]])
    idx = torch.randint(0, rows, (50 + r,), generator=torch.Generator().manual_seed(r))
    check(torch.equal(wm.gather(d, idx), ref[idx]), "DISTRIBUTED gather across hosts")
    mine = torch.arange(r, rows, n)
    wm.scatter(d, -ref[mine], mine)
    check(torch.equal(wm.gather(d, torch.arange(rows)), -ref), "DISTRIBUTED scatter across hosts")
    prefix = os.path.join(out_dir, "wm")
    wm.save_to_files(d, prefix)
    back = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.HOST)
    wm.load_from_files(back, prefix)
    dist.barrier()
    check(torch.equal(back, -ref), "files saved by every rank of both hosts, loaded into each host's copy")
    try:
        wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.CHUNKED)
        check(False, "CHUNKED across hosts was not refused")
    except ValueError as e:
        check("spans 2 hosts" in str(e) and "DISTRIBUTED" in str(e), f"CHUNKED refusal: {e}")
    return check.count


def main() -> int:
    out_dir, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("myccl")
    r = dist.get_rank()
    result = {"rank": r, "world": dist.get_world_size(), "local_rank": c10d_ext.local_rank(),
              "local_size": c10d_ext.local_size(), "cross_rank": c10d_ext.cross_rank(),
              "cross_size": c10d_ext.cross_size(), "fails": [], "checks": 0,
              "links": dist.group.WORLD._get_backend(torch.device("cpu")).describe_links()}
    try:
        if mode == "link":
            result["checks"] = check_link(result["fails"])
        if mode in ("all", "ops"):
            result["checks"] = check_ops(result["fails"])
        if mode == "all":
            result["checks"] += check_split(result["fails"])
        if mode in ("all", "ddp"):
            train(out_dir)
        if mode == "wm":
            result["checks"] = check_wholememory(result["fails"], out_dir)
    except Exception:  # noqa: BLE001
        result["fails"].append(f"rank {r}: exception\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
