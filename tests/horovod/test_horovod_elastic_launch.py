"""The launcher's elastic mode (c10d_ext/horovod/elastic/driver.py): horovodrun's --min-np,
--max-np, --host-discovery-script, --slots-per-host, --blacklist-cooldown-range and --reset-limit.
The jobs run the elastic training of test_horovod_elastic through `python -m c10d_ext.horovod.run`
and every process's parameters are compared with what one process computes over the epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from c10d_ext.horovod import run as hvdrun
from c10d_ext.horovod.elastic import driver
from harness import ROOT, TESTS
from hvd_helpers import same_as_one_process

needs_reconfigure = pytest.mark.skipif(not hasattr(dist, "_reconfigure"),
                                       reason="new workers join through torch's reconfigure API (torch >= 2.14)")


# ---- without processes ------------------------------------------------------------------------------
def test_discovery_output_and_slots_per_host():
    assert driver.parse_discovery_output("h1:2\nh2\n\nh3:1\n", 4) == {"h1": 2, "h2": 4, "h3": 1}
    assert driver.parse_discovery_output("", None) == {}  # nothing available yet
    with pytest.raises(ValueError, match="without slots and --slots-per-host"):
        driver.parse_discovery_output("h1\n", None)


def test_blacklist_cooldown_as_horovod_computes_it():
    forever = driver.HostState()
    forever.blacklist(100.0)
    assert not forever.available(10 ** 9)
    h = driver.HostState((10, 100))
    h.blacklist(0.0)  # 10 * 2 + up to 10 seconds
    assert 20 <= h.until <= 30 and not h.available(19.9) and h.available(30.0)
    h.blacklist(50.0)
    h.blacklist(51.0)  # (within its cooldown: no longer)
    assert 50 + 40 <= h.until <= 50 + 50 and h.count == 2
    for _ in range(10):
        now = h.until + 1
        h.blacklist(now)
    assert h.count == 12 and abs(h.until - now - 100) < 1e-6  # 10 * 2^12 and more, held to the top
    with pytest.raises(ValueError, match="cannot be lower than default cooldown lower limit: 1"):
        driver.check_cooldown_range((0, 5))
    with pytest.raises(ValueError, match="cannot be higher than default cooldown upper limit: 3600"):
        driver.check_cooldown_range((1, 7200))


def test_elastic_flags_parse_as_horovodrun_takes_them(tmp_path):
    a = hvdrun.parse_args(["--min-np", "2", "--max-np", "4", "--host-discovery-script", "./d.sh",
                           "--slots-per-host", "2", "--elastic-timeout", "30", "--reset-limit", "3",
                           "--blacklist-cooldown-range", "5", "60", "python", "train.py"])
    assert (a.num_proc, a.min_num_proc, a.max_num_proc, a.slots, a.elastic_timeout, a.reset_limit,
            a.cooldown_range, a.command) == (2, 2, 4, 2, 30, 3, [5, 60], ["python", "train.py"])
    assert hvdrun.is_elastic(a) and not hvdrun.is_elastic(hvdrun.parse_args(["-np", "2", "true"]))
    with pytest.raises(ValueError, match="fewer than 2 hosts"):
        driver.ElasticDriver(hvdrun.parse_args(["-np", "2", "--min-np", "1", "-H", "a:2", "true"]))
    with pytest.raises(ValueError, match="One of --host-discovery-script, --hosts"):
        a = hvdrun.parse_args(["--min-np", "1", "true"])
        a.hosts = None
        driver.ElasticDriver(a)


# ---- jobs --------------------------------------------------------------------------------------------
TRAIN = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
import c10d_ext.horovod as hvd
from hvd_helpers import elastic_training, write_result

out_dir, mode = sys.argv[1], sys.argv[2]
wid = os.environ["MYCCL_HVD_WORKER_ID"]
result = {{"steps": [], "resets": [], "wid": wid, "elastic": os.environ.get("HOROVOD_ELASTIC")}}
error = None
try:
    torch.set_num_threads(1)
    hvd.init()
    result["start"] = {{"size": hvd.size(), "rank": hvd.rank()}}
    waited = [False]

    def after_step(state):
        if mode == "grow" and state.batch == 2 and hvd.rank() == 0 and not waited[0]:
            waited[0] = True  # the launcher starts a worker once it sees a third slot; wait for it
            open(os.path.join(out_dir, "committed"), "w").close()
            from c10d_ext.horovod.basics import STATE
            store = dist.PrefixStore("hvd/elastic", STATE.job_store)
            end = time.monotonic() + 60
            while store.add("joiners", 0) < 1 and time.monotonic() < end:
                time.sleep(0.05)

    def hook_for(model, state):
        if mode == "kill" and state.batch == 5 and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
            def die(grad):
                os.kill(os.getpid(), 9)
            return model[0].weight.register_hook(die)
        return None

    elastic_training(hvd, result, hook_for=hook_for, after_step=after_step)
    hvd.shutdown()
except BaseException as e:
    error = e
write_result(os.path.join(out_dir, wid + ".json"), result, error)
sys.exit(1 if error else 0)
"""


def _job(tmp_path, flags, mode, timeout=240):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(tests=TESTS))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "c10d_ext.horovod.run"] + flags + [sys.executable, str(script), str(out), mode]
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, out


def _finish(proc, timeout):
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail("the elastic job did not finish in time:\n" + text.decode(errors="replace")[-4000:])
    return proc.returncode, text.decode(errors="replace")


def _results(out):
    return {p.stem: json.loads(p.read_text()) for p in out.glob("w*.json")}


@pytest.mark.slow
@needs_reconfigure
def test_a_discovered_slot_gets_a_worker_that_joins_the_job(tmp_path):
    """-np 2 on 'localhost:2'; after the commit at batch 2 the discovery script reports
    'localhost:3': the launcher starts a third worker (HOROVOD_ELASTIC_JOIN=1), the commit at
    batch 4 admits it, and all three end with one process's parameters; the launcher exits 0."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    proc, out = _job(tmp_path, ["-np", "2", "--min-np", "2", "--max-np", "3",
                                "--host-discovery-script", f"cat {hosts}"], "grow")
    end = time.monotonic() + 120
    while not (out / "committed").exists() and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.05)
    hosts.write_text("localhost:3\n")
    code, text = _finish(proc, 240)
    assert code == 0, text[-4000:]
    results = _results(out)
    assert sorted(results) == ["w1", "w2", "w3"], (sorted(results), text[-3000:])
    for wid, res in results.items():
        assert "error" not in res, (wid, res["error"])
        assert res["elastic"] == "1", res
        steps = [(s["batch"], s["size"]) for s in res["steps"]]
        want = ([(b, 2) for b in range(4)] if wid != "w3" else []) + [(b, 3) for b in range(4, 8)]
        assert steps == want, (wid, steps)
        assert (res["size"], res["new_rank"]) == (3, {"w1": 0, "w2": 1, "w3": 2}[wid]), res
        assert same_as_one_process(res), wid


@pytest.mark.slow
@needs_reconfigure
def test_a_failed_worker_blacklists_its_host_and_the_job_succeeds(tmp_path):
    """-np 3 on the fixed hosts 'localhost:2,127.0.0.1:1' (both this machine); the worker on
    127.0.0.1 SIGKILLs itself in step 5: its host is blacklisted, nothing is started in its
    place, the other two restore the commit after step 3 and finish at 2 ranks with one
    process's parameters, and the launcher exits 0 (a failure survived before the first success
    does not fail the job)."""
    proc, out = _job(tmp_path, ["-np", "3", "--min-np", "2", "-H", "localhost:2,127.0.0.1:1"], "kill")
    code, text = _finish(proc, 240)
    assert code == 0, text[-4000:]
    assert "blacklisting host 127.0.0.1" in text, text[-3000:]
    results = _results(out)
    assert sorted(results) == ["w1", "w2"], (sorted(results), text[-3000:])  # w3 died without writing
    for wid, res in results.items():
        assert "error" not in res, (wid, res["error"])
        steps = [(s["batch"], s["size"]) for s in res["steps"]]
        assert steps == [(b, 3) for b in range(5)] + [(b, 2) for b in range(4, 8)], (wid, steps)
        assert same_as_one_process(res), wid


@pytest.mark.slow
@needs_reconfigure
def test_reset_limit_stops_the_job_with_horovods_message(tmp_path):
    """The same failure under --reset-limit 0: the first change of the world stops the job."""
    proc, out = _job(tmp_path, ["-np", "3", "--min-np", "2", "--reset-limit", "0", "-H", "localhost:2,127.0.0.1:1"],
                     "kill")
    code, text = _finish(proc, 240)
    assert code == 1, text[-4000:]
    assert driver.RESET_LIMIT_EXCEEDED_MESSAGE.format(0) in text, text[-3000:]
