"""c10d_ext.horovod: process sets, join, Horovod's errors (every rank hears of a disagreement
and the next op works), a lost rank, the launch variables and the timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness import ROOT, free_port
from hvd_helpers import start, stop

DUP = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
       "that is currently being processed.  If you want to request another tensor, use a different "
       "tensor name.")


# ---- process sets -------------------------------------------------------------------------------
def _static_sets(ctx):
    import c10d_ext.horovod as hvd

    even, odd = hvd.ProcessSet([2, 0]), hvd.ProcessSet([1, 3])
    hvd = start(ctx, process_sets=[even, odd])
    r = hvd.rank()
    try:
        mine, other = (even, odd) if r % 2 == 0 else (odd, even)
        out = {"ids": (even.process_set_id, odd.process_set_id), "ranks": even.ranks,
               "rank_size": (mine.rank(), mine.size()), "included": (mine.included(), other.included()),
               "str": str(even)}
        out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=mine).item()
        out["avg"] = hvd.allreduce(torch.tensor([float(r)]), process_set=mine, name="same").item()
        out["glob"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="same").item()  # names per set
        out["ag"] = hvd.allgather(torch.tensor([r]), process_set=mine).tolist()
        out["bc"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=mine.ranks[-1], process_set=mine).item()
        out["rs"] = hvd.reducescatter(torch.ones(2), op=hvd.Sum, process_set=mine).tolist()
        out["a2a"] = hvd.alltoall(torch.tensor([r, r]), process_set=mine).tolist()
        hvd.barrier(process_set=mine)
        for fn, args in [("allreduce", (torch.ones(1),)), ("allgather", (torch.ones(1),)),
                         ("broadcast", (torch.ones(1), other.ranks[0]))]:
            try:
                getattr(hvd, fn)(*args, process_set=other)
            except ValueError as e:
                out[f"nonmember_{fn}"] = str(e)
        try:
            hvd.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=mine)
        except ValueError as e:
            out["bad_root"] = str(e)
        try:
            hvd.barrier(process_set=other)
        except ValueError as e:
            out["nonmember_barrier"] = str(e)
        try:
            other.rank()
        except ValueError as e:
            out["other_rank"] = str(e)
        try:
            hvd.add_process_set([0, 1])
        except ValueError as e:
            out["not_dynamic"] = str(e)
        return out
    finally:
        stop(hvd)


def test_static_process_sets(run):
    for r, out in enumerate(run(4, _static_sets, timeout=120)):
        mine = [0, 2] if r % 2 == 0 else [1, 3]
        assert out["ids"] == (1, 2) and out["ranks"] == [0, 2]
        assert out["rank_size"] == (mine.index(r), 2) and out["included"] == (True, False)
        assert out["str"] == "ProcessSet(process_set_id=1, ranks=[0, 2], mpi_comm=None)"
        assert out["sum"] == float(sum(mine)) and out["avg"] == sum(mine) / 2 and out["glob"] == 6.0
        assert out["ag"] == mine and out["bc"] == float(mine[-1])
        assert out["rs"] == [2.0] and out["a2a"] == mine
        for fn in ("allreduce", "allgather", "broadcast"):
            assert out[f"nonmember_{fn}"] == f"{fn.capitalize()}: Rank {r} is not a member of the provided process set."
        assert out["nonmember_barrier"] == f"Barrier: Rank {r} is not a member of the provided process set."
        assert "invalid root rank" in out["bad_root"]
        assert out["other_rank"] == "Process is not part of provided process set."
        assert out["not_dynamic"].startswith("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding")


def _dynamic_sets(ctx):
    import c10d_ext.horovod as hvd

    hvd = start(ctx, process_sets="dynamic")
    r = hvd.rank()
    try:
        out = {}
        a = hvd.add_process_set([0, 2])
        b = hvd.add_process_set(hvd.ProcessSet([1, 2]))
        out["ids"] = (a.process_set_id, b.process_set_id)
        if a.included():
            # named: auto names count this process's calls, which differ between ranks here
            out["a"] = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=a, name="a").item()
        if b.included():
            out["b"] = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=b, name="b").item()
        try:
            hvd.add_process_set([2, 0])
        except ValueError as e:
            out["dup"] = str(e)
        out["removed"] = hvd.remove_process_set(a)
        out["id_after"] = a.process_set_id
        out["global"] = hvd.remove_process_set(hvd.global_process_set)
        c = hvd.add_process_set([0, 1, 2][: 2])  # recycles the freed id
        out["recycled"] = c.process_set_id
        if c.included():
            out["c"] = hvd.allgather(torch.tensor([r]), process_set=c, name="c").tolist()
        return out
    finally:
        stop(hvd)


def test_dynamic_process_sets(run):
    for r, out in enumerate(run(3, _dynamic_sets, timeout=120)):
        assert out["ids"] == (1, 2)
        if r in (0, 2):
            assert out["a"] == 4.0
        if r in (1, 2):
            assert out["b"] == 5.0
        assert out["dup"].startswith("Attempted to add a duplicate process set: ProcessSet(")
        assert out["removed"] is True and out["id_after"] is None and out["global"] is False
        assert out["recycled"] == 1
        if r < 2:
            assert out["c"] == [0, 1]


# ---- join ---------------------------------------------------------------------------------------
def _join(ctx, dtype):
    hvd = start(ctx)
    r, n = hvd.rank(), hvd.size()
    try:
        out = {"avg": [], "sum": []}
        for step in range(r + 1):  # rank r has r + 1 batches: the others join early
            t = torch.full((3,), 6 * (step + 1), dtype=dtype)
            out["avg"].append(hvd.allreduce(t, name=f"g{step}").tolist())
            out["sum"].append(hvd.allreduce(t, name=f"s{step}", op=hvd.Sum).tolist())
        if r == n - 1:  # the last rank: an allgather while the others are joined fails
            try:
                hvd.allgather(torch.ones(1), name="ag_join")
            except hvd.HorovodInternalError as e:
                out["ag_err"] = str(e)
        out["last"] = hvd.join()
        out["after"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
        return out
    finally:
        stop(hvd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_join(run, dtype):
    """Joined ranks contribute zeros; Average still divides by the full size (integers
    truncated); allgather fails while a rank is joined; join returns the last rank to join."""
    n = 3
    for r, out in enumerate(run(n, _join, dtype, timeout=120)):
        for step in range(r + 1):
            active = n - step
            s = 6 * (step + 1) * active
            want_avg = s / n if dtype.is_floating_point else int(s / n)
            assert out["avg"][step] == [want_avg] * 3, (r, step, out["avg"])
            assert out["sum"][step] == [s] * 3
        if r == n - 1:
            assert out["ag_err"].startswith("Allgather is not supported with Join at this time.")
        assert out["last"] == n - 1 and out["after"] == float(n)


# ---- errors -------------------------------------------------------------------------------------
def _mismatches(ctx):
    hvd = start(ctx)
    r = hvd.rank()
    try:
        out = {}
        cases = {
            "shape": lambda: hvd.allreduce(torch.ones(2 + r), name="shape"),
            "dtype": lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64), name="dtype"),
            "op": lambda: hvd.allreduce(torch.ones(2), name="op", op=hvd.Sum if r else hvd.Max),
            "scale": lambda: hvd.allreduce(torch.ones(2), name="scale", prescale_factor=1.0 + r),
            "root": lambda: hvd.broadcast(torch.ones(2), root_rank=r, name="root"),
            "ag_dims": lambda: hvd.allgather(torch.ones(1, 2 + r), name="ag_dims"),
            "ag_ndim": lambda: hvd.allgather(torch.ones(1, 2) if r else torch.ones(2), name="ag_ndim"),
            "ag_scalar": lambda: hvd.allgather(torch.tensor(1.0), name="ag_scalar"),
            "rs_op": lambda: hvd.reducescatter(torch.ones(4), name="rs_op", op=hvd.Sum if r else hvd.Average),
        }
        for key, fn in cases.items():
            try:
                fn()
                out[key] = None
            except hvd.HorovodInternalError as e:
                out[key] = str(e)
            out[key + "_next"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"{key}_next").item()
        # A name in flight is refused. In flight for sure: the other rank submits it only once
        # this one has tried the duplicate (told through the test's store).
        store = ctx.store("dup")
        for owner in range(hvd.size()):
            name = f"dup{owner}"
            if r == owner:
                h = hvd.allreduce_async(torch.ones(1), name=name)
                try:
                    hvd.allreduce_async(torch.ones(1), name=name)
                except ValueError as e:
                    out["dup"] = str(e)
                store.set(name, "tried")
            else:
                store.wait([name])
                h = hvd.allreduce_async(torch.ones(1), name=name)
            hvd.synchronize(h)
        for key, fn in {
            "bool": lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)),
            "noncontig": lambda: hvd.allreduce(torch.ones(4, 4).t()),
            "a2a_len": lambda: hvd.alltoall(torch.ones(4), splits=[4]),
            "a2a_sum": lambda: hvd.alltoall(torch.ones(2), splits=[2, 2]),
            "a2a_even": lambda: hvd.alltoall(torch.ones(3)),
            "a2a_dtype": lambda: hvd.alltoall(torch.ones(2), splits=torch.ones(2, dtype=torch.int64)),
            "a2a_2d": lambda: hvd.alltoall(torch.ones(2), splits=torch.ones(1, 2, dtype=torch.int32)),
            "rs_scalar": lambda: hvd.reducescatter(torch.tensor(1.0)),
            "poll": lambda: hvd.poll(12345),
        }.items():
            try:
                fn()
            except ValueError as e:
                out[key] = str(e)
        try:
            hvd.reducescatter(torch.ones(2), op=hvd.Max)
        except hvd.HorovodInternalError as e:
            out["rs_max"] = str(e)
        out["sync_unknown"] = hvd.synchronize(12345)
        return out
    finally:
        stop(hvd)


def test_mismatches_fail_everywhere_and_the_job_goes_on(run):
    for r, out in enumerate(run(2, _mismatches, timeout=120)):
        assert out["shape"] == ("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape [2], but "
                                "another rank sent a tensor of shape [3]. (tensor allreduce.shape)")
        assert out["dtype"].startswith("Mismatched data types: One rank had type float64, but another rank had type float32.")
        assert out["op"].startswith("Mismatched reduction operation: One rank sent reduction op 4, but another rank sent reduction op 1.")
        assert out["scale"].startswith("Mismatched prescale and/or postscale factors: One rank sent factors (1, 1), "
                                       "but another rank sent factors (2, 1).")
        assert out["root"].startswith("Mismatched BROADCAST root ranks: One rank specified root rank 0, but another rank specified root rank 1.")
        assert out["ag_dims"].startswith("Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to 2, "
                                         "but another rank sent a tensor with dimension 1 equal to 3.")
        assert out["ag_ndim"].startswith("Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank 1, "
                                         "but another rank sent a tensor of rank 2.")
        assert out["ag_scalar"].startswith("Process-set rank zero tried to ALLGATHER a rank-zero tensor.")
        assert out["rs_op"].startswith("Mismatched prescale and/or postscale factors")
        for key in ("shape", "dtype", "op", "scale", "root", "ag_dims", "ag_ndim", "ag_scalar", "rs_op"):
            assert out[key + "_next"] == 2.0, key
        assert out["dup"] == DUP
        assert out["bool"] == "Tensor type torch.BoolTensor is not supported."
        assert out["noncontig"] == "Tensor is required to be contiguous."
        assert out["a2a_len"] == "Number of entries in splits does not equal number of workers."
        assert out["a2a_sum"] == "Sum of splits entries is greater than the first dimension of tensor."
        assert out["a2a_even"].startswith("splits not provided, but first dimension of tensor is not an even multiple")
        assert out["a2a_dtype"] == "alltoall expects splits to contain 32-bit integer elements."
        assert out["a2a_2d"] == "alltoall expects a 1D splits tensor"
        assert out["rs_scalar"] == "Reducescatter does not support scalar inputs"
        assert out["poll"] == "Handle 12345 was not created or has been cleared."
        assert out["rs_max"] == "Reducescatter currently only supports AVERAGE and SUM."
        assert out["sync_unknown"] is None


def _lost_peer(ctx):
    import time

    hvd = start(ctx)
    try:
        hvd.allreduce(torch.ones(1), name="warm")
        if hvd.rank() == 1:
            os._exit(3)
        t = time.monotonic()
        try:
            hvd.allreduce(torch.ones(1), name="after_loss")
            return "no error"
        except hvd.HorovodInternalError as e:
            return [str(e), time.monotonic() - t]
    finally:
        if hvd.rank() != 1:
            hvd.shutdown()


def test_lost_peer_is_a_horovod_internal_error(run):
    out = run(2, _lost_peer, timeout=90, expect_dead=(1,))
    assert isinstance(out[0], list), out[0]
    assert "rank 1" in out[0][0], out[0][0]


# ---- launch variables ---------------------------------------------------------------------------
SCRIPT = """
import torch, c10d_ext.horovod as hvd
hvd.init()
print("RESULT", hvd.rank(), hvd.size(), hvd.local_rank(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), flush=True)
hvd.shutdown()
"""


def _launch(env_for, n, tmp_path, limit: float = 90.0):
    """Runs SCRIPT as n processes with env_for(rank)'s variables; returns each one's RESULT
    fields. Fails (AssertionError, with what every rank printed) when one exits with an error,
    then without waiting out the others (a rank whose peer failed at rendezvous would wait for
    it), or when they are not all done within `limit` seconds."""
    import time

    path = tmp_path / "w.py"
    path.write_text(SCRIPT)
    procs, logs = [], []
    for r in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
        env.update(env_for(r))
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        log = tmp_path / f"rank{r}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, str(path)], env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + limit
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 5):
            for p in procs:
                p.kill()
                p.wait()
            break
        time.sleep(0.05)
    texts = [log.read_text() for log in logs]
    # Every rank's output on failure: the first rank's error is often a consequence of another's.
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{t}" for r, (p, t) in enumerate(zip(procs, texts)))
    assert all(p.returncode == 0 for p in procs), report
    return [next(line for line in out.splitlines() if line.startswith("RESULT")).split()[1:] for out in texts]


@pytest.mark.parametrize("launcher", ["horovodrun", "openmpi", "pmi", "torchrun", "none"])
def test_starts_under_each_launchers_variables(launcher, tmp_path):
    n = 1 if launcher == "none" else 2
    for attempt in range(3):
        port = free_port()
        try:
            outs = _launch(_launcher_env(launcher, port), n, tmp_path)
            break
        except AssertionError as e:
            # The rendezvous port is chosen here and bound by rank 0 later: another test's process
            # may take it in between (rank 0 then fails, and rank 1 waits for it). Only that is
            # retried, with another port.
            if attempt == 2 or "EADDRINUSE" not in str(e):
                raise
    assert outs == [[str(r), str(n), str(r), str(float(n))] for r in range(n)]


def _launcher_env(launcher, port):
    envs = {
        "horovodrun": lambda r: {"HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": str(r),
                                 "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)},
        "openmpi": lambda r: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        "pmi": lambda r: {"PMI_RANK": str(r), "PMI_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                          "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)},
        "torchrun": lambda r: {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": str(port)},
        "none": lambda r: {},
    }
    return envs[launcher]


# ---- timeline -----------------------------------------------------------------------------------
def _timeline(ctx, path):
    hvd = start(ctx)
    try:
        hvd.allreduce(torch.ones(4), name="weights")
        hvd.allgather(torch.ones(2, 3), name="acts")
        try:
            hvd.start_timeline(path + ".2")
        except ValueError as e:
            return str(e)
        return None
    finally:
        stop(hvd)


def test_timeline_from_the_environment(run, tmp_path):
    path = str(tmp_path / "timeline.json")
    out = run(2, _timeline, path, env={"HOROVOD_TIMELINE": path}, timeout=60)
    assert out == [None, None]
    events = json.loads(open(path).read())
    names = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name" and e.get("pid")}
    assert set(names) >= {"allreduce.weights", "allgather.acts"}, names
    pid = names["allreduce.weights"]
    phases = [(e["ph"], e.get("name")) for e in events if e.get("pid") == pid and e["ph"] != "M"]
    assert ("B", "NEGOTIATE_ALLREDUCE") in phases and ("B", "ALLREDUCE") in phases
    ends = [e for e in events if e.get("pid") == pid and e["ph"] == "E" and "args" in e]
    assert ends and ends[-1]["args"]["dtype"] == "float32" and ends[-1]["args"]["shape"] == "[4]"
    assert os.path.exists(path + ".2")  # start_timeline switched files


def _no_timeline_env(ctx):
    hvd = start(ctx)
    try:
        hvd.start_timeline("/tmp/never.json")
    except ValueError as e:
        return str(e)
    finally:
        stop(hvd)


def test_start_timeline_needs_the_variable(run):
    for out in run(1, _no_timeline_env, timeout=60):
        assert out == "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."


def test_mismatch_messages_for_kind_and_device():
    """Two checks no Python call can reach through names alone (each op prefixes its own name):
    the coordinator's texts, in Horovod's order, from the ranks' descriptions."""
    from c10d_ext.horovod.execute import mismatch_message

    a = ("ALLREDUCE", "float32", "CPU", (2,), 1.0, 1.0, 0, -1)
    assert mismatch_message([a, ("ALLGATHER",) + a[1:]]) == \
        "Mismatched operations: One rank did an ALLREDUCE, but another rank did an ALLGATHER."
    assert mismatch_message([a, a[:2] + ("GPU",) + a[3:]]) == \
        "Mismatched ALLREDUCE CPU/GPU device selection: One rank specified device CPU, but another rank specified device GPU."
    assert mismatch_message([None, a, a[:1] + ("float16",) + a[2:]]).startswith("Mismatched data types: One rank had type float32")


# ---- stall inspector ----------------------------------------------------------------------------
def _stall(ctx):
    from harness import Logged

    with Logged("c10d_ext.horovod") as records:
        hvd = start(ctx)
        try:
            try:  # the ranks submit different names: nothing is ever ready
                hvd.allreduce(torch.ones(1), name=f"only_on_{hvd.rank()}")
                err = None
            except hvd.HorovodInternalError as e:
                err = str(e)
            return err, records
        finally:
            stop(hvd)


def test_stall_inspector_warns_then_shuts_down(run):
    """Horovod's stall inspector: rank 0 names, per missing rank, what it waits for; past the
    shutdown time every rank fails (together: the decision travels in the next cycle)."""
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    out = run(2, _stall, env=env, timeout=90)
    for r, (err, logs) in enumerate(out):
        assert err is not None and err.startswith("Horovod has been shut down.") and "STALL_SHUTDOWN" in err, err
    warnings = [m for m in out[0][1] if m.startswith("One or more tensors were submitted")]
    # rank 0 knows the names it sent; of the others' it has hashes only
    assert warnings and "Missing ranks:\n0: [<a tensor rank 0 did not submit, hash " in warnings[0], out[0][1]
    assert "]\n1: [allreduce.only_on_0]" in warnings[0], warnings[0]
    assert any("1!: [allreduce.only_on_0]" in m and "Will shutdown." in m for m in warnings), warnings
    assert not [m for m in out[1][1] if m.startswith("One or more tensors")]  # only the set's rank 0 warns
