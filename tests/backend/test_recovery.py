"""Training that goes on after a failure: torchrun restarts on a store that outlives an attempt,
and shrinking a group whose rank was SIGKILLed, without a relaunch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

from harness import ROOT, TESTS, free_port, join_or_kill


def test_torchrun_restart_after_a_rank_died_before_init(tmp_path):
    """Attempt 0: rank 1 exits before init while rank 0 is already in myccl's bootstrap (its keys
    are in the agent's store). Attempt 1 must form the group on that store and train; before the
    fix the ranks of attempt 1 waited on different key spaces until the timeout."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1",
           os.path.join(TESTS, "restart_worker.py"), str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        log, _ = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate()
        raise AssertionError("torchrun did not finish within 150 s:\n" + log[-4000:])
    assert p.returncode == 0, log[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["attempt"] == 1, (r, res)
        assert res["params_match_one_process"], (r, res)
        assert res["init_s"] < 15, (r, res)  # formed, not timed out (the group timeout is 20 s)
    assert results[0]["weight"] == results[1]["weight"]


def _spawn_job(tmp_path, size, kills, steps, timeout_s=15.0, deadline_s=150.0):
    """Runs recovery_worker.run on `size` fresh processes over a store this process hosts; returns
    {rank: result} for the ranks that wrote one."""
    import multiprocessing as mp
    from datetime import timedelta

    import torch.distributed as dist

    import recovery_worker

    out = tmp_path / "out"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=recovery_worker.run, args=(r, size, store.port, str(out), kills, steps, timeout_s))
             for r in range(size)]
    for p in procs:
        p.start()
    hung = join_or_kill(procs, deadline_s)
    assert not hung, f"ranks {hung} did not finish within {deadline_s} s"
    results = {}
    for r in range(size):
        f = out / f"rank{r}.json"
        if f.exists():
            results[r] = json.loads(f.read_text())
    kill_times = {int(f.name[6:]): float(f.read_text()) for f in out.glob("killed*")}
    return results, kill_times, [p.pid for p in procs]


def test_survivors_shrink_and_train_on_after_sigkill(tmp_path):
    """4 ranks train with our DDP; global rank 2 is SIGKILLed in the middle of step 2's backward,
    the survivors notice, agree on [0, 1, 3], shrink the default group and redo the step at 3 ranks;
    global rank 3 (by then rank 2 of 3) dies in step 5 and the last two go on alone. Every survivor
    ends with the parameters a single process computes over the whole batch (equal shards: the
    same average gradient at every world size), bit-identical across survivors, within the group
    timeout of each kill, and with no more descriptors, threads or shared memory than it started."""
    steps, timeout_s = 8, 15.0
    kills = {"2": 2, "5": 3}  # step -> global rank that dies in it
    results, kill_times, pids = _spawn_job(tmp_path, 4, kills, steps, timeout_s)
    assert sorted(results) == [0, 1], f"only ranks 0 and 1 survive, got results from {sorted(results)}"
    assert sorted(kill_times) == [2, 3], kill_times
    recoveries = []
    for r, res in results.items():
        assert "error" not in res, res.get("error")
        fails = [e for e in res["events"] if "error" in e]
        assert [e["step"] for e in fails] == [2, 5], fails
        first, second = fails
        assert first["world"] == 4 and first["survivors"] == [0, 1, 3] and first["excluded"] == [2], first
        assert first["new_world"] == 3 and first["new_rank"] == r, first
        assert second["world"] == 3 and second["survivors"] == [0, 1] and second["excluded"] == [2], second
        assert second["new_world"] == 2 and second["new_rank"] == r, second
        assert "closed the connection" in first["error"] or "closed its connections" in first["error"], first
        worlds = [e["world"] for e in res["events"] if "error" not in e]
        assert worlds == [4, 4, 3, 3, 3, 2, 2, 2], worlds  # every step done once, at the right size
        got = [torch.tensor(p) for p in res["params"]]
        want = [torch.tensor(p) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)), (got, want)
        for e, victim in ((first, 2), (second, 3)):
            recovery = e["t_good"] - kill_times[victim]
            assert 0 < recovery < timeout_s, (r, victim, recovery)
            recoveries.append(recovery)
            print(f"rank {r} victim {victim}: fail +{(e['t_fail'] - kill_times[victim]) * 1e3:.0f} ms, "
                  f"gc +{(e['t_gc'] - kill_times[victim]) * 1e3:.0f}, "
                  f"survivors +{(e['t_alive'] - kill_times[victim]) * 1e3:.0f}, "
                  f"shrunk +{(e['t_shrunk'] - kill_times[victim]) * 1e3:.0f}, good +{recovery * 1e3:.0f}")
        start, end = res["start"], res["end"]
        assert end["fds"] <= start["fds"], (start, end)
        assert end["tasks"] <= start["tasks"], (start, end)
        assert end["shm_maps"] <= start["shm_maps"], (start, end)
    assert results[0]["params"] == results[1]["params"]
    # Nothing of the job's processes is left in /dev/shm, not even of the two that were killed: the
    # survivors' next group removed what those left (segment names carry the creator's pid).
    left = [n for n in os.listdir("/dev/shm") if n.startswith("myccl-") and int(n.split("-")[1]) in pids]
    assert not left, left
    print(f"recovery (kill -> first good collective of the shrunk group): "
          f"{', '.join(f'{t * 1000:.0f} ms' for t in recoveries)}")


def test_reconfigure_with_a_replacement_process(tmp_path):
    """torch's reconfigure regime: processes 0, 1, 2 train with our DDP; 2 is SIGKILLed in step 2;
    a new process (3) is started, and 0, 1 and 3 reconfigure the group (3 as rank 2) and finish
    the training, 3 taking the model from rank 0. Every member ends with the parameters of a single
    process over the whole batch; the survivors see the loss within the group timeout of the kill."""
    import multiprocessing as mp
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import recovery_worker

    if not getattr(torch._C._distributed_c10d.Backend, "supports_reconfigure", None):
        import pytest

        pytest.skip(f"torch {torch.__version__} has no reconfigure API")
    out = tmp_path / "out"
    out.mkdir()
    steps, timeout_s = 6, 15.0
    plan = {"kill": 2, "at": 2, "joiner": 3, "after": [0, 1, 3]}
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    procs = {i: ctx.Process(target=recovery_worker.run_reconfigure, args=(i, store.port, str(out), plan, steps,
                                                                            timeout_s)) for i in range(3)}
    for p in procs.values():
        p.start()
    end = time.monotonic() + 150
    procs[2].join(max(0.1, end - time.monotonic()))  # the victim is gone: start its replacement
    procs[3] = ctx.Process(target=recovery_worker.run_reconfigure, args=(3, store.port, str(out), plan, steps,
                                                                         timeout_s))
    procs[3].start()
    for p in procs.values():
        p.join(max(0.1, end - time.monotonic()))
    hung = [i for i, p in procs.items() if p.is_alive()]
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"processes {hung} did not finish"
    results = {i: json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1, 3)}
    assert not (out / "rank2.json").exists()
    kill_time = float((out / "killed2").read_text())
    for i, res in results.items():
        assert "error" not in res, (i, res.get("error"))
        got = [torch.tensor(p) for p in res["params"]]
        want = [torch.tensor(p) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want)), (i, got, want)
    for i in (0, 1):
        fails = [e for e in results[i]["events"] if "error" in e]
        assert len(fails) == 1 and fails[0]["step"] == 2 and fails[0]["survivors"] == [0, 1], fails
        assert fails[0]["new_world"] == 3 and fails[0]["new_rank"] == i, fails
        # The survivors learn of the loss within the group timeout (the product's bound); the whole
        # recovery also waits for the replacement to start Python and torch, the test's own cost,
        # which is printed below, not bounded (it passed 15 s in CI under load).
        assert 0 < fails[0]["t_fail"] - kill_time < timeout_s, fails
        assert fails[0]["t_fail"] <= fails[0]["t_good"], fails
        worlds = [e["world"] for e in results[i]["events"] if "error" not in e]
        assert worlds == [3] * steps, worlds
    joined = results[3]["events"][0]
    assert joined["joined_at"] == 2, joined
    assert [e["step"] for e in results[3]["events"][1:]] == list(range(2, steps))
    assert results[0]["params"] == results[1]["params"] == results[3]["params"]
    print(f"reconfigure with a replacement: {(max(results[i]['events'][2]['t_good'] for i in (0, 1)) - kill_time) * 1e3:.0f} ms "
          f"from the kill to the reconfigured group's first collective (including the replacement's start)")
