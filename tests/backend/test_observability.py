"""Timeline, flight recorder and its analyzer, stats, logging, SIGUSR1 dumps and the info CLI."""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from harness import ROOT


def body_trace(ctx, prefix):
    import c10d_ext

    c10d_ext.trace.start(prefix)
    ctx.init()
    x = torch.ones(1000)
    for _ in range(3):
        dist.all_reduce(x)
    dist.broadcast(x, src=1)
    out = torch.empty(2000)
    dist.all_gather_into_tensor(out, x)
    if ctx.rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(x, 0)
    t0 = c10d_ext.trace.now_us()
    c10d_ext.trace.complete("bucket 0", t0, t0 + 5, track="ddp", bucket=0)
    dist.destroy_process_group()
    return c10d_ext.trace.stop(f"{prefix}.rank{ctx.rank}.json")


def test_trace_events(run, tmp_path):
    prefix = str(tmp_path / "trace")
    paths = run(2, body_trace, prefix)
    for rank, path in enumerate(paths):
        with open(path) as f:
            trace = json.load(f)
        ops = [e for e in trace["traceEvents"] if e.get("cat") == "myccl" and e["ph"] == "X" and "seq" in e["args"]]
        names = [e["name"] for e in ops]
        assert names.count("all_reduce") == 3, names
        assert {"broadcast", "all_gather_into_tensor"} <= set(names), names
        assert ("send" if rank == 0 else "recv") in names, names
        ar = next(e for e in ops if e["name"] == "all_reduce")
        args = ar["args"]
        assert args["seq"] == 1 and args["dtype"] == "float32" and args["bytes"] == 4000, args
        assert args["algorithm"] == "shm-one-step" and args["transport"] == "shm", args
        assert args["queued_us"] <= ar["ts"] and ar["dur"] >= 0
        seqs = [e["args"]["seq"] for e in ops if not e["args"]["op"].startswith(("send", "recv"))]
        assert seqs == sorted(seqs) and seqs[0] == 1, seqs
        assert any(e["name"] == "bucket 0" for e in trace["traceEvents"])
        assert all(e["pid"] == rank for e in trace["traceEvents"])
    merged = tmp_path / "merged.json"
    res = subprocess.run([sys.executable, "-m", "c10d_ext.trace", "merge", *paths, "-o", str(merged)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.returncode == 0, res.stderr
    with open(merged) as f:
        m = json.load(f)
    assert {e["pid"] for e in m["traceEvents"]} == {0, 1}


def body_stuck(ctx, dump_dir, kind):
    import c10d_ext

    ctx.init(timeout=3, pg_options=c10d_ext.Options(flight_recorder_dump=dump_dir))
    x = torch.ones(100)
    for _ in range(4):
        dist.all_reduce(x)
    try:
        if kind == "stuck":
            if ctx.rank == 2:
                time.sleep(4.5)  # never joins all_reduce #5
                # Its dump comes from the peer-failure hook once the others' failure reaches it;
                # how long after their 3 s timeout depends on the machine's load, so wait for it
                # (bounded) instead of leaving the group after a fixed sleep, which races it.
                deadline = time.monotonic() + 30
                while not glob.glob(os.path.join(dump_dir, "*_rank2_*.json")) and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                dist.all_reduce(x)
        else:  # mismatch: rank 1 calls broadcast where the others call all_reduce
            if ctx.rank == 1:
                dist.broadcast(x, src=0)
            else:
                dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        return str(e)
    time.sleep(0.5)
    return "no error"


@pytest.mark.parametrize("kind", ["stuck", "mismatch"])
def test_flight_recorder_analyzer(run, tmp_path, kind):
    from c10d_ext.trace import analyze

    dump_dir = str(tmp_path / "dumps")
    msgs = run(3, body_stuck, dump_dir, kind, timeout=60)
    assert any("flight recorder:" in m for m in msgs), msgs
    files = glob.glob(os.path.join(dump_dir, "*.json"))
    assert len(files) == 3, files  # the failing ranks and, through the peer-failure hook, the others
    with open(files[0]) as f:
        dump = json.load(f)
    assert dump["world_size"] == 3 and dump["entries"], dump
    report = analyze([dump_dir])
    if kind == "stuck":
        assert "rank 2 never called #5" in report, report
        assert "stuck in all_reduce #5" in report, report
    else:
        assert "MISMATCH at #5" in report and "broadcast" in report and "all_reduce" in report, report


def body_torch_fr(ctx):
    """torch 2.15's flight recorder records myccl's ops through its hook; with myccl's completion
    hooks its entries say 'completed' (before, every one stayed 'scheduled', so a hung op looked
    like a finished one). Rank 2 never joins all_reduce #5; ranks 0 and 1 time out, and torch's
    abort hook dumps their traces; rank 2 dumps its own."""
    import pickle

    ctx.init(timeout=3)
    x = torch.ones(100)
    for _ in range(4):
        dist.all_reduce(x)
    states = [e["state"] for e in pickle.loads(torch._C._distributed_c10d._dump_fr_trace(backend="myccl"))["entries"]]
    if ctx.rank == 2:
        time.sleep(5)
        torch._C._distributed_c10d._dump_fr_trace_file(ctx.rank, backend="myccl")
        return states, None
    try:
        dist.all_reduce(x)
        return states, "no error"
    except Exception as e:  # noqa: BLE001
        return states, str(e)


def test_torch_flight_recorder_analyzer_reads_myccl_jobs(run, tmp_path):
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace_file") or not hasattr(
            dist.distributed_c10d, "_maybe_attach_flight_recorder"):
        pytest.skip(f"torch {torch.__version__} does not record other backends' ops in its flight recorder")
    dumps = tmp_path / "fr"
    dumps.mkdir()
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(dumps / "trace_rank_"), "MYCCL_TEST_WORLD": f"torchfr-{tmp_path.name}"}
    res = run(3, body_torch_fr, timeout=90, world_env=env)
    for rank, (states, err) in enumerate(res):
        assert states[-4:] == ["completed"] * 4, (rank, states)
        if rank < 2:
            assert "Timed out" in err, err
    assert sorted(os.listdir(dumps)) == ["trace_rank_0", "trace_rank_1", "trace_rank_2"]
    import pickle

    with open(dumps / "trace_rank_0", "rb") as f:
        last = pickle.load(f)["entries"][-1]
    # A failed op is never reported completed (torch's contract for completion hooks).
    assert last["collective_seq_id"] == 5 and last["state"] != "completed", last
    out = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps)],
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert "Not all ranks joining collective, sequence number: 5" in text, text[-3000:]
    assert "missing ranks: {2}" in text and "myccl:all_reduce" in text, text[-3000:]


def body_stats(ctx):
    import c10d_ext

    ctx.init()
    c10d_ext.reset_stats()
    for _ in range(7):
        dist.all_reduce(torch.ones(10))
    for _ in range(3):
        dist.all_reduce(torch.ones(1 << 20))
    dist.broadcast(torch.ones(5), src=0)
    return c10d_ext.stats()


def test_stats_count_what_ran(run):
    st = run(2, body_stats)[0]
    assert st["all_reduce/shm-one-step"]["count"] == 7
    assert st["all_reduce/shm-one-step"]["bytes"] == 7 * 40
    assert st["all_reduce/shm-reduce-scatter-all-gather"]["count"] == 3
    assert st["broadcast/shm-pipelined"]["count"] == 1
    assert all(v["seconds"] > 0 for v in st.values())


def body_sigusr1(ctx, dump_dir):
    import c10d_ext

    ctx.init(pg_options=c10d_ext.Options(flight_recorder_dump=dump_dir))
    dist.all_reduce(torch.ones(10))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(50):
        if glob.glob(os.path.join(dump_dir, f"*_rank{ctx.rank}_pid{os.getpid()}.json")):
            return True
        time.sleep(0.05)
    return False


def test_sigusr1_dumps(run, tmp_path):
    assert all(run(2, body_sigusr1, str(tmp_path / "usr1")))
    for path in glob.glob(str(tmp_path / "usr1" / "*.json")):
        with open(path) as f:
            d = json.load(f)
        assert d["reason"] == "SIGUSR1"
        assert [e["op"] for e in d["entries"]] == ["all_reduce", "barrier"]


def test_cpp_messages_reach_python_logging(caplog):
    import c10d_ext

    with caplog.at_level(logging.INFO, logger="c10d_ext"):
        c10d_ext._C.set_log_level(logging.INFO)
        c10d_ext._C._log(logging.WARNING, "a warning from C++")
        c10d_ext._C._log(logging.DEBUG, "debug is filtered out in C++")
        for _ in range(100):
            if any("a warning from C++" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.02)
        c10d_ext._C.set_log_level(logging.WARNING)
    msgs = [r.getMessage() for r in caplog.records if r.name == "c10d_ext"]
    assert "a warning from C++" in msgs
    assert not any("debug is filtered" in m for m in msgs)


def test_info_cli():
    env = dict(os.environ, PYTHONPATH=ROOT, MYCCL_NUM_THREADS="3")
    res = subprocess.run([sys.executable, "-m", "c10d_ext.info"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "built for torch" in out and "reduction kernels" in out
    assert "MYCCL_NUM_THREADS" in out and "3" in out.split("MYCCL_NUM_THREADS", 1)[1].splitlines()[0]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "c10d_ext.info"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "topology: 2 ranks on 1 host(s)" in res.stdout and "shared memory" in res.stdout, res.stdout


def test_hierarchical_is_auto_unless_forced():
    import c10d_ext
    from c10d_ext import config
    from c10d_ext.backend import make_config

    assert make_config(environ={}).hierarchical == -1  # auto: chosen from the measured link
    assert make_config(environ={}).link_mbit == 0  # measured, not declared
    for raw, want in (("auto", -1), ("1", 1), ("yes", 1), ("0", 0), ("off", 0)):
        assert config.parse_env({"MYCCL_HIERARCHICAL": raw})["hierarchical"] == want, raw
    assert make_config(c10d_ext.Options(hierarchical=True), environ={}).hierarchical == 1
    assert make_config(c10d_ext.Options(hierarchical=False), environ={}).hierarchical == 0
    assert make_config(environ={"MYCCL_LINK_MBIT": "25000"}).link_mbit == 25000
    with pytest.raises(ValueError, match="MYCCL_HIERARCHICAL.*expected auto, 0/1 or true/false"):
        config.parse_env({"MYCCL_HIERARCHICAL": "sometimes"})
    with pytest.raises(ValueError, match="MYCCL_LINK_MBIT"):
        config.parse_env({"MYCCL_LINK_MBIT": "-5"})
