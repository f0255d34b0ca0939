"""The CPU engine's op queue and Python: the progress thread releases an op's tensors and its
Work without holding the engine's lock. Releasing a tensor can run Python (torch frees the
tensor's Python object, under the GIL), and a caller can hold the GIL while it waits for that
lock: a ProcessGroup subclassed in Python (whole memory's communicators) calls the backend with
the GIL held. Holding the lock there deadlocked such a caller against its own progress thread.

The test makes the progress thread free the last reference to a tensor whose Python object has
a weakref callback; the callback, on the progress thread, calls into the same engine (which
takes the lock). With the lock held there, the rank hangs and the test fails on its timeout."""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

import c10d_ext
from harness import Report, assert_reports


def body_tensor_freed_outside_the_lock(ctx):
    ctx.init(timeout=20)
    rep = Report(ctx)
    backend = c10d_ext._myccl_backend(dist.group.WORLD)
    store = ctx.store("gate")
    seen = {}
    if ctx.rank == 0:

        def freed(_ref):  # runs where the tensor's Python object is freed
            seen["thread"] = threading.get_ident()
            backend.link_model()  # takes the engine's lock
            seen["engine answered"] = True

        t = torch.ones(4)
        ref = weakref.ref(t, freed)
        work = dist.all_reduce(t, async_op=True)  # waits on the progress thread for rank 1
        del t, work  # the engine's references are now the last ones
        store.set("go", "1")
    else:
        store.wait(["go"])
        dist.all_reduce(torch.ones(4))
    dist.barrier()  # runs after the all_reduce's clean-up on the progress thread
    if ctx.rank == 0:
        rep.check(ref() is None, "the tensor was freed once the engine let it go")
        rep.check(seen.get("thread") not in (None, threading.get_ident()),
                  f"the progress thread freed the tensor: {seen}")
        rep.check(seen.get("engine answered"), f"the engine answered from the tensor's release: {seen}")
    dist.destroy_process_group()
    return rep.result()


def test_progress_thread_frees_tensors_outside_the_engine_lock(run):
    assert_reports(run(2, body_tensor_freed_outside_the_lock, timeout=45))
