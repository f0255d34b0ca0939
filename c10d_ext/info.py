"""python -m c10d_ext.info: what this build is, the environment variables in effect, and,
under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR set), the topology: hosts, local ranks and
which transport connects which ranks."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap


def _print_build() -> None:
    import torch

    import c10d_ext

    info = c10d_ext.build_info()
    print("c10d_ext / myccl build")
    print(f"  version             {info['version']}")
    print(f"  built for torch     {info['torch_version']}  (running {torch.__version__})")
    print(f"  NCCL engine         {'built, runtime NCCL ' + str(info['nccl_runtime_version']) if info['with_nccl'] else 'not built'}")
    if info.get("nccl_build_header"):
        print(f"  NCCL headers        {info['nccl_build_header']}")
    print(f"  reduction kernels   {info['reduce_isa']}")
    print(f"  compiler            {info.get('compiler', '?')}")
    print(f"  compiler flags      {' '.join(info['cxx_flags'])}")
    print(f"  python              {sys.version.split()[0]}")


def _print_env() -> None:
    from c10d_ext.config import describe

    print("\nenvironment (MYCCL_*)")
    for name, value, default, meaning in describe():
        print(f"  {name:28} {value}")
        for line in textwrap.wrap(meaning, 88):
            print(f"  {'':28}   {line}")


def _topology() -> None:
    import torch
    import torch.distributed as dist

    import c10d_ext  # noqa: F401

    dist.init_process_group("myccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    mine = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "local_rank": be.local_rank,
            "local_size": be.local_size, "host_index": be.cross_rank, "shm": be.uses_shared_memory,
            "links": be.describe_links().strip().splitlines()}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        hosts = sorted({e["host_index"] for e in everyone})
        print(f"\ntopology: {world} ranks on {len(hosts)} host(s)")
        for h in hosts:
            members = [e for e in everyone if e["host_index"] == h]
            print(f"  host {h} ({members[0]['host']}): ranks {[e['rank'] for e in members]}, "
                  f"collectives over {'shared memory' if members[0]['shm'] else 'TCP'}")
        print("  links (point-to-point and liveness):")
        for e in everyone:
            for link in e["links"]:
                print(f"    rank {e['rank']} -> {link}")
    dist.destroy_process_group()


def main() -> int:
    as_json = "--json" in sys.argv
    if as_json:
        import c10d_ext
        from c10d_ext.config import describe

        print(json.dumps({"build": c10d_ext.build_info(),
                          "env": {n: {"value": v, "default": d, "meaning": m} for n, v, d, m in describe()}},
                         indent=1, default=str))
        return 0
    under_launcher = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if not under_launcher or os.environ.get("RANK") == "0":
        _print_build()
        _print_env()
    if under_launcher:
        _topology()
    return 0


if __name__ == "__main__":
    sys.exit(main())
