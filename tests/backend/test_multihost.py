"""Several hosts for real: network namespaces joined by veth links (tests/netns.py), torchrun
with c10d rendezvous in each, 2 ranks per host. Ranks of a host share memory; hosts talk TCP
across the veth links. Every op is checked, a DDP run must match a single-host run, and
results must stay right with delay and loss on a link. Skipped where namespaces cannot be
made (not root)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

import netns
from harness import ROOT, TESTS

WORKER = os.path.join(TESTS, "mh_worker.py")

_ok, _why = netns.available()
pytestmark = pytest.mark.skipif(not _ok, reason=_why or "network namespaces unavailable")


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.pop("MYCCL_SOCKET_IFNAME", None)
    env.update(extra or {})
    return env


def _kill_all(procs) -> None:
    """Each process was started in a session of its own: kill its whole tree."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(hosts: netns.Hosts, nproc: int, mode: str, extra_env: dict | None = None, timeout: float = 240):
    """Runs the worker on every namespaced host under torchrun; returns per-rank results."""
    out = tempfile.mkdtemp(prefix="myccl-mh-")
    port = 29400 + os.getpid() % 500
    run_id = uuid.uuid4().hex[:8]
    procs = []
    for i in range(hosts.n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.n), "--nproc-per-node", str(nproc),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv-id", run_id,
               "--max-restarts", "0", "--monitor-interval", "0.5",
               # every namespace has the machine's hostname: tell torchrun which address is ours
               "--local-addr", hosts.addrs[i]]
        if i == 0:
            cmd += ["--rdzv-conf", "is_host=1"]
        cmd += [WORKER, out, mode]
        # A session of its own: on a timeout the whole tree (torchrun and its workers) is killed.
        procs.append(hosts.popen(i, cmd, _env(extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True))
    logs = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            logs.append(stdout)
    except subprocess.TimeoutExpired:
        _kill_all(procs)
        tails = []
        for p in procs:
            try:
                tails.append((p.communicate(timeout=10)[0] or "")[-3000:])
            except Exception:  # noqa: BLE001
                tails.append("?")
        raise AssertionError(f"multi-host run did not finish within {timeout} s; logs:\n" + "\n----\n".join(tails))
    results = []
    for r in range(hosts.n * nproc):
        path = os.path.join(out, f"rank{r}.json")
        assert os.path.exists(path), f"rank {r} wrote no result; logs:\n" + "\n----\n".join(l[-3000:] for l in logs)
        with open(path) as f:
            results.append(json.load(f))
    return results, out, logs


def _assert_ok(results):
    fails = [f for res in results for f in res["fails"]]
    assert not fails, "\n".join(fails[:30])
    assert all(res["checks"] > 0 for res in results)


def test_two_hosts_every_op_and_ddp_matches_single_host():
    # two levels forced: on these uncapped veth links the measured choice could go either way
    with netns.Hosts(2) as hosts:
        results, out, _ = launch(hosts, 2, "all", {"MYCCL_HIERARCHICAL": "1"})
    _assert_ok(results)
    for res in results:
        assert res["cross_size"] == 2 and res["local_size"] == 2, res
    # Traffic between hosts goes to the other host's veth address, not loopback.
    assert any("10.77." in res["links"] for res in results), results[0]["links"]
    multi = torch.load(os.path.join(out, "ddp_params.pt"))
    # The same training on one host (4 local ranks).
    ref_out = tempfile.mkdtemp(prefix="myccl-sh-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", WORKER, ref_out, "ddp"]
    subprocess.run(cmd, env=_env(), check=True, timeout=240, capture_output=True)
    single = torch.load(os.path.join(ref_out, "ddp_params.pt"))
    for a, b in zip(multi, single):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_three_hosts():
    # float32 partials here (one rounding); the two-host test checks the default (rounded per level)
    with netns.Hosts(3) as hosts:
        results, _, _ = launch(hosts, 2, "ops", {"MYCCL_FLOAT32_PARTIALS": "1", "MYCCL_HIERARCHICAL": "1"})
    _assert_ok(results)
    assert sorted({res["cross_rank"] for res in results}) == [0, 1, 2]


def test_flat_tcp_across_hosts():
    with netns.Hosts(2) as hosts:
        results, _, _ = launch(hosts, 2, "ops", {"MYCCL_HIERARCHICAL": "0"})
    _assert_ok(results)


def test_unordered_sums_around_a_ring_across_hosts():
    # three hosts of one rank: the ring with an odd rank count and uneven slices, float sums on it
    with netns.Hosts(3) as hosts:
        results, _, _ = launch(hosts, 1, "ops", {"MYCCL_HIERARCHICAL": "0", "MYCCL_ORDERED_SUMS": "0"})
    _assert_ok(results)


def test_auto_chooses_two_levels_on_a_slow_link():
    # MYCCL_HIERARCHICAL=auto (the default) with every link capped far below shared memory
    with netns.Hosts(2) as hosts:
        hosts.cap("50mbit")
        results, _, _ = launch(hosts, 2, "link", {"MH_EXPECT": "two-levels", "MH_LINK_CAP_MBIT": "50"})
    _assert_ok(results)


def test_auto_chooses_flat_on_a_declared_fast_link():
    # a link declared faster than shared memory: flat TCP, and nothing measured across hosts
    with netns.Hosts(2) as hosts:
        results, _, _ = launch(hosts, 2, "link", {"MH_EXPECT": "flat", "MYCCL_LINK_MBIT": "100000000"})
    _assert_ok(results)


def test_delay_and_loss_on_a_link():
    # auto: the link is measured through the impairment; the ops check whichever path it chose
    with netns.Hosts(2) as hosts:
        applied = hosts.impair(1)
        if not any("loss" in a or "drop" in a for a in applied):
            pytest.skip(f"no way to drop packets here (this kernel has no netem and iptables is not installed; "
                        f"applied: {applied}): .ci/run installs iptables")
        results, _, _ = launch(hosts, 2, "ops", timeout=400)
        dropped = hosts.dropped(1)
    _assert_ok(results)
    # The loss was real: packets were dropped while the ops ran, and every op still checked ok.
    assert dropped > 0, (applied, dropped)


RECOVERY = os.path.join(TESTS, "recovery_worker.py")


def _run_recovery(hosts, cmds, out, deadline=200, extra=None):
    """Starts (host, argv) processes of recovery_worker.py; `extra` is (host, argv, after): started
    once the process at index `after` has exited. Returns the processes' logs."""
    import time

    procs = [hosts.popen(h, [sys.executable, RECOVERY] + argv, _env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True) for h, argv in cmds]
    end = time.monotonic() + deadline
    if extra is not None:
        h, argv, after = extra
        procs[after].wait(timeout=max(1, end - time.monotonic()))
        procs.append(hosts.popen(h, [sys.executable, RECOVERY] + argv, _env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1, end - time.monotonic()))[0] or "")
    except subprocess.TimeoutExpired:
        _kill_all(procs)
        raise AssertionError("recovery run did not finish in time")
    return logs


def _load(out, name):
    path = os.path.join(out, name)
    with open(path) as f:
        return json.load(f)


def test_survivors_shrink_across_hosts():
    """2 hosts x 2 ranks train with our DDP; rank 1 (host 0) is SIGKILLed, then rank 3 (host 1):
    the survivors shrink twice and finish as ranks 0 and 2, one on each host, with one process's
    parameters."""
    steps = 6
    kills = {"1": 1, "3": 3}
    with netns.Hosts(2) as hosts:
        out = tempfile.mkdtemp(prefix="myccl-mhr-")
        port = 29900 + os.getpid() % 90
        cmds = [(r // 2, ["shrink", str(r), "4", hosts.addrs[0], str(port), out, json.dumps(kills), str(steps)])
                for r in range(4)]
        logs = _run_recovery(hosts, cmds, out)
    results = {r: _load(out, f"rank{r}.json") for r in (0, 2)}
    assert not os.path.exists(os.path.join(out, "rank1.json")) and not os.path.exists(os.path.join(out, "rank3.json"))
    for r, res in results.items():
        assert "error" not in res, (r, res.get("error"), logs[r][-2000:])
        fails = [e for e in res["events"] if "error" in e]
        assert [(e["survivors"], e["new_world"]) for e in fails] == [([0, 2, 3], 3), ([0, 1], 2)], fails
        got = [torch.tensor(p) for p in res["params"]]
        want = [torch.tensor(p) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)), (r, got, want)
    assert results[0]["params"] == results[2]["params"]


def test_reconfigure_with_a_replacement_on_another_host():
    """Processes 0, 1 (host 0) and 2 (host 1) train; 2 is SIGKILLed; a new process 3 starts on host
    1 and the three reconfigure across the hosts and finish with one process's parameters."""
    if not getattr(torch._C._distributed_c10d.Backend, "supports_reconfigure", None):
        pytest.skip(f"torch {torch.__version__} has no reconfigure API")
    steps = 5
    plan = {"kill": 2, "at": 2, "joiner": 3, "after": [0, 1, 3]}
    with netns.Hosts(2) as hosts:
        out = tempfile.mkdtemp(prefix="myccl-mhc-")
        port = 29990 + os.getpid() % 9
        cmds = [(h, ["reconfigure", str(i), hosts.addrs[0], str(port), out, json.dumps(plan), str(steps)])
                for i, h in ((0, 0), (1, 0), (2, 1))]
        extra = (1, ["reconfigure", "3", hosts.addrs[0], str(port), out, json.dumps(plan), str(steps)], 2)
        logs = _run_recovery(hosts, cmds, out, extra=extra)
    results = {i: _load(out, f"rank{i}.json") for i in (0, 1, 3)}
    for i, res in results.items():
        assert "error" not in res, (i, res.get("error"))
        got = [torch.tensor(p) for p in res["params"]]
        want = [torch.tensor(p) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)), (i, got, want)
    assert results[3]["events"][0]["joined_at"] == 2, results[3]["events"][:2]
    assert results[0]["params"] == results[1]["params"] == results[3]["params"]


def test_wholememory_across_hosts():
    with netns.Hosts(2) as hosts:
        results, _, _ = launch(hosts, 2, "wm")
    _assert_ok(results)
