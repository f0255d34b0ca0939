"""benchmarks/hvd_synthetic.py: Horovod's synthetic benchmark against torch DDP in one run, and its
reading of a profiler trace (how much NCCL kernel time lies beside compute kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_overlap_counts_only_compute_on_other_streams(tmp_path):
    from hvd_synthetic import kernel_overlap

    k = lambda name, ts, dur, stream: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                        "args": {"stream": stream}}
    events = [k("ncclDevKernel_AllReduce", 0, 100, 20),
              k("conv_bwd", 50, 30, 7), k("gemm_bwd", 70, 30, 7),  # overlap each other: 50..100 once
              k("copy", 0, 40, 20),  # the NCCL kernel's own stream: not beside it
              k("ncclDevKernel_AllReduce", 200, 50, 20),  # nothing beside it
              {"cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 500}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = kernel_overlap(str(path))
    assert got["nccl_kernels"] == 2 and got["compute_kernels"] == 3
    assert got["nccl_us"] == 150 and got["overlapped_us"] == 50
    assert got["overlap"] == round(50 / 150, 3)
    assert got["nccl_streams"] == ["20"] and got["compute_streams"] == ["20", "7"]


def test_cpu_run_measures_both_and_writes_json(tmp_path):
    out = tmp_path / "hs.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hvd_synthetic.py"), "--device", "cpu",
                        "--batch-size", "4", "--warmup", "1", "--batches", "1", "--iters", "2", "--timeout", "240",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(out.read_text())
    assert [r["config"] for r in got["rows"]] == ["torch DDP/gloo", "c10d_ext.horovod"]
    assert all(r["img_s"] > 0 for r in got["rows"])
    assert "torch DDP/gloo" in p.stdout and "c10d_ext.horovod" in p.stdout


def test_cuda_run_refuses_without_a_gpu():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs the benchmark instead")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hvd_synthetic.py"), "--device", "cuda"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "cannot run here" in p.stderr
