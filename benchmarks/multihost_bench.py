"""collbench across hosts made of network namespaces (tests/netns.py): 2 hosts x 2 ranks under
torchrun with c10d rendezvous; hierarchical myccl vs flat myccl (every rank over TCP) vs gloo,
in one run. Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/multihost_bench.py [--hosts 2] [--nproc 2] [--variants V,..] [collbench args...]

Extra arguments go to collbench (default: --max-size 64M --check). Writes
bench_out/collbench_cpu_2hosts.json and its PNG.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import netns  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--variants", default="myccl-flat",
                    help="myccl configurations measured besides the default one (collbench --variants)")
    args, rest = ap.parse_known_args()
    ok, why = netns.available()
    if not ok:
        sys.exit(f"multihost_bench: {why}")
    rest = rest or ["--max-size", "64M", "--check"]
    out = os.path.join(ROOT, "bench_out", f"collbench_cpu_{args.hosts}hosts.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MYCCL_SOCKET_IFNAME", None)
    port = 29300 + os.getpid() % 500
    run_id = uuid.uuid4().hex[:8]
    with netns.Hosts(args.hosts) as hosts:
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


if __name__ == "__main__":
    main()
