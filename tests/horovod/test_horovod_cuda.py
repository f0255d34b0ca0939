"""c10d_ext.horovod's CUDA discipline on the strict CUDA double (docs/HOROVOD.md, "CUDA"): an op
waits for its producer's stream (the ready event), its data work runs on a stream of its set's own
(so gradient allreduces overlap backward), and results are safe on the consumer's stream after
synchronize. Each test fails without its property: the double's streams are worker threads with
random delays, and its allocator poisons memory a stream may still read."""

from __future__ import annotations

import pytest
import torch

from cuda_helpers import DOUBLE, SHARED_GPU
from hvd_helpers import start, stop

SLOW_MS = 400  # a kernel that stands for much queued work (a producer, or the rest of backward)


def _td():
    import cuda_double

    return cuda_double, cuda_double._module()


def _ready_event(ctx):
    cd, td = _td()
    hvd = start(ctx)
    try:
        out = {}
        # A gradient still being written: its producer kernel on the caller's stream runs later.
        t = torch.zeros(1000)
        td.enqueue_fill(cd.current_stream(), t, float(ctx.rank + 1), SLOW_MS)
        h = hvd.allreduce_async(t, op=hvd.Sum, name="grad")
        res = hvd.synchronize(h)
        cd.synchronize()
        out["sum"] = sorted(set(res.tolist()))
        # The same through a fused bucket (several tensors, one buffer).
        ts = [torch.zeros(10) for _ in range(4)]
        for i, x in enumerate(ts):
            td.enqueue_fill(cd.current_stream(), x, float(ctx.rank + i), SLOW_MS // 4)
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"f{i}") for i, x in enumerate(ts)]
        out["fused"] = [sorted(set(hvd.synchronize(h).tolist())) for h in hs]
        # In place: the producer's values, reduced into the tensor itself.
        u = torch.zeros(8)
        td.enqueue_fill(cd.current_stream(), u, 2.0, SLOW_MS)
        hvd.synchronize(hvd.allreduce_async_(u, op=hvd.Sum, name="inplace"))
        cd.synchronize()
        out["inplace"] = sorted(set(u.tolist()))
        out["violations"] = cd.violations()
    finally:
        stop(hvd)
    return out


def test_an_op_never_starts_before_its_producers_event(run):
    size = 2
    for out in run(size, _ready_event, timeout=120, world_env=DOUBLE):
        assert out["sum"] == [float(sum(r + 1 for r in range(size)))]
        assert out["fused"] == [[float(sum(r + i for r in range(size)))] for i in range(4)]
        assert out["inplace"] == [2.0 * size]
        assert out["violations"] == [], out["violations"]


def _overlap(ctx):
    cd, td = _td()
    hvd = start(ctx)
    try:
        # A first step: the set learns its device, and its cycles (whose control messages the
        # double, unlike a GPU, runs on a stream too) stay off the default stream from then on.
        hvd.allreduce(torch.ones(4), name="warm-up")
        td.clear_marks()
        backward = cd.current_stream()  # the default stream: where backward's kernels queue
        # Backward still has much to do on its stream...
        td.enqueue_mark(backward, "backward done", 3 * SLOW_MS)
        # ...while a gradient made on another stream (as a hook's stream would) is allreduced.
        grad_stream = cd.new_stream()
        cd.set_stream(grad_stream)
        g = torch.zeros(64)
        td.enqueue_fill(grad_stream, g, float(ctx.rank + 1), 0)
        h = hvd.allreduce_async(g, op=hvd.Sum, name="grad")
        user = cd.new_stream()
        cd.set_stream(user)
        res = hvd.synchronize(h)
        td.enqueue_read(user, res, "reduced", 0)
        cd.set_stream(backward)
        cd.synchronize()
        return {"marks": td.marks(), "violations": cd.violations()}
    finally:
        stop(hvd)


def test_gradient_allreduce_runs_beside_queued_backward_kernels(run):
    """The allreduce runs on its set's stream, not behind the kernels queued on the default
    stream: its result is read on a user stream before backward's last kernel has run."""
    size = 2
    for out in run(size, _overlap, timeout=120, world_env=DOUBLE):
        marks = [m.split("=") for m in out["marks"]]
        names = [m[0] for m in marks]
        assert names == ["reduced", "backward done"], out["marks"]
        assert float(marks[0][1]) == 64.0 * sum(r + 1 for r in range(size))
        assert out["violations"] == [], out["violations"]


def _consumer(ctx):
    cd, td = _td()
    hvd = start(ctx)
    try:
        td.clear_marks()
        user = cd.new_stream()
        cd.set_stream(user)
        for i in range(4):
            x = torch.full((256,), float(ctx.rank + i))
            if i == 0:
                res = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name=f"r{i}"))
            elif i == 1:
                res = hvd.synchronize(hvd.allgather_async(x, name=f"g{i}"))
            elif i == 2:
                res = hvd.synchronize(hvd.alltoall_async(x, name=f"a{i}"))[0]
            else:
                res = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum, name=f"s{i}"))
            # The consumer reads the result on its stream later and drops it at once (results are
            # the layer's, allocated on its set's stream): the memory must not be reused before
            # that read has run.
            td.enqueue_read(user, res, f"read{i}", SLOW_MS)
            del res
            # New allocations on the set's stream would take freed memory now.
            hvd.synchronize(hvd.allreduce_async(torch.ones(256), op=hvd.Sum, name=f"churn{i}"))
        cd.synchronize()
        return {"marks": td.marks(), "violations": cd.violations()}
    finally:
        stop(hvd)


def test_results_are_safe_on_the_consumers_stream_after_synchronize(run):
    size = 2
    for r, out in enumerate(run(size, _consumer, timeout=120, world_env=DOUBLE)):
        assert out["violations"] == [], out["violations"]
        got = dict(m.split("=") for m in out["marks"] if m.startswith("read"))
        assert float(got["read0"]) == 256.0 * sum(r for r in range(size))  # allreduce
        assert float(got["read1"]) == 256.0 * sum(r + 1 for r in range(size))  # allgather
        assert float(got["read2"]) == 128.0 * sum(s + 2 for s in range(size))  # alltoall: half of each rank
        assert float(got["read3"]) == 128.0 * sum(r + 3 for r in range(size))  # reducescatter: half the rows


# ---- on a GPU (make gpu-check): the same properties with torch's streams and real kernels ------
SPIN = 200_000_000  # torch.cuda._sleep cycles: a kernel of tens of milliseconds


def _gpu(ctx):
    torch.cuda.set_device(0)
    hvd = start(ctx)
    try:
        out = {}
        dev = torch.device("cuda", 0)
        # Ready event: the producer's kernels are still queued when the op is submitted.
        producer = torch.cuda.Stream()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SPIN)
            t = torch.full((1 << 16,), float(ctx.rank + 1), device=dev)
            res = hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum, name="ready"))
            out["ready"] = sorted(set(res.cpu().tolist()))
        hvd.allreduce(torch.ones(4, device=dev), name="warm-up")
        torch.cuda.synchronize()
        # Overlap: backward's kernels queued on the default stream; a gradient from another stream.
        torch.cuda._sleep(10 * SPIN)
        backward_done = torch.cuda.Event()
        backward_done.record()
        grads = torch.cuda.Stream()
        with torch.cuda.stream(grads):
            g = torch.full((1 << 16,), float(ctx.rank + 1), device=dev)
            h = hvd.allreduce_async(g, op=hvd.Sum, name="grad")
        user = torch.cuda.Stream()
        with torch.cuda.stream(user):
            r = hvd.synchronize(h)
            reduced = torch.cuda.Event()
            reduced.record()
        while not reduced.query():
            pass
        out["reduced_before_backward"] = not backward_done.query()
        out["grad"] = sorted(set(r.cpu().tolist()))
        # A result read on a user stream after synchronize, then dropped at once.
        with torch.cuda.stream(user):
            x = torch.full((1 << 16,), float(ctx.rank), device=dev)
            res = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum, name="consumer"))
            torch.cuda._sleep(SPIN)
            total = res.sum()
            del res
        for i in range(4):
            hvd.allreduce(torch.ones(1 << 16, device=dev), name=f"churn{i}")
        torch.cuda.synchronize()
        out["consumer"] = float(total.cpu())
    finally:
        stop(hvd)
    return out


@pytest.mark.cuda
def test_cuda_discipline_on_a_gpu(run):
    size = 2
    for out in run(size, _gpu, timeout=300, world_env=SHARED_GPU):
        assert out["ready"] == [float(sum(r + 1 for r in range(size)))]
        assert out["grad"] == [float(sum(r + 1 for r in range(size)))]
        assert out["reduced_before_backward"], "the allreduce waited for the kernels queued on the default stream"
        assert out["consumer"] == float((1 << 16) * sum(range(size)))
