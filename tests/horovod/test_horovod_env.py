"""How c10d_ext.horovod reads the environment it was started in (launch_env.py, basics.py).

* launchers: rank and size from horovodrun's, Open MPI's, MVAPICH's, MPICH/Intel MPI's, PMIx's and
  Slurm's variables; half-set variables and a Slurm batch script are clear errors; Slurm's host
  lists; the rendezvous from Horovod's, torch's or Slurm's variables. Pure functions, in process,
  then real 2-process jobs under Slurm's and MVAPICH's variables, and the error every rank raises
  when there is no rendezvous.

Every subprocess has a timeout; nothing here asserts on time.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from c10d_ext.horovod import launch_env as L
from harness import ROOT, TESTS
from hvd_helpers import same_as_one_process

_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "MPI_LOCAL", "HOROVOD_", "TORCHELASTIC_")
_LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def clean_env(extra: dict) -> dict:
    """This process's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_ranks(script: str, envs: list, tmp_path, timeout: float = 120.0) -> list:
    """Runs `script` once per environment; returns (exit status, output) per process. A process
    that fails ends the others 10 s later (a peer would wait for it at the rendezvous)."""
    path = tmp_path / "rank.py"
    path.write_text(script)
    logs = [tmp_path / f"rank{r}.log" for r in range(len(envs))]
    procs = []
    for env, log in zip(envs, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(path)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                          cwd=str(tmp_path)))
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            break
        time.sleep(0.05)
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def _report(results) -> str:
    return "\n".join(f"--- process {i} (exit {rc}) ---\n{out[-3000:]}" for i, (rc, out) in enumerate(results))


def _free_port_in(lo: int, hi: int) -> int:
    for _ in range(200):
        port = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}..{hi}")


# ==================================================================================== launchers
@pytest.mark.parametrize("env, want", [
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1"}, ("horovodrun", 1, 4, 1)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     ("Open MPI", 3, 4, 1)),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "3", "MV2_COMM_WORLD_LOCAL_RANK": "0"}, ("MVAPICH", 2, 3, 0)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, ("MPICH/Intel MPI (PMI)", 1, 2, 1)),
    # srun --mpi=pmix: PMIx's rank, the step's task count, Slurm's local id
    ({"PMIX_RANK": "5", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0",
      "SLURM_LOCALID": "1"}, ("PMIx", 5, 8, 1)),
    ({"PMIX_RANK": "2", "PMIX_SIZE": "3"}, ("PMIx", 2, 3, None)),
    # srun --mpi=pmi2: PMI's rank, the size from the step
    ({"PMI_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "3"},
     ("MPICH/Intel MPI (PMI)", 1, 2, None)),
    # Open MPI 5's mpirun exports PMIx's rank too; mpirun in a Slurm batch script inherits its SLURM_*
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1", "SLURM_PROCID": "0",
      "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77"}, ("Open MPI", 1, 2, None)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0"}, ("Slurm", 1, 2, 0)),
    ({"SLURM_PROCID": "3", "SLURM_NPROCS": "4", "SLURM_STEPID": "12"}, ("Slurm", 3, 4, None)),
    ({"PMIX_RANK": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}, ("PMIx", 0, 1, None)),
])
def test_each_launchers_rank_and_size(env, want):
    got = L.detect(env)
    assert (got.launcher, got.rank, got.size, got.local_rank) == want


@pytest.mark.parametrize("env", [
    {},
    {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2]"},  # an allocation's shell (salloc)
    {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "12"},  # a batch script without --ntasks
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "12"},  # a batch script of one task
    {"RANK": "1", "WORLD_SIZE": "2"},  # torchrun's: basics.py handles those itself
])
def test_no_launcher(env):
    assert L.detect(env) is None


@pytest.mark.parametrize("env, names", [
    ({"OMPI_COMM_WORLD_RANK": "0"}, ["Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
    ({"MV2_COMM_WORLD_SIZE": "2"}, ["MVAPICH", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"]),
    ({"PMI_RANK": "1"}, ["PMI_RANK", "PMI_SIZE"]),
    ({"HOROVOD_SIZE": "2"}, ["horovodrun", "HOROVOD_SIZE", "HOROVOD_RANK"]),
    ({"PMIX_RANK": "0"}, ["PMIx", "PMIX_RANK", "PMIX_SIZE"]),
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, ["Slurm", "SLURM_PROCID", "SLURM_NTASKS"]),
])
def test_a_rank_without_a_size_or_the_reverse_is_an_error(env, names):
    with pytest.raises(ValueError) as e:
        L.detect(env)
    for name in names:
        assert name in str(e.value), str(e.value)


def test_a_slurm_batch_script_of_several_tasks_is_an_error():
    """Slurm gives its batch script SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id: that
    process is not one of the job's tasks (srun starts those)."""
    for step in ({}, {"SLURM_STEP_ID": "-5"}, {"SLURM_STEP_ID": str(0xFFFFFFFB)}):
        with pytest.raises(ValueError, match="not a task of a job step.*srun"):
            L.detect(dict({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}, **step))


def test_a_rank_outside_the_size_or_not_a_number_is_an_error():
    with pytest.raises(ValueError, match="PMI_RANK=2 is not a rank of PMI_SIZE=2"):
        L.detect({"PMI_RANK": "2", "PMI_SIZE": "2"})
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_SIZE='two' is not an integer"):
        L.detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "two"})


@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a[1-2]-ib[0-1],b", ["a1-ib0", "a1-ib1", "a2-ib0", "a2-ib1", "b"]),
    ("x[3], y ,z[0-1]", ["x3", "y", "z0", "z1"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_slurm_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert L.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[3-1]", "n[1-2", "n1-2]", "n[a]", "n[1-]"])
def test_bad_host_lists_are_errors(text):
    with pytest.raises(ValueError):
        L.expand_hostlist(text)


def test_the_rendezvous_horovods_then_torchs_then_slurms():
    slurm = {"SLURM_JOB_NODELIST": "gpu[07-08],cpu1", "SLURM_JOB_ID": "123456"}
    assert L.rendezvous(slurm) == ("gpu07", 10000 + 123456 % 20000)
    assert L.rendezvous(dict(slurm, SLURM_NODELIST="gpu08", SLURM_STEP_NODELIST="cpu[1-2]")) == ("cpu1", 13456)
    assert L.rendezvous(dict(slurm, MASTER_PORT="2345")) == ("gpu07", 2345)  # MASTER_PORT wins
    assert L.rendezvous(dict(slurm, MASTER_ADDR="head", MASTER_PORT="2345")) == ("head", 2345)
    both = dict(slurm, MASTER_ADDR="head", MASTER_PORT="2345", HOROVOD_GLOO_RENDEZVOUS_ADDR="rdv",
                HOROVOD_GLOO_RENDEZVOUS_PORT="3456")
    assert L.rendezvous(both) == ("rdv", 3456)
    assert L.rendezvous({"MASTER_ADDR": "head"}) == ("head", None)
    assert L.rendezvous({}) == (None, None)
    assert L.slurm_rendezvous({"SLURM_JOB_ID": "20000"}) == (None, 10000)


def test_the_no_rendezvous_message_names_the_launcher_and_the_variables():
    text = L.no_rendezvous_message(L.detect({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}))
    for part in ("MVAPICH", "MV2_COMM_WORLD_RANK=1", "rank 1 of 2",
                 "set MASTER_ADDR and MASTER_PORT (or HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT)"):
        assert part in text, text


# ---- real processes ---------------------------------------------------------------------------
INIT = """
import json, sys
import torch
import c10d_ext.horovod as hvd
try:
    hvd.init()
except ValueError as e:
    print("INIT-ERROR " + str(e), flush=True)
    sys.exit(3)
out = hvd.allreduce(torch.tensor([hvd.rank() + 1.0, 2.0 ** hvd.rank()]), op=hvd.Sum)
print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
                             "sum": out.tolist()}), flush=True)
hvd.shutdown()
"""


def _two_ranks(tmp_path, env_for, attempts=3):
    """The INIT script on two processes with env_for(rank, port)'s variables; each one's RESULT.
    The rendezvous port is chosen here and bound later by rank 0: taken in between, it is retried."""
    for attempt in range(attempts):
        port = _free_port_in(10000, 30000)
        results = run_ranks(INIT, [clean_env(env_for(r, port)) for r in range(2)], tmp_path)
        if all(rc == 0 for rc, _ in results):
            break
        if attempt == attempts - 1 or not any("EADDRINUSE" in out or "address already in use" in out.lower()
                                              for _, out in results):
            pytest.fail(_report(results))
    return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for _, out in results]


def _expect_two(results):
    want_sum = [1.0 + 2.0, 1.0 + 2.0]  # rank + 1 summed; 2 ** rank summed
    for r, res in enumerate(results):
        assert res == {"rank": r, "size": 2, "local_rank": r, "sum": want_sum}, (r, res)


def test_a_job_under_slurms_variables_only(tmp_path):
    """Two processes with what srun gives its tasks (no MASTER_*): the rendezvous is the first host
    of SLURM_JOB_NODELIST and the port 10000 + SLURM_JOB_ID mod 20000."""
    def env(rank, port):
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_STEP_ID": "0",
                "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": str(7 * 20000 + port - 10000)}
    _expect_two(_two_ranks(tmp_path, env))


def test_a_job_under_mvapichs_variables(tmp_path):
    def env(rank, port):
        return {"MV2_COMM_WORLD_RANK": str(rank), "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    _expect_two(_two_ranks(tmp_path, env))


@pytest.mark.parametrize("launcher, env_for", [
    ("MVAPICH", lambda r: {"MV2_COMM_WORLD_RANK": str(r), "MV2_COMM_WORLD_SIZE": "2"}),
    ("Slurm", lambda r: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}),
])
def test_without_a_rendezvous_every_rank_raises_a_clear_error(tmp_path, launcher, env_for):
    results = run_ranks(INIT, [clean_env(env_for(r)) for r in range(2)], tmp_path)
    for r, (rc, out) in enumerate(results):
        assert rc == 3, _report(results)
        line = next(ln for ln in out.splitlines() if ln.startswith("INIT-ERROR "))
        for part in (launcher, f"rank {r} of 2", "set MASTER_ADDR and MASTER_PORT (or HOROVOD_GLOO_RENDEZVOUS_ADDR/_PORT)"):
            assert part in line, line


# ==================================================================================== the launcher
PRINT_ENV = """
import json, os, sys
names = {names!r}
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump({{n: os.environ.get(n) for n in names}}, f)
"""
HOROVODRUN_VARS = ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                   "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "MYCCL_HVD_SLOTS")


@pytest.mark.parametrize("mode", [[], ["--min-np", "3"]], ids=["static", "elastic"])
def test_the_launcher_gives_every_worker_horovodruns_variables(tmp_path, mode):
    """-np 3 on two hosts (both this machine; one torch agent each, or the elastic driver's own
    workers): every worker sees horovodrun's variables with Horovod's meanings. The cross rank is
    the host's index among the hosts that have a worker with this local rank: local rank 0 is on
    both hosts, 1 only on the first."""
    script = tmp_path / "env.py"
    script.write_text(PRINT_ENV.format(names=HOROVODRUN_VARS))
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "c10d_ext.horovod.run", "-np", "3", *mode, "-H", "localhost:2,127.0.0.1:1",
            sys.executable, str(script), str(out)]
    try:
        proc = subprocess.run(argv, env=clean_env({}), cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the launched job did not finish:\n{(e.output or b'').decode(errors='replace')[-4000:]}")
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-4000:]
    #        host         rank size local_rank local_size cross_rank cross_size
    want = [("localhost", 0, 3, 0, 2, 0, 2),
            ("localhost", 1, 3, 1, 2, 0, 1),
            ("127.0.0.1", 2, 3, 0, 1, 1, 2)]
    for row in want:
        got = json.loads((out / f"{row[1]}.json").read_text())
        expect = dict(zip(HOROVODRUN_VARS, [str(v) for v in row] + [None]))  # the rank table stays with the wrapper
        assert got == expect, (got, expect)


# ==================================================================================== ignored tuning
WARN = """
import json, warnings
import c10d_ext.horovod as hvd
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hvd.init()
    hvd.shutdown()
    hvd.init()  # a second init in the same process says nothing more
    hvd.shutdown()
print("WARNINGS " + json.dumps([str(w.message) for w in caught if "no effect" in str(w.message)]), flush=True)
"""


def _init_warnings(tmp_path, extra):
    results = run_ranks(WARN, [clean_env(extra)], tmp_path)
    assert results[0][0] == 0, _report(results)
    return json.loads(next(ln for ln in results[0][1].splitlines() if ln.startswith("WARNINGS "))[9:])


def test_one_warning_names_the_ignored_tuning_variables_that_are_set(tmp_path):
    got = _init_warnings(tmp_path, {"HOROVOD_AUTOTUNE": "1", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                    "HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "2"})
    assert len(got) == 1, got
    assert "HOROVOD_AUTOTUNE, HOROVOD_HIERARCHICAL_ALLREDUCE are set but have no effect" in got[0], got
    assert "FUSION_THRESHOLD" not in got[0] and "CYCLE_TIME" not in got[0], got  # those are honoured


def test_no_warning_without_ignored_tuning_variables(tmp_path):
    assert _init_warnings(tmp_path, {"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "4096"}) == []


def test_the_ignored_tuning_list():
    env = {"HOROVOD_CCL_CACHE": "1", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
           "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_TORUS_ALLREDUCE": "", "HOROVOD_TIMELINE": "t.json",
           "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "8", "HOROVOD_RANK": "0"}
    assert L.ignored_tuning(env) == ["HOROVOD_CACHE_CAPACITY", "HOROVOD_CCL_CACHE", "HOROVOD_CONTROLLER",
                                     "HOROVOD_CPU_OPERATIONS"]


# ==================================================================================== elastic removal
REMOVAL = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
import c10d_ext.horovod as hvd
from c10d_ext.horovod.elastic.state import State
from hvd_helpers import elastic_training, write_result

out_dir = sys.argv[1]
wid = os.environ["MYCCL_HVD_WORKER_ID"]
result = {{"steps": [], "resets": [], "interrupts": [], "wid": wid, "host": os.environ["HOROVOD_HOSTNAME"]}}
plain_commit = State.commit


def commit(state):
    try:
        plain_commit(state)
    except hvd.HostsUpdatedInterrupt as e:  # the commit path: every rank sees the update here
        result["interrupts"].append({{"batch": state.batch, "skip_sync": e.skip_sync}})
        print(f"INTERRUPTED {{wid}} at batch {{state.batch}}", flush=True)
        raise


State.commit = commit


def after_step(state):
    if state.batch == 2 and hvd.rank() == 0 and not os.path.exists(os.path.join(out_dir, "committed")):
        open(os.path.join(out_dir, "committed"), "w").close()  # the test now takes a host away
        from c10d_ext.horovod.basics import STATE
        store = dist.PrefixStore("hvd/elastic", STATE.job_store)
        end = time.monotonic() + 60
        while store.add("leaves", 0) < 1 and time.monotonic() < end:
            time.sleep(0.05)  # so that the commit at batch 4 sees the launcher's request


error = None
try:
    torch.set_num_threads(1)
    hvd.init()
    elastic_training(hvd, result, after_step=after_step)
    result["env_size"] = os.environ.get("HOROVOD_SIZE")
    hvd.shutdown()
except SystemExit as e:
    result["exit"] = e.code
    write_result(os.path.join(out_dir, wid + ".json"), result, None)
    raise
except BaseException as e:
    error = e
write_result(os.path.join(out_dir, wid + ".json"), result, error)
sys.exit(1 if error else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("torch").distributed, "_reconfigure"),
                    reason="a new world at a commit is made through torch's reconfigure API (torch >= 2.14)")
def test_a_host_that_leaves_the_discovery_stops_its_worker_at_the_next_commit(tmp_path):
    """-np 3 on 'localhost:2' and '127.0.0.1:1' (both this machine). After the commit at batch 2
    the discovery stops printing 127.0.0.1: its worker (w3) is not terminated; the commit at batch
    4 raises HostsUpdatedInterrupt on all three (hosts removed: no sync), w3 leaves in the reset
    with status 0, and w1, w2 finish the epoch at 2 ranks with one process's parameters."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(REMOVAL.format(tests=TESTS))
    argv = [sys.executable, "-m", "c10d_ext.horovod.run", "-np", "3", "--min-np", "2",
            "--host-discovery-script", f"cat {hosts}", sys.executable, str(script), str(out)]
    proc = subprocess.Popen(argv, env=clean_env({}), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while not (out / "committed").exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        hosts.write_text("localhost:2\n")
        text, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail("the elastic job did not finish in time:\n" + text.decode(errors="replace")[-4000:])
    text = text.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "127.0.0.1[0] leaves the job at its next commit" in text and "has been removed from elastic job" in text, text[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("w*.json")}
    assert sorted(results) == ["w1", "w2", "w3"], (sorted(results), text[-3000:])
    gone = results["w3"]
    assert "error" not in gone, gone["error"]
    assert gone["host"] == "127.0.0.1" and gone["exit"] == 0, gone
    assert gone["interrupts"] == [{"batch": 4, "skip_sync": True}], gone
    assert [(s["batch"], s["size"]) for s in gone["steps"]] == [(b, 3) for b in range(4)], gone["steps"]
    params = []
    for wid in ("w1", "w2"):
        res = results[wid]
        assert "error" not in res, (wid, res["error"])
        assert res["interrupts"] == [{"batch": 4, "skip_sync": True}], (wid, res)
        assert [(s["batch"], s["size"]) for s in res["steps"]] == [(b, 3) for b in range(4)] + [(b, 2) for b in range(4, 8)]
        assert res["resets"] == [{"size": 2, "rank": int(wid[1]) - 1, "batch": 4}], (wid, res["resets"])
        assert res["env_size"] == "2", res  # horovodrun's variables follow the reset
        assert same_as_one_process(res), wid
        params.append(res["params"])
    assert params[0] == params[1]
