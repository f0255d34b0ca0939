"""Training that goes on after a failure: torchrun restarts on a store that outlives an attempt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_torchrun_restart_after_a_rank_died_before_init(tmp_path):
    """Attempt 0: rank 1 exits before init while rank 0 is already in myccl's bootstrap (its keys
    are in the agent's store). Attempt 1 must form the group on that store and train; before the
    fix the ranks of attempt 1 waited on different key spaces until the timeout."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1",
           os.path.join(HERE, "restart_worker.py"), str(out)]
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

