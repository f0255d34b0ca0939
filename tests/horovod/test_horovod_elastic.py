"""c10d_ext.horovod, elastic training: State/ObjectState/TorchState, ElasticSampler and run,
ending with an elastic training at 3 ranks in which one rank SIGKILLs itself and the survivors
restore the last commit and finish as a smaller job. Every multi-rank check compares a rank's
result with what a single process computes locally; messages and exceptions are Horovod 0.28.1's.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist  # noqa: F401
import torch.nn as nn  # noqa: F401
import torch.nn.functional as F  # noqa: F401

import c10d_ext.horovod as hvd  # noqa: F401
from harness import assert_reports, join_or_kill  # noqa: F401
from hvd_helpers import ELASTIC_SAMPLES, batches, close, elastic_training, expect_raise, hvd_body, mlp, state_close, \
    write_result

# ---- elastic: states -----------------------------------------------------------------------------

@hvd_body
def _body_object_state(ctx, rep):
    from c10d_ext.horovod.elastic.state import HostUpdateResult, ObjectState, State

    r = ctx.rank
    s = ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, epoch=0, names=["a"])
    rep.check((s.epoch, s.names) == (0, ["a"]), "attributes from kwargs")
    s.epoch = 5 + r
    s.restore()
    rep.check(s.epoch == 0, "restore: back to the initial state")
    s.epoch, s.names = 3 + r, ["b", r]
    s.commit()
    s.epoch = 100 + r
    s.sync()  # rank 0's committed values, not its current ones
    rep.check((s.epoch, s.names) == (3, ["b", 0]), f"sync: {s.epoch}, {s.names}")
    s.epoch = 50
    s.restore()
    rep.check(s.epoch == 3, "restore after sync: the synced commit")

    calls = []
    s.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    s.register_reset_callbacks([lambda: calls.append("c")])
    s.on_hosts_updated(1, HostUpdateResult.added)
    s.on_reset()
    rep.check(calls == ["a", "b", "c"], f"reset callbacks {calls}")
    s.commit()  # the queued update was dropped by on_reset: nothing raised

    def interrupt(updates_on_rank0, what):
        if r == 0:
            for ts, res in updates_on_rank0:
                s.on_hosts_updated(ts, res)
        try:
            s.commit()
        except hvd.HostsUpdatedInterrupt as e:
            return e.skip_sync, str(e)
        except Exception as e:  # noqa: BLE001
            rep.fail(f"{what}: {type(e).__name__}: {e}")
        return None

    rep.check(interrupt([(10, HostUpdateResult.removed)], "removed") == (True, "True"), "removed: skip_sync")
    rep.check(interrupt([(11, HostUpdateResult.added)], "added") == (False, "False"), "added: sync")
    rep.check(interrupt([(20, HostUpdateResult.removed), (21, HostUpdateResult.added)], "mixed") == (False, "False"),
              "removed+added: sync")
    rep.check(interrupt([(30, HostUpdateResult.added), (25, HostUpdateResult.removed)], "stale") == (False, "False"),
              "an older notification in the same batch is ignored")
    rep.check(interrupt([(5, HostUpdateResult.removed)], "old") is None, "older than the last: ignored")
    if r == 1:  # only rank 0's notifications count: every rank decides as rank 0 does
        s.on_hosts_updated(99, HostUpdateResult.removed)
    rep.check(interrupt([], "rank 1 only") is None, "a notification on rank 1 alone")
    rep.check(s.epoch == 3 and s._last_updated_timestamp == 30, "after the checks")
    rep.check(int(HostUpdateResult.mixed) == 3 and int(HostUpdateResult.no_update) == 0, "HostUpdateResult values")

    base = State(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
    for name in ("save", "restore", "sync"):
        expect_raise(rep, NotImplementedError, "", getattr(base, name), f"State.{name}")
    rep.check(base.reset() is None, "State.reset does nothing")


def test_elastic_object_state(run):
    assert_reports(run(2, _body_object_state, timeout=120))


@hvd_body
def _body_torch_state(ctx, rep):
    from c10d_ext.horovod.elastic import state as es

    r = ctx.rank
    data = batches(3, seed=7)

    def train_step(model, opt, i):
        opt.zero_grad()
        F.mse_loss(model(data[i][0]), data[i][1]).backward()
        opt.step()

    model = mlp(r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(30)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=r, note=None)
    rep.check(state.model is model and state.optimizer is opt and state.sampler is sampler, "handled attributes")
    rep.check((state.epoch, state.note) == (r, None), "plain attributes")
    rep.check(set(state._handlers) == {"model", "optimizer", "sampler"}, f"handlers {set(state._handlers)}")

    train_step(model, opt, 0)
    sampler.record_batch(0, 2)
    state.epoch = 9
    state.restore()  # everything back to construction time
    close(rep, model.parameters(), mlp(r).parameters(), "restore: model", 0, 0)
    rep.check(len(opt.state_dict()["state"]) == 0, "restore: optimizer state")
    rep.check(sampler.processed_num == 0 and state.epoch == r, "restore: sampler and epoch")

    train_step(model, opt, 0)
    sampler.record_batch(0, 1 + r)
    state.epoch = 10 + r
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, 1)
    state.restore()
    close(rep, model.parameters(), committed, "restore: the commit", 0, 0)

    state.sync()  # rank 0's model, optimizer, sampler and committed attributes
    ref_model = mlp(0)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    train_step(ref_model, ref_opt, 0)
    close(rep, model.parameters(), ref_model.parameters(), "sync: model", 0, 0)
    state_close(rep, opt, ref_opt, "sync: optimizer")
    rep.check(sampler.state_dict() == {"epoch": 0, "processed_num": 1 * ctx.size}, f"sync: {sampler.state_dict()}")
    rep.check(state.epoch == 10, f"sync: epoch {state.epoch}")

    # assigning a handled attribute replaces the object and commits it at once
    other = mlp(50)
    state.model = other
    rep.check(state._handlers["model"].value is other, "setattr replaces the handler's object")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state.restore()
    close(rep, other.parameters(), mlp(50).parameters(), "setattr commits", 0, 0)

    # the handler registry
    registry = es.get_handler_registry()
    rep.check([t for t, _ in registry] == [nn.Module, torch.optim.Optimizer, hvd.elastic.ElasticSampler],
              f"registry {registry}")
    saved = []

    class Box:
        def __init__(self, v):
            self.v = v

    class BoxHandler(es.StateHandler):
        def save(self):
            saved.append(self.value.v)

        def restore(self):
            self.value.v = saved[-1]

        def sync(self):
            self.value.v = hvd.broadcast_object(self.value.v, name="box")

    es.set_handler_registry(registry + [(Box, BoxHandler)])
    try:
        box = Box(r)
        st2 = hvd.elastic.TorchState(box=box)
        rep.check(set(st2._handlers) == {"box"} and st2.model is None and st2.optimizer is None,
                  "custom handler; model=None stays a plain attribute")
        st2.commit()
        box.v = 77
        st2.restore()
        rep.check(box.v == r, "custom handler restore")
        st2.sync()
        rep.check(box.v == 0, "custom handler sync")
    finally:
        es.set_handler_registry(registry)
    rep.check(es.get_handler_registry() is registry, "registry restored")


def test_elastic_torch_state(run):
    assert_reports(run(2, _body_torch_state, timeout=120))


# ---- elastic: ElasticSampler ---------------------------------------------------------------------

def sampler_expectation(n, processed, size, rank, shuffle, seed, epoch):
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    rest = order[processed:]
    per = math.ceil(len(rest) / size)
    padded = rest + rest[:per * size - len(rest)]
    return padded[rank:per * size:size], rest


@hvd_body
def _body_sampler(ctx, rep):
    n, r, s = 23, ctx.rank, ctx.size
    sampler = hvd.elastic.ElasticSampler(list(range(n)), shuffle=False)
    rep.check((sampler.num_replicas, sampler.rank, sampler.epoch, sampler.processed_num) == (s, r, 0, 0), "fresh")
    rep.check(isinstance(sampler, torch.utils.data.Sampler), "a torch Sampler")
    want, _ = sampler_expectation(n, 0, s, r, False, 0, 0)
    rep.check(list(sampler) == want and len(sampler) == math.ceil(n / s), f"partition {list(sampler)}")
    rep.check(sampler.total_size == math.ceil(n / s) * s, "total_size")
    everything = hvd.allgather_object(list(sampler))
    rep.check(set(sum(everything, [])) == set(range(n)), "the ranks cover the dataset")

    sampler.record_batch(0, 2)
    sampler.record_batch(1, 1)
    rep.check(sampler.processed_num == 3 * s and sampler.state_dict() == {"epoch": 0, "processed_num": 3 * s},
              f"record_batch: {sampler.state_dict()}")
    rep.check(list(sampler) == want, "record_batch alone does not repartition")
    sampler.reset()
    want, rest = sampler_expectation(n, 3 * s, s, r, False, 0, 0)
    rep.check(list(sampler) == want and sampler.remaining_indices == rest, "reset: the remaining samples")

    sampler.set_epoch(4)
    rep.check(sampler.processed_num == 0 and sampler.epoch == 4, "set_epoch clears the count")

    sh = hvd.elastic.ElasticSampler(list(range(n)), shuffle=True, seed=5)
    want, _ = sampler_expectation(n, 0, s, r, True, 5, 0)
    rep.check(list(sh) == want, "shuffled with Random(seed + epoch)")
    sh.set_epoch(2)
    want, _ = sampler_expectation(n, 0, s, r, True, 5, 2)
    rep.check(list(sh) == want, "epoch 2 shuffle")

    # a state committed by a job of another size: these ranks split what is left between them
    sh.load_state_dict({"epoch": 3, "processed_num": 8})
    want, rest = sampler_expectation(n, 8, s, r, True, 5, 3)
    rep.check(list(sh) == want and len(sh) == math.ceil(15 / s), "load_state_dict repartitions")
    parts = hvd.allgather_object(list(sh))
    rep.check(set(sum(parts, [])) == set(rest), "the new partition covers the remaining samples")


@pytest.mark.parametrize("size", [2, 3])
def test_elastic_sampler(run, size):
    assert_reports(run(size, _body_sampler, timeout=90))


# ---- elastic: run ----------------------------------------------------------------------------------

@hvd_body
def _body_elastic_run(ctx, rep):
    from c10d_ext.horovod.elastic.state import HostUpdateResult, notification_manager

    r = ctx.rank
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, opt, step=0, log=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append((hvd.is_initialized(), hvd.size()))])
    calls = []

    @hvd.elastic.run
    def train(state, tag, k=1):
        calls.append((state.step, list(state.log)))
        if len(calls) == 1:
            state.step, state.log = 5, ["committed"]
            state.commit()
            state.step, state.log = 7, ["lost"]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            # a real failure: the ranks disagree on the tensor's shape
            hvd.allreduce(torch.ones(r + 1), name="elastic.mismatch")
            rep.fail("the mismatched allreduce did not fail")
        if len(calls) == 2:
            if r == 0:  # a host was removed, as a driver would report it
                notification_manager.handle_hosts_updated(1000, HostUpdateResult.removed)
            state.step = 9
            state.commit()  # raises HostsUpdatedInterrupt(skip_sync=True) on every rank
            rep.fail("commit did not raise HostsUpdatedInterrupt")
        return "done", tag, k, hvd.is_initialized(), hvd.size()

    result = train(state, "x", k=2)
    rep.check(result == ("done", "x", 2, True, ctx.size), f"result {result}")
    rep.check(calls == [(0, []), (5, ["committed"]), (9, ["committed"])], f"calls {calls}")
    close(rep, model.parameters(), mlp(0).parameters(), "the model restored to the commit", 0, 0)
    rep.check(resets == [(True, ctx.size)] * 2, f"resets {resets}")
    rep.check(state not in notification_manager._listeners, "listener removed")

    @hvd.elastic.run
    def broken(state):
        raise KeyError("not an elastic error")

    expect_raise(rep, KeyError, "'not an elastic error'", lambda: broken(state), "other exceptions propagate")
    rep.check(state not in notification_manager._listeners, "listener removed after an error")
    rep.check(hvd.elastic.HorovodInternalError is hvd.HorovodInternalError, "HorovodInternalError re-exported")
    rep.check(issubclass(hvd.elastic.HostsUpdatedInterrupt, RuntimeError), "HostsUpdatedInterrupt re-exported")


def test_elastic_run_restores_and_retries(run):
    assert_reports(run(2, _body_elastic_run, timeout=150))


# ---- elastic: a rank dies, the survivors go on ----------------------------------------------------

def elastic_worker(rank, size, port, out_dir, victim, kill_step, timeout_s):
    """One rank of the job (elastic_training); `victim` SIGKILLs itself in the backward of step
    `kill_step`. Writes <out>/rank<R>.json."""
    from datetime import timedelta

    result = {"rank": rank, "steps": [], "resets": []}
    error = None
    try:
        import c10d_ext  # noqa: F401
        import c10d_ext.horovod as hvd

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("myccl", store=dist.PrefixStore("elastic", store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        hvd.init()

        def die(grad):
            os.kill(os.getpid(), signal.SIGKILL)
            return grad

        def hook_for(model, state):
            return model[0].weight.register_hook(die) if rank == victim and state.batch == kill_step else None

        elastic_training(hvd, result, hook_for=hook_for)
        hvd.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        error = e
    write_result(os.path.join(out_dir, f"rank{rank}.json"), result, error)


@pytest.mark.slow
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 14),
                    reason="the survivors' world needs torch >= 2.14 (dist.shrink_group)")
def test_elastic_training_survives_a_killed_rank(tmp_path):
    """3 ranks; global rank 1 SIGKILLs itself in the backward of step 5 (the last commit was
    after step 3). Ranks 0 and 2 get HorovodInternalError, restore the commit, reset (the world
    shrinks to them, renumbered 0 and 1), the sampler repartitions what is left of the epoch,
    and they redo steps 4..7 at 2 ranks: each ends with the parameters of one process over the
    whole epoch."""
    import multiprocessing as mp
    from datetime import timedelta

    size, victim, kill_step, deadline = 3, 1, 5, 240.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out = tmp_path / "out"
    out.mkdir()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=elastic_worker, args=(r, size, store.port, str(out), victim, kill_step, 15.0))
             for r in range(size)]
    for p in procs:
        p.start()
    hung = join_or_kill(procs, deadline)
    assert not hung, f"ranks {hung} did not finish within {deadline} s"
    assert procs[victim].exitcode == -signal.SIGKILL, procs[victim].exitcode
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(size)
               if (out / f"rank{r}.json").exists()}
    assert sorted(results) == [0, 2], f"results from {sorted(results)}"
    for r, res in results.items():
        assert "error" not in res, res["error"]
        steps = [(s["batch"], s["size"]) for s in res["steps"]]
        assert steps == [(b, 3) for b in range(5)] + [(b, 2) for b in range(4, 8)], steps
        assert res["resets"] == [{"size": 2, "rank": {0: 0, 2: 1}[r], "batch": 4}], res["resets"]
        assert (res["size"], res["new_rank"]) == (2, {0: 0, 2: 1}[r]), res
        assert res["sampler"] == {"epoch": 0, "processed_num": ELASTIC_SAMPLES, "num_replicas": 2}, res["sampler"]
        got = [torch.tensor(p, dtype=torch.float64) for p in res["params"]]
        want = [torch.tensor(p, dtype=torch.float64) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got, want)), (r, got, want)
    assert results[0]["params"] == results[2]["params"]


# ---- elastic: a new process joins a running job (torch's reconfigure regime) ------------------------
def join_worker(who, port, out_dir, timeout_s):
    """`who` 0 and 1 start the job as ranks of 2 (torchrun's variables, the agent's store);
    `who` 2 is started later with HOROVOD_ELASTIC_JOIN=1 and the same rendezvous. Rank 0 waits,
    after the commit at batch 2, until the joiner has registered, so that the commit at batch 4
    admits it. Writes <out>/who<W>.json."""
    from datetime import timedelta

    result = {"who": who, "steps": [], "resets": []}
    error = None
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if who < 2:
        env.update(RANK=str(who), WORLD_SIZE="2", LOCAL_RANK=str(who))
    else:
        env.update(HOROVOD_ELASTIC_JOIN="1")
    os.environ.update(env)
    try:
        import c10d_ext  # noqa: F401
        import c10d_ext.horovod as hvd

        torch.set_num_threads(1)
        hvd.init()
        if who < 2:  # a reset before anyone joins: the old ranks have counted one more world
            hvd.shutdown()
            hvd.init()
        result["start"] = {"size": hvd.size(), "rank": hvd.rank()}
        waited = [False]

        def after_step(state):
            if state.batch == 2 and hvd.rank() == 0 and not waited[0]:
                waited[0] = True
                store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
                with open(os.path.join(out_dir, "committed"), "w"):
                    pass
                end = time.monotonic() + timeout_s
                while dist.PrefixStore("hvd/elastic", store).add("joiners", 0) < 1 and time.monotonic() < end:
                    time.sleep(0.05)

        elastic_training(hvd, result, after_step=after_step)
        # A plain reset afterwards makes the world of 3 again, on the job's store (not from the
        # launcher's variables, which say 2, or nothing for the joiner).
        hvd.shutdown()
        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), name="again", op=hvd.Sum)
        result["again"] = {"size": hvd.size(), "rank": hvd.rank(), "sum": total.item()}
        hvd.shutdown()
    except BaseException as e:  # noqa: BLE001
        error = e
    write_result(os.path.join(out_dir, f"who{who}.json"), result, error)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="joining needs torch's reconfigure API (torch >= 2.14)")
def test_a_new_process_joins_a_running_elastic_job(tmp_path):
    """2 ranks train; after their commit at batch 2 a third process starts with
    HOROVOD_ELASTIC_JOIN=1; the commit at batch 4 admits it, every rank resets into a world of 3
    (the old ranks keep 0 and 1, the new one is 2), the state is synced from rank 0 and the
    sampler repartitions what is left of the epoch: all three end with the parameters of one
    process over the whole epoch."""
    import multiprocessing as mp
    from datetime import timedelta

    deadline = 240.0
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out = tmp_path / "out"
    out.mkdir()
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=join_worker, args=(w, store.port, str(out), 60.0)) for w in range(2)]
    for p in procs:
        p.start()
    end = time.monotonic() + 120
    while not (out / "committed").exists() and time.monotonic() < end and all(p.is_alive() for p in procs):
        time.sleep(0.05)
    assert (out / "committed").exists(), "the job never reached its commit at batch 2"
    procs.append(spawn.Process(target=join_worker, args=(2, store.port, str(out), 60.0)))
    procs[2].start()
    hung = join_or_kill(procs, deadline)
    assert not hung, f"processes {hung} did not finish within {deadline} s"
    results = {w: json.loads((out / f"who{w}.json").read_text()) for w in range(3)}
    for w, res in results.items():
        assert "error" not in res, (w, res["error"])
        steps = [(s["batch"], s["size"]) for s in res["steps"]]
        want = ([(b, 2) for b in range(4)] if w < 2 else []) + [(b, 3) for b in range(4, 8)]
        assert steps == want, (w, steps)
        assert res["start"] == ({"size": 2, "rank": w} if w < 2 else {"size": 3, "rank": 2}), (w, res["start"])
        assert res["resets"] == ([{"size": 3, "rank": w, "batch": 4}] if w < 2 else []), (w, res["resets"])
        assert (res["size"], res["new_rank"]) == (3, w), res
        assert res["sampler"] == {"epoch": 0, "processed_num": ELASTIC_SAMPLES, "num_replicas": 3}, res["sampler"]
        got = [torch.tensor(p, dtype=torch.float64) for p in res["params"]]
        want_p = [torch.tensor(p, dtype=torch.float64) for p in res["reference"]]
        assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(got, want_p)), (w, got, want_p)
        assert res["again"] == {"size": 3, "rank": w, "sum": 6.0}, (w, res["again"])
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]
