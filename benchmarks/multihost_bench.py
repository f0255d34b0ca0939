"""collbench across hosts made of network namespaces (tests/netns.py): H hosts x L ranks under
torchrun with c10d rendezvous; hierarchical myccl vs flat myccl (every rank over TCP) vs gloo,
in one run. Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/multihost_bench.py [--hosts 2] [--nproc 2] [--link-rate 1gbit]
                                                         [--variants V,..] [collbench args...]

--link-rate caps every host's link in both directions with a token bucket (tc tbf; this kernel has
no netem), so that the link, not the two cores, bounds large messages, as between real hosts. The
raw TCP rate of a capped link (one stream and four) is measured first and printed, and every row
gets its link fraction: the least time the bytes that must cross one host's link could take at
that rate, over the measured time (1.0: the link is the only cost). Per op, for H hosts of L
ranks and collbench's size S (nccl-tests' convention), the bytes over a host's link in the busier
direction are: all_reduce 2(H-1)/H S; broadcast, reduce, send/recv S; all_gather, reduce_scatter,
gather, scatter (H-1)/H S; all_to_all L(H-1)/H S.

Extra arguments go to collbench (default: --max-size 64M --check). Writes
bench_out/collbench_cpu_<H>hosts[_<rate>].json (rows gain link_fraction) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402

# Bytes over one host's link (busier direction) per byte of collbench's size, H hosts x L ranks.
LINK_BYTES = {
    "all_reduce": lambda h, l: 2 * (h - 1) / h,
    "all_reduce_bf16": lambda h, l: 2 * (h - 1) / h,
    "all_reduce_i32": lambda h, l: 2 * (h - 1) / h,
    "broadcast": lambda h, l: 1.0,
    "reduce": lambda h, l: 1.0,
    "send_recv": lambda h, l: 1.0 if l == 1 else None,  # ranks 0 and 1 are on one host when l > 1
    "all_gather": lambda h, l: (h - 1) / h,
    "reduce_scatter": lambda h, l: (h - 1) / h,
    "gather": lambda h, l: (h - 1) / h,
    "scatter": lambda h, l: (h - 1) / h,
    "all_to_all": lambda h, l: l * (h - 1) / h,
}

_SINK = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(16)
    def drain(c):
        while c.recv(1 << 20):
            pass
    while True:
        c, _ = srv.accept()
        threading.Thread(target=drain, args=(c,), daemon=True).start()
""")

_SOURCE = textwrap.dedent("""
    import socket, sys, threading, time
    host, port, streams, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    buf = b"x" * (1 << 20)
    sent = [0] * streams
    def push(i):
        s = socket.create_connection((host, port))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent[i] += s.send(buf)
        s.close()
    t0 = time.monotonic()
    ts = [threading.Thread(target=push, args=(i,)) for i in range(streams)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print(sum(sent) / (time.monotonic() - t0))
""")


def tcp_rate(hosts: netns.Hosts, env: dict, streams: int, seconds: float = 3.0) -> float:
    """Bytes/s of TCP payload from host 0 to host 1 over `streams` connections."""
    port = 27000 + os.getpid() % 1000
    sink = hosts.popen(1, [sys.executable, "-c", _SINK, hosts.addrs[1], str(port)], env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        time.sleep(0.5)
        out = subprocess.run(["ip", "netns", "exec", hosts.names[0], sys.executable, "-c", _SOURCE, hosts.addrs[1],
                              str(port), str(streams), str(seconds)], env=env, capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return float(out.strip())
    finally:
        sink.kill()
        sink.wait()


def link_fractions(path: str, hosts: int, nproc: int, rate: float) -> None:
    """Adds link_fraction to every row of collbench's JSON at `path` and prints them by op."""
    with open(path) as f:
        result = json.load(f)
    table = {}
    for r in result["raw"]:  # every backend's rows
        per = LINK_BYTES.get(r["op"], lambda h, l: None)(hosts, nproc)
        if per is None or not r.get("bytes") or not r.get("time_us"):
            continue
        least = per * r["bytes"] / rate
        r["link_fraction"] = least / (r["time_us"] * 1e-6)
        table.setdefault((r["op"], r["bytes"]), {})[r["backend"]] = r["link_fraction"]
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    backends = sorted({b for v in table.values() for b in v})
    print(f"\nlink fraction (least time over a {rate / 1e6:.1f} MB/s link / measured time; 1.0 = link-bound)")
    print(f"{'op':16} {'size':>6} | " + " ".join(f"{b:>13}" for b in backends))
    for (op, nbytes), by in sorted(table.items()):
        size = f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K" if nbytes >= 1024 else f"{nbytes}B"
        print(f"{op:16} {size:>6} | " + " ".join(f"{by[b]:13.2f}" if b in by else f"{'':>13}" for b in backends))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--link-rate", default=None, help="cap every host's link, tc syntax: 1gbit, 200mbit")
    ap.add_argument("--variants", default="myccl-flat",
                    help="myccl configurations measured besides the default one (collbench --variants)")
    args, rest = ap.parse_known_args()
    ok, why = netns.available()
    if not ok:
        sys.exit(f"multihost_bench: {why}")
    rest = rest or ["--max-size", "64M", "--check"]
    suffix = f"_{args.link_rate}" if args.link_rate else ""
    out = os.path.join(ROOT, "bench_out", f"collbench_cpu_{args.hosts}hosts{suffix}.json")
    # an --out among collbench's arguments wins there (the last one counts): read the table from it
    for i, a in enumerate(rest):
        if a == "--out" and i + 1 < len(rest):
            out = rest[i + 1]
        elif a.startswith("--out="):
            out = a.split("=", 1)[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MYCCL_SOCKET_IFNAME", None)
    port = 29300 + os.getpid() % 500
    run_id = uuid.uuid4().hex[:8]
    with netns.Hosts(args.hosts) as hosts:
        rate = None
        if args.link_rate:
            hosts.cap(args.link_rate)
            one, four = tcp_rate(hosts, env, 1), tcp_rate(hosts, env, 4)
            rate = max(one, four)
            print(f"link capped at {args.link_rate}: raw TCP {one / 1e6:.1f} MB/s on one stream, "
                  f"{four / 1e6:.1f} MB/s on four", flush=True)
        procs = []
        for i in range(hosts.n):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.n),
                   "--nproc-per-node", str(args.nproc), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv-id", run_id, "--max-restarts", "0",
                   "--local-addr", hosts.addrs[i]]
            if i == 0:
                cmd += ["--rdzv-conf", "is_host=1"]
            cmd += [os.path.join(HERE, "collbench.py"), "--variants", args.variants, "--out", out] + rest
            # gloo binds to what the hostname resolves to (loopback in a namespace): name the link
            host_env = dict(env, GLOO_SOCKET_IFNAME=hosts.devs[i])
            procs.append(hosts.popen(i, cmd, host_env, start_new_session=True,
                                     stdout=None if i == 0 else subprocess.DEVNULL))
        rc = [p.wait(timeout=args.timeout) for p in procs]
    if any(rc):
        sys.exit(f"multihost_bench: torchrun exit codes {rc}")
    if rate:
        link_fractions(out, args.hosts, args.nproc, rate)


if __name__ == "__main__":
    main()
