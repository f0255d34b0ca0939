"""c10d_ext.horovod's timeline writer, its launcher (horovodrun on torch.distributed.run) and the
two Horovod examples.

* timeline: Horovod's Chrome-trace layout (spec 17.2), valid JSON after every record, threads;
* launcher units: host parsing and slot assignment (Horovod's own cases), flags -> worker
  environment, error texts, remote-shell commands, the per-host torchrun plan;
* launcher processes (plain Python workers): tagged output, --output-filename, exit status of a
  failing rank, two agents on this machine, MYCCL_HVD_RSH, the start timeout;
* end to end (hvd in the workers): both examples under torchrun and under the launcher (2 and 4
  ranks), horovod.run, a training whose parameters every rank must share and match a local
  computation, the timeline through --timeline-filename, and two network-namespace hosts.

Every subprocess has a timeout; nothing here asserts on time.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
import torch

import netns
from harness import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "horovod")
MNIST = os.path.join(EXAMPLES, "pytorch_mnist.py")
BENCH = os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py")
hvdrun = importlib.import_module("c10d_ext.horovod.run")
Timeline = importlib.import_module("c10d_ext.horovod.timeline").Timeline


# =========================================================================================== timeline
def _records(path):
    with open(path) as f:
        return json.load(f)


def test_timeline_header_and_valid_json_after_every_record(tmp_path):
    path = str(tmp_path / "tl.json")
    tl = Timeline(path)
    steps = [lambda: tl.negotiate_start("grad.w", "ALLREDUCE"), lambda: tl.negotiate_rank_ready("grad.w", 0),
             lambda: tl.negotiate_rank_ready("grad.w", 1), lambda: tl.negotiate_end("grad.w"),
             lambda: tl.start("grad.w", "ALLREDUCE"), lambda: tl.activity_start("grad.w", "MEMCPY_IN_FUSION_BUFFER"),
             lambda: tl.activity_end("grad.w"), lambda: tl.activity_start("grad.w", "MPI_ALLREDUCE"),
             lambda: tl.end("grad.w", "float32", (2, 3)), lambda: tl.negotiate_start("bias", "BROADCAST"),
             lambda: tl.negotiate_end("bias"), lambda: tl.start("bias", "BROADCAST"), lambda: tl.end("bias")]
    counts = [len(_records(path))]
    for step in steps:
        step()
        counts.append(len(_records(path)))  # json.load succeeds after every record
    tl.close()
    assert counts[0] == 2 and all(b > a for a, b in zip(counts, counts[1:])), counts
    recs = _records(path)
    head = recs[:2]
    assert head[0]["name"] == "process_name" and head[0]["ph"] == "M" and head[0]["pid"] == 0
    assert isinstance(head[0]["args"]["start_time_since_epoch_in_micros"], int)
    assert head[1] == {"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}
    assert all("tid" not in r for r in recs)
    # one pid per tensor name, in order of appearance, each with its two metadata records
    meta = [r for r in recs[2:] if r["ph"] == "M"]
    assert meta == [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad.w"}},
                    {"name": "process_sort_index", "ph": "M", "pid": 1, "args": {"sort_index": 1}},
                    {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "bias"}},
                    {"name": "process_sort_index", "ph": "M", "pid": 2, "args": {"sort_index": 2}}]
    ev = [r for r in recs if r["ph"] != "M"]
    w = [(r["ph"], r.get("name"), r.get("args")) for r in ev if r["pid"] == 1]
    assert w == [("B", "NEGOTIATE_ALLREDUCE", None), ("X", "0", None), ("X", "1", None), ("E", None, None),
                 ("B", "ALLREDUCE", None), ("B", "MEMCPY_IN_FUSION_BUFFER", None), ("E", None, None),
                 ("B", "MPI_ALLREDUCE", None), ("E", None, None),  # end() closes the open activity first
                 ("E", None, {"dtype": "float32", "shape": "[2, 3]"})]
    b = [(r["ph"], r.get("name"), r.get("args")) for r in ev if r["pid"] == 2]
    assert b == [("B", "NEGOTIATE_BROADCAST", None), ("E", None, None), ("B", "BROADCAST", None),
                 ("E", None, None)]  # an op ended without dtype (failed) has no args
    for r in ev:
        assert list(r)[:1] == ["ph"] and isinstance(r["ts"], int) and r["ts"] >= 0
        assert ("name" in r) == (r["ph"] != "E")
        assert (r.get("dur") == 0) == (r["ph"] == "X")
    ts = [r["ts"] for r in ev]
    assert ts == sorted(ts)


def test_timeline_cycle_markers(tmp_path):
    for mark in (False, True):
        path = str(tmp_path / f"tl{mark}.json")
        tl = Timeline(path, mark_cycles=mark)
        tl.mark_cycle_start()
        tl.negotiate_start("x", "ALLGATHER")
        tl.mark_cycle_start()
        tl.close()
        marks = [r for r in _records(path) if r["ph"] == "i"]
        if not mark:
            assert marks == []
        else:
            assert len(marks) == 2
            for r in marks:
                assert set(r) == {"ph", "name", "ts", "s"} and r["name"] == "CYCLE_START" and r["s"] == "g"


def test_timeline_state_rules_and_values(tmp_path):
    path = str(tmp_path / "tl.json")
    tl = Timeline(path)
    tl.negotiate_start("a", "ALLREDUCE")
    tl.negotiate_start("a", "ALLREDUCE")  # repeated while negotiating: ignored (first call wins)
    tl.negotiate_end("a")
    tl.start("a", "ALLREDUCE")
    tl.activity_end("a")  # no activity open: nothing
    tl.end("a", torch.float16, torch.Size([]))
    tl.start('we"ird\\name\n', "ALLGATHER")
    tl.end('we"ird\\name\n', "int64", torch.Size([4]))
    tl.close()
    tl.start("late", "ALLREDUCE")  # after close: nothing, no error
    tl.close()
    recs = _records(path)
    a = [(r["ph"], r.get("name"), r.get("args")) for r in recs if r.get("pid") == 1 and r["ph"] != "M"]
    assert a == [("B", "NEGOTIATE_ALLREDUCE", None), ("E", None, None), ("B", "ALLREDUCE", None),
                 ("E", None, {"dtype": "float16", "shape": "[]"})]
    names = [r["args"]["name"] for r in recs if r.get("name") == "process_name" and r["pid"]]
    assert names == ["a", 'we"ird\\name\n']
    assert recs[-1]["args"] == {"dtype": "int64", "shape": "[4]"}


def test_timeline_threads(tmp_path):
    path = str(tmp_path / "tl.json")
    tl = Timeline(path, mark_cycles=True)

    def body(t):
        for i in range(100):
            name = f"t{t}.{i % 5}"
            tl.negotiate_start(name, "ALLREDUCE")
            tl.negotiate_rank_ready(name, t)
            tl.negotiate_end(name)
            tl.start(name, "ALLREDUCE")
            tl.activity_start(name, "QUEUE")
            tl.end(name, "float32", [i])
            tl.mark_cycle_start()

    threads = [threading.Thread(target=body, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    tl.close()
    recs = _records(path)
    pids = {r["args"]["name"]: r["pid"] for r in recs if r.get("name") == "process_name" and r["pid"]}
    assert sorted(pids) == sorted(f"t{t}.{j}" for t in range(6) for j in range(5))
    assert sorted(pids.values()) == list(range(1, 31))
    for name, pid in pids.items():
        ev = [r["ph"] for r in recs if r.get("pid") == pid and r["ph"] != "M"]
        assert ev == ["B", "X", "E", "B", "B", "E", "E"] * 20, name
    assert sum(r["ph"] == "i" for r in recs) == 600


def test_timeline_unwritable_path_is_inactive(tmp_path):
    tl = Timeline(str(tmp_path / "no" / "such" / "dir" / "tl.json"))
    assert not tl.active
    tl.negotiate_start("x", "ALLREDUCE")
    tl.end("x", "float32", [1])
    tl.close()


# =========================================================================================== launcher units
def test_host_parsing_and_errors(tmp_path):
    assert hvdrun.parse_hosts("worker-0:2,worker-1:4") == [("worker-0", 2), ("worker-1", 4)]
    assert hvdrun.parse_hosts(" a.b-c:1, 10.0.0.2:3") == [("a.b-c", 1), ("10.0.0.2", 3)]
    for bad in ("worker-0", "w:2,x", "w:two", "w:2,", "h/1:2"):
        with pytest.raises(ValueError) as e:
            hvdrun.parse_hosts(bad)
        assert str(e.value) == "Invalid host input, please make sure it has format as : worker-0:2,worker-1:2."
    f = tmp_path / "hostfile"
    f.write_text("host1 slots=2\n\n# comment\n10.0.0.2 slots=4\n")
    assert hvdrun.parse_host_files(str(f)) == "host1:2,10.0.0.2:4"


def S(host, rank, lr, cr, size, ls, cs):
    return hvdrun.SlotInfo(hostname=host, rank=rank, local_rank=lr, cross_rank=cr, size=size, local_size=ls,
                           cross_size=cs)


def test_host_assignments_as_horovod():
    hosts = hvdrun.parse_hosts("worker-0:2,worker-1:2")
    assert hvdrun.get_host_assignments(hosts, 4) == [
        S("worker-0", 0, 0, 0, 4, 2, 2), S("worker-0", 1, 1, 0, 4, 2, 2),
        S("worker-1", 2, 0, 1, 4, 2, 2), S("worker-1", 3, 1, 1, 4, 2, 2)]
    assert hvdrun.get_host_assignments(hosts, 1, 2) == [S("worker-0", 0, 0, 0, 2, 2, 1),
                                                         S("worker-0", 1, 1, 0, 2, 2, 1)]
    assert hvdrun.get_host_assignments(hvdrun.parse_hosts("worker-0:1,worker-1:2"), 3) == [
        S("worker-0", 0, 0, 0, 3, 1, 2), S("worker-1", 1, 0, 1, 3, 2, 2), S("worker-1", 2, 1, 0, 3, 2, 1)]
    with pytest.raises(ValueError) as e:
        hvdrun.get_host_assignments(hosts, 5, 5)
    assert str(e.value) == "Requested more processes (5) than there are available slots (4)"


def test_parse_args_defaults_and_errors(tmp_path, capsys):
    a = hvdrun.parse_args(["-np", "3", "python", "train.py", "--epochs", "2", "-np", "9"])
    assert a.num_proc == 3 and a.hosts == "localhost:3"
    assert a.command == ["python", "train.py", "--epochs", "2", "-np", "9"]  # the rest belongs to the command
    f = tmp_path / "hf"
    f.write_text("a slots=1\nb slots=2\n")
    assert hvdrun.parse_args(["-np", "3", "-hostfile", str(f), "true"]).hosts == "a:1,b:2"
    assert hvdrun.parse_args(["-cb"]).check_build
    for argv, text in ((["python", "x.py"], "the following arguments are required: -np/--num-proc"),
                       (["-np", "2", "-H", "a:2", "-hostfile", str(f), "true"], "not allowed with argument"),
                       (["--min-np", "2", "--host-discovery-script", "./d.sh"], "no command to run"),
                       (["-np", "2", "--log-level", "LOUD", "true"], "invalid choice"),
                       (["-np", "2"], "no command to run")):
        with pytest.raises(SystemExit):
            hvdrun.parse_args(argv)
        assert text in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^fusion_threshold_mb=-1 must be >= 0$"):
        hvdrun.parse_args(["-np", "1", "--fusion-threshold-mb", "-1", "true"])
    with pytest.raises(ValueError, match=r"^autotune_gaussian_process_noise=1.5 must be in \[0, 1\]$"):
        hvdrun.parse_args(["-np", "1", "--autotune-gaussian-process-noise", "1.5", "true"])


def _env_of(argv):
    return hvdrun.set_env_from_args({}, hvdrun.parse_args(argv + ["true"]))


def test_worker_environment_of_the_flags():
    assert _env_of(["-np", "2"]) == {}  # nothing set, nothing exported
    env = _env_of(["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--cache-capacity", "0",
                   "--hierarchical-allreduce", "--no-hierarchical-allgather", "--torus-allreduce",
                   "--timeline-filename", "/tmp/tl.json", "--timeline-mark-cycles", "--no-stall-check",
                   "--stall-check-warning-time-seconds", "5", "--stall-check-shutdown-time-seconds", "20",
                   "--mpi-threads-disable", "--tcp", "--num-nccl-streams", "2", "--thread-affinity", "1",
                   "--gloo-timeout-seconds", "9", "--log-level", "DEBUG", "--log-without-timestamp"])
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "2.5",
                   "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                   "HOROVOD_HIERARCHICAL_ALLGATHER": "0", "HOROVOD_TORUS_ALLREDUCE": "1",
                   "HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                   "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20", "HOROVOD_MPI_THREADS_DISABLE": "1",
                   "NCCL_IB_DISABLE": "1", "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_THREAD_AFFINITY": "1",
                   "HOROVOD_GLOO_TIMEOUT_SECONDS": "9", "HOROVOD_LOG_LEVEL": "DEBUG", "HOROVOD_LOG_HIDE_TIME": "1"}
    # mark-cycles only with a timeline file; autotune values only with --autotune
    assert _env_of(["-np", "1", "--timeline-mark-cycles", "--autotune-warmup-samples", "4"]) == {}
    assert _env_of(["-np", "1", "--autotune", "--autotune-log-file", "a.csv", "--autotune-warmup-samples", "4",
                    "--autotune-steps-per-sample", "7", "--autotune-bayes-opt-max-samples", "8",
                    "--autotune-gaussian-process-noise", "0.5"]) == {
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "a.csv", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "4",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "7", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "8",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5"}
    assert _env_of(["-np", "1", "--stall-check", "--log-with-timestamp"]) == {
        "HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_LOG_HIDE_TIME": "0"}
    with pytest.warns(DeprecationWarning, match="--log-hide-timestamp has been replaced by --log-without-timestamp"):
        assert _env_of(["-np", "1", "--log-hide-timestamp"]) == {"HOROVOD_LOG_HIDE_TIME": "1"}
    with pytest.warns(DeprecationWarning, match="Providing multiple interfaces via --network-interface is deprecated"):
        env = _env_of(["-np", "1", "--network-interface", "eth1,eth0", "--network-interfaces", "ib0"])
    assert env == {"HOROVOD_GLOO_IFACE": "eth0", "NCCL_SOCKET_IFNAME": "eth0,eth1,ib0",
                   "MYCCL_SOCKET_IFNAME": "=eth0,eth1,ib0"}


def test_config_file_json_and_flags_win(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(json.dumps({"params": {"fusion_threshold_mb": 8, "cycle_time_ms": 3},
                               "timeline": {"filename": "t.json", "mark_cycles": True},
                               "stall_check": {"enabled": False}, "logging": {"level": "INFO"}}))
    env = _env_of(["-np", "1", "--config-file", str(cfg), "--cycle-time-ms", "7"])
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(8 << 20), "HOROVOD_CYCLE_TIME": "7.0", "HOROVOD_TIMELINE": "t.json",
                   "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_LOG_LEVEL": "INFO"}


def test_remote_shell_commands(monkeypatch):
    monkeypatch.delenv(hvdrun.RSH_ENV, raising=False)
    assert hvdrun.remote_argv("h1", "echo hi") == ["ssh", "-o", "PasswordAuthentication=no", "-o",
                                                   "StrictHostKeyChecking=no", "h1", "echo hi"]
    assert hvdrun.remote_argv("h1", "echo hi", ssh_port=2222, ssh_identity_file="/k") == [
        "ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", "-p", "2222", "-i", "/k", "h1",
        "echo hi"]
    monkeypatch.setenv(hvdrun.RSH_ENV, "ip netns exec {host}")
    assert hvdrun.remote_argv("ns1", "echo hi") == ["ip", "netns", "exec", "ns1", "/bin/sh", "-c", "echo hi"]
    monkeypatch.setenv(hvdrun.RSH_ENV, "ssh -p 2200 {host} {command}")
    assert hvdrun.remote_argv("h2", "cd /x ; run") == ["ssh", "-p", "2200", "h2", "cd /x ; run"]


def test_launch_plan(monkeypatch):
    a = hvdrun.parse_args(["-np", "3", "-H", "localhost:2,127.0.0.1:2", "--cycle-time-ms", "4", "--start-timeout",
                           "12", "python", "t.py"])
    plan = hvdrun.plan_launch(a, environ={"KEEP": "1"})
    assert [(h.host, h.node_rank, h.nproc, h.ranks, h.local) for h in plan] == [
        ("localhost", 0, 2, [0, 1], True), ("127.0.0.1", 1, 1, [2], True)]
    for h in plan:
        argv = h.argv
        opt = {argv[i]: argv[i + 1] for i in range(3, argv.index("--no-python"), 2)}
        assert opt["--nnodes"] == "2" and opt["--node-rank"] == str(h.node_rank)
        assert opt["--nproc-per-node"] == str(h.nproc) and opt["--master-addr"] == "127.0.0.1"
        assert opt["--rdzv-conf"] == "timeout=12" and opt["--max-restarts"] == "0"
        assert argv[-3:] == ["--", "python", "t.py"]
        assert h.env["KEEP"] == "1" and h.env["HOROVOD_CYCLE_TIME"] == "4.0" and h.env["PYTHONUNBUFFERED"] == "1"
        assert h.env["HOROVOD_HOSTNAME"] == h.host
    ports = {h.argv[h.argv.index("--master-port") + 1] for h in plan}
    assert len(ports) == 1
    # a host of slots beyond -np gets no agent; a remote first host is the master address
    a = hvdrun.parse_args(["-np", "2", "-H", "10.255.255.1:2,10.255.255.2:2", "true"])
    plan = hvdrun.plan_launch(a, environ={})
    assert [(h.host, h.local) for h in plan] == [("10.255.255.1", False)]
    assert plan[0].argv[plan[0].argv.index("--master-addr") + 1] == "10.255.255.1"
    line = hvdrun._command_line(plan[0])
    assert line.startswith(f"cd {os.getcwd()} > /dev/null 2>&1 ; exec env ") and "HOROVOD_HOSTNAME=10.255.255.1" in line
    assert hvdrun.is_local_host("localhost") and not hvdrun.is_local_host("no-such-host.invalid")


def test_main_prints_the_errors(capsys):
    for argv, text in ((["-np", "2", "-H", "bad", "true"],
                        "Invalid host input, please make sure it has format as : worker-0:2,worker-1:2."),
                       (["-np", "5", "-H", "a:2,b:2", "true"],
                        "Requested more processes (5) than there are available slots (4)")):
        with pytest.raises(SystemExit) as e:
            hvdrun.main(argv)
        assert e.value.code == 1 and text in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        hvdrun.main(["-cb"])
    assert e.value.code == 0 and "[X] PyTorch" in capsys.readouterr().out


# =========================================================================================== processes
def _env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    for k in ("MYCCL_HVD_RSH", "MYCCL_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
              "MASTER_PORT", "HOROVOD_TIMELINE"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _run(cmd, timeout=240, env=None, cwd=None):
    """Runs cmd (its own session); on a timeout SIGTERM (the launcher stops its agents), then SIGKILL."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(env), cwd=cwd,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        pytest.fail(f"{cmd} did not finish within {timeout} s:\n{out[-5000:]}")
    return p.returncode, out


def launcher(*args):
    return [sys.executable, "-m", "c10d_ext.horovod.run", *args]


def tagged(out, rank, stream="stdout"):
    tag = f"[{rank}]<{stream}>:"
    return [line[line.index(tag) + len(tag):] for line in out.splitlines() if tag in line]


def test_launcher_tags_output_and_exports(tmp_path):
    code = ("import os; e = os.environ; print(e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['HOROVOD_HOSTNAME'], "
            "e['HOROVOD_FUSION_THRESHOLD'], e['PYTHONUNBUFFERED']); import sys; print('to-err', file=sys.stderr)")
    rc, out = _run(launcher("-np", "2", "--fusion-threshold-mb", "0", "--output-filename", str(tmp_path / "out"),
                            sys.executable, "-c", code), cwd=str(tmp_path))
    assert rc == 0, out
    for r in range(2):
        assert tagged(out, r) == [f"{r} 2 {r} localhost 0 1"], out
        assert tagged(out, r, "stderr") == ["to-err"], out
        d = tmp_path / "out" / f"rank.{r}"
        assert (d / "stdout").read_text() == f"[{r}]<stdout>:{r} 2 {r} localhost 0 1\n"
        assert (d / "stderr").read_text() == f"[{r}]<stderr>:to-err\n"


def test_launcher_output_filename_pads_ranks(tmp_path):
    rc, out = _run(launcher("-np", "11", "--output-filename", str(tmp_path / "o"), sys.executable, "-c",
                            "import os; print('r', os.environ['RANK'])"), cwd=str(tmp_path))
    assert rc == 0, out
    assert sorted(os.listdir(tmp_path / "o")) == [f"rank.{r:02d}" for r in range(11)]
    assert (tmp_path / "o" / "rank.10" / "stdout").read_text() == "[10]<stdout>:r 10\n"


def test_launcher_returns_the_failing_rank_status(tmp_path):
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(120)"
    rc, out = _run(launcher("-np", "2", sys.executable, "-c", code), timeout=150)
    assert rc == 3, out
    assert "Process 1 exit with status code 3." in out
    assert ("Horovod detected that one or more processes exited with non-zero status, thus causing the job to be "
            "terminated. The first process to do so was:\nProcess name: localhost\nExit code: 3") in out


def test_launcher_two_agents_on_this_machine(tmp_path):
    code = "import os; e = os.environ; print(e['RANK'], e['GROUP_RANK'], e['LOCAL_RANK'], e['HOROVOD_HOSTNAME'])"
    rc, out = _run(launcher("-np", "3", "-H", "localhost:2,127.0.0.1:2", sys.executable, "-c", code))
    assert rc == 0, out
    assert [tagged(out, r) for r in range(3)] == [["0 0 0 localhost"], ["1 0 1 localhost"], ["2 1 0 127.0.0.1"]], out


def test_launcher_remote_hosts_through_rsh_template(tmp_path):
    code = "import os; e = os.environ; print(e['RANK'], e.get('VIA_RSH'), e['HOROVOD_HOSTNAME'], os.getcwd())"
    rc, out = _run(launcher("-np", "2", "-H", "localhost:1,fakehost.invalid:1", sys.executable, "-c", code),
                   env={"MYCCL_HVD_RSH": "env VIA_RSH={host}"}, cwd=str(tmp_path))
    assert rc == 0, out
    assert tagged(out, 0) == [f"0 None localhost {tmp_path}"], out
    assert tagged(out, 1) == [f"1 fakehost.invalid fakehost.invalid {tmp_path}"], out


def test_launcher_start_timeout(tmp_path):
    # the second host's shell never starts its agent: the first one gives up after --start-timeout
    rc, out = _run(launcher("-np", "2", "-H", "localhost:1,fakehost.invalid:1", "--start-timeout", "3",
                            sys.executable, "-c", "print('never')"),
                   env={"MYCCL_HVD_RSH": "sh -c 'sleep 120' {host}"}, timeout=150)
    assert rc != 0, out
    assert ("Timed out waiting for all hosts to join the rendezvous. Please check connectivity between servers. "
            "You may need to increase the --start-timeout parameter if you have too many servers.") in out
    assert "never" not in out


# =========================================================================================== end to end
TRAIN = r'''
import os, sys, torch
import c10d_ext.horovod as hvd
hvd.init()
torch.manual_seed(1234 + hvd.rank())  # each rank starts elsewhere: the broadcast must fix that
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(99 + hvd.rank())  # each rank its own data
for step in range(5):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
torch.save({"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "params": [p.detach().clone() for p in model.parameters()]},
           os.path.join(sys.argv[1], "rank%d.pt" % hvd.rank()))
hvd.shutdown()
'''


def expected_training(size):
    """TRAIN's result computed here: rank 0's start, the gradient averaged over the ranks' batches."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gens = [torch.Generator().manual_seed(99 + r) for r in range(size)]
    for _ in range(5):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for g in gens:
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads = [a + p.grad / size for a, p in zip(grads, model.parameters())]
        for p, gr in zip(model.parameters(), grads):
            p.grad = gr
        opt.step()
    return [p.detach() for p in model.parameters()]


def check_training(out_dir, size, topology):
    want = expected_training(size)
    for r in range(size):
        res = torch.load(os.path.join(out_dir, f"rank{r}.pt"))
        assert (res["rank"], res["size"]) == (r, size)
        assert (res["local_rank"], res["local_size"], res["cross_rank"], res["cross_size"]) == topology[r], res
        for a, b in zip(res["params"], want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (r, (a - b).abs().max())
        first = torch.load(os.path.join(out_dir, "rank0.pt"))["params"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], first)), f"rank {r} differs from rank 0"


MNIST_ARGS = ["--no-cuda", "--epochs", "1", "--log-interval", "200", "--train-samples", "12000"]
BENCH_ARGS = ["--no-cuda", "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
              "--num-iters", "2"]


def check_mnist(out, size, launched):
    """The example's output: rank 0's test line (once), every rank's first training line. Under
    plain torchrun the ranks' unbuffered prints may share a line: count matches, not lines."""
    text = "\n".join(line.split(">:", 1)[1] for line in out.splitlines() if "]<stdout>:" in line) if launched else out
    tests = re.findall(r"Test set: Average loss: (\d+\.\d{4}), Accuracy: (\d+\.\d{2})%\n", text)
    assert len(tests) == 1, out[-5000:]  # printed by rank 0 only
    assert float(tests[0][1]) > 50.0, tests
    share = 12000 // size  # MNIST_ARGS's --train-samples
    assert text.count(f"Train Epoch: 1 [0/{share} (0%)]\tLoss: ") == size, out[-5000:]  # every rank logs
    if launched:
        assert {line.split("]<", 1)[0] for line in out.splitlines() if f"[0/{share} (0%)]" in line} == \
            {f"[{r}" for r in range(size)}


def check_bench(out, size):
    text = "\n".join(x for x in out.splitlines())
    for pat in (r"Model: smallcnn", r"Batch size: 4", rf"Number of CPUs: {size}", r"Running warmup\.\.\.",
                r"Running benchmark\.\.\.", r"Iter #0: \d+\.\d img/sec per CPU", r"Iter #1: \d+\.\d img/sec per CPU",
                r"Img/sec per CPU: \d+\.\d \+-\d+\.\d", rf"Total img/sec on {size} CPU\(s\): \d+\.\d \+-\d+\.\d"):
        hits = re.findall(r"(?m)^(?:\[0\]<stdout>:)?" + pat + "$", text)
        assert len(hits) == 1, (pat, out[-4000:])  # rank 0 logs, once


def torchrun(n, *cmd):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *cmd]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_mnist_under_torchrun(tmp_path):
    rc, out = _run(torchrun(2, MNIST, *MNIST_ARGS), timeout=1200, cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    check_mnist(out, 2, launched=False)


def test_benchmark_under_torchrun(tmp_path):
    rc, out = _run(torchrun(2, BENCH, *BENCH_ARGS), cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    check_bench(out, 2)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("n", [4])  # 2 ranks under the launcher: the benchmark and the training tests
def test_mnist_under_launcher(tmp_path, n):
    rc, out = _run(launcher("-np", str(n), sys.executable, MNIST, *MNIST_ARGS), timeout=1200, cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    check_mnist(out, n, launched=True)


@pytest.mark.parametrize("n", [4])  # 2 ranks: under torchrun above, and the launcher's training test
def test_benchmark_under_launcher(tmp_path, n):
    rc, out = _run(launcher("-np", str(n), sys.executable, BENCH, *BENCH_ARGS), cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    check_bench(out, n)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_mnist_through_horovod_run(tmp_path):
    rc, out = _run([sys.executable, MNIST, "--num-proc", "2", "--communication", "gloo", *MNIST_ARGS], timeout=1200,
                   cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    assert out.splitlines()[0] == "Running training through horovod.run"
    check_mnist(out, 2, launched=True)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("hvdrun-")]  # the work directory is removed


def test_horovod_run_returns_results_by_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import c10d_ext.horovod as hvd\nfrom c10d_ext.horovod.run import run\n\n"
                      "def work(base, scale=1):\n    hvd.init()\n    r, s = hvd.rank(), hvd.size()\n"
                      "    hvd.shutdown()\n    return (base + r) * scale, s\n\n"
                      "if __name__ == '__main__':\n    print('RESULTS', run(work, args=(10,), kwargs={'scale': 2}, "
                      "num_proc=3))\n")
    rc, out = _run([sys.executable, str(script)], cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    assert "RESULTS [(20, 3), (22, 3), (24, 3)]" in out, out[-3000:]


@pytest.mark.parametrize("hosts,n,topology", [
    ("localhost:2", 2, [(0, 2, 0, 1), (1, 2, 0, 1)]),
    # two torchrun agents (static rendezvous across "hosts") that are both this machine: hvd's local
    # and cross ranks are the machine's (one host of 3 ranks), as myccl sees it
    ("localhost:2,127.0.0.1:2", 3, [(0, 3, 0, 1), (1, 3, 0, 1), (2, 3, 0, 1)])])
def test_training_under_launcher_matches_local_computation(tmp_path, hosts, n, topology):
    (tmp_path / "train.py").write_text(TRAIN)
    rc, out = _run(launcher("-np", str(n), "-H", hosts, sys.executable, str(tmp_path / "train.py"), str(tmp_path)),
                   cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    check_training(str(tmp_path), n, topology)


TIMELINE_JOB = r'''
import torch
import c10d_ext.horovod as hvd
hvd.init()
for i in range(3):
    hvd.allreduce(torch.ones(2, 3) * hvd.rank(), name="t.sum")
hvd.allgather(torch.ones(1, 4), name="t.gather")
hvd.broadcast(torch.ones(5), root_rank=0, name="t.bcast")
hvd.shutdown()
'''


def _timeline_run(tmp_path):
    (tmp_path / "job.py").write_text(TIMELINE_JOB)
    tl = tmp_path / "timeline.json"
    rc, out = _run(launcher("-np", "2", "--timeline-filename", str(tl), "--timeline-mark-cycles", sys.executable,
                            str(tmp_path / "job.py")), cwd=str(tmp_path))
    assert rc == 0, out[-5000:]
    recs = _records(tl)
    pids = {r["args"]["name"]: r["pid"] for r in recs if r.get("name") == "process_name" and r["pid"]}
    return recs, pids


# Horovod's names (<op>.<name>), response types, and the output's dtype and shape
TIMELINE_WANT = {"allreduce.t.sum": ("ALLREDUCE", "float32", "[2, 3]"),
                 "allgather.t.gather": ("ALLGATHER", "float32", "[2, 4]"),
                 "broadcast.t.bcast": ("BROADCAST", "float32", "[5]")}


def test_timeline_through_the_launcher(tmp_path):
    recs, pids = _timeline_run(tmp_path)
    assert recs[0]["name"] == "process_name" and recs[0]["pid"] == 0 and recs[1]["name"] == "process_sort_index"
    assert all("tid" not in r for r in recs)
    assert any(r["ph"] == "i" and r["name"] == "CYCLE_START" for r in recs)
    assert sorted(pids.values()) == list(range(1, len(pids) + 1))
    for name, (kind, dtype, _) in TIMELINE_WANT.items():
        assert name in pids, (name, sorted(pids))
        ev = [r for r in recs if r.get("pid") == pids[name] and r["ph"] != "M"]
        names = [r.get("name") for r in ev]
        assert f"NEGOTIATE_{kind}" in names and kind in names, (name, names)
        assert {r["name"] for r in ev if r["ph"] == "X"} == {"0", "1"}, (name, ev)
        ends = [r for r in ev if r["ph"] == "E" and "args" in r]
        assert ends and all(r["args"]["dtype"] == dtype for r in ends), (name, ends)
        assert sum(r["ph"] == "B" for r in ev) == sum(r["ph"] == "E" for r in ev), (name, ev)


def test_timeline_end_args_are_the_output_shape(tmp_path):
    # Horovod writes e.output's shape: an allgather's E shows the gathered shape
    recs, pids = _timeline_run(tmp_path)
    for name, (_, dtype, shape) in TIMELINE_WANT.items():
        ends = [r["args"] for r in recs if r.get("pid") == pids.get(name) and r["ph"] == "E" and "args" in r]
        assert ends and all(a == {"dtype": dtype, "shape": shape} for a in ends), (name, ends)


# =========================================================================================== namespace hosts
_ns_ok, _ns_why = netns.available()


@pytest.mark.skipif(not _ns_ok, reason=_ns_why or "network namespaces unavailable")
def test_launcher_across_two_namespace_hosts(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    with netns.Hosts(2) as hosts:
        rsh = tmp_path / "rsh.sh"  # host address -> its namespace
        cases = "".join(f"  {a}) ns={n} ;;\n" for a, n in zip(hosts.addrs, hosts.names))
        rsh.write_text(f'#!/bin/sh\nhost=$1; shift\ncase "$host" in\n{cases}  *) exit 255 ;;\nesac\n'
                       'exec ip netns exec "$ns" "$@"\n')
        env = {"MYCCL_HVD_RSH": f"sh {rsh} {{host}}"}
        H = ",".join(f"{a}:2" for a in hosts.addrs)
        rc, out = _run(launcher("-np", "4", "-H", H, "--verbose", sys.executable, str(tmp_path / "train.py"),
                                str(tmp_path)), env=env, cwd=str(tmp_path), timeout=300)
        assert rc == 0, out[-5000:]
        for addr in hosts.addrs:  # both hosts are remote here: started through MYCCL_HVD_RSH
            assert out.count(f"[{addr}] sh {rsh} {addr} /bin/sh -c ") == 1, out[:3000]
        check_training(str(tmp_path), 4, [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)])
        rc, out = _run(launcher("-np", "4", "-H", H, sys.executable, BENCH, *BENCH_ARGS), env=env,
                       cwd=str(tmp_path), timeout=300)
        assert rc == 0, out[-5000:]
        check_bench(out, 4)
