"""One rank of a job that loses ranks and goes on (tests/backend/test_recovery.py): data-parallel training
with c10d_ext.DistributedDataParallel; a rank named in the plan SIGKILLs itself in the middle of
a step's backward; the others catch the failed step, agree on the survivors, shrink the default
group (torch's shrink_group) and redo the step on the smaller group. Writes <out>/rank<R>.json.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BATCH = 24  # divisible by every world size the job goes through (4, 3, 2)


def model_and_data(steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(steps)]
    return model, data


def reference(steps: int, lr: float) -> list[list[float]]:
    """One process over the whole batch: what every survivor's parameters must equal, since the
    average of the ranks' mean-loss gradients over equal shards is the whole batch's."""
    model, data = model_and_data(steps)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _shm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if "/myccl-" in line})


def _resources() -> dict:
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "tasks": len(os.listdir("/proc/self/task")), "shm_maps": _shm_mappings()}


def _die_in_backward(model, out_dir: str, who: int):
    """SIGKILLs this process in the middle of the next backward (when the first layer's weight
    gradient is computed, the others' already on their way), after writing the time of death."""
    def die(grad):
        with open(os.path.join(out_dir, f"killed{who}"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return grad
    return model[0].weight.register_hook(die)


def _train_step(ddp, opt, x, y, handle) -> str | None:
    """One step on this rank's shard; the error if it failed (a peer is gone), else None."""
    try:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        return None
    except Exception as e:  # noqa: BLE001 - any failure of the step
        return f"{type(e).__name__}: {e}"
    finally:
        if handle is not None:
            handle.remove()


def _final(result: dict, model, steps: int, lr: float) -> None:
    """The end of a job: the parameters, the single-process reference, the group destroyed."""
    result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    result["reference"] = reference(steps, lr)
    dist.destroy_process_group()


def _write(out_dir: str, who: int, result: dict, error: BaseException | None) -> None:
    if error is not None:
        import traceback

        result["error"] = f"{type(error).__name__}: {error}\n" + "".join(traceback.format_exception(error))
    with open(os.path.join(out_dir, f"rank{who}.json"), "w") as f:
        json.dump(result, f)


def _store(master: str, port: int, host: bool):
    return dist.TCPStore(master, port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=60))


def run(rank: int, size: int, port: int, out_dir: str, kills: dict, steps: int, timeout_s: float,
        master: str = "127.0.0.1", host_store: bool = False) -> None:
    import c10d_ext

    result: dict = {"rank": rank, "events": []}
    try:
        store = _store(master, port, host_store)
        dist.init_process_group("myccl", store=dist.PrefixStore("job", store), rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        model, data = model_and_data(steps)
        lr = 0.05
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        ddp = c10d_ext.DistributedDataParallel(model)
        dist.barrier()
        result["start"] = _resources()
        s = 0
        while s < steps:
            n, me = dist.get_world_size(), dist.get_rank()
            x, y = data[s]
            k = BATCH // n
            handle = _die_in_backward(model, out_dir, rank) if kills.get(str(s)) == rank else None
            failed = _train_step(ddp, opt, x[me * k:(me + 1) * k], y[me * k:(me + 1) * k], handle)
            if failed is None:
                result["events"].append({"step": s, "world": n})
                s += 1
                continue
            t_fail = time.time()
            ddp = None  # its hooks go with its Reducer; the next step uses a new one
            gc.collect()
            t_gc = time.time()
            alive = c10d_ext.survivors()
            t_alive = time.time()
            vanished = c10d_ext.vanished_ranks()
            excluded = [r for r in range(n) if r not in alive]
            dist.shrink_group(excluded)
            t_shrunk = time.time()
            dist.all_reduce(torch.ones(1))  # the new group's first collective
            t_good = time.time()
            result["events"].append({"step": s, "world": n, "error": failed[:400], "survivors": alive,
                                     "vanished": vanished, "excluded": excluded, "t_fail": t_fail,
                                     "t_gc": t_gc, "t_alive": t_alive, "t_shrunk": t_shrunk, "t_good": t_good,
                                     "new_rank": dist.get_rank(), "new_world": dist.get_world_size()})
            opt.zero_grad()
            ddp = c10d_ext.DistributedDataParallel(model)
        dist.barrier()
        ddp = None
        gc.collect()
        result["end"] = _resources()
        _final(result, model, steps, lr)
    except BaseException as e:  # noqa: BLE001
        return _write(out_dir, rank, result, e)
    _write(out_dir, rank, result, None)


def _quorum(store, gen: int, members: list[int], me: int, handle: str) -> list[str]:
    """The out-of-band rendezvous a job brings (torchft's lighthouse; here the test's store): each
    member of generation `gen` publishes its handle and reads the others', in `members` order."""
    store.set(f"quorum/{gen}/{me}", handle)
    return [store.get(f"quorum/{gen}/{m}").decode() for m in members]


def run_reconfigure(pid_id: int, port: int, out_dir: str, plan: dict, steps: int, timeout_s: float,
                    master: str = "127.0.0.1", host_store: bool = False) -> None:
    """One process of a job in torch's reconfigure regime: processes 0, 1, 2 start; `plan["kill"]`
    dies in step `plan["at"]`; the others agree on survivors, and with the replacement (process
    `plan["joiner"]`, started by the test once the victim is gone) reconfigure the group and go
    on. The joiner takes the model from rank 0 (DDP's initial broadcast) and the step to resume."""
    import c10d_ext
    from torch._C._distributed_c10d import ReconfigureOptions

    result: dict = {"id": pid_id, "events": []}
    joiner = pid_id == plan["joiner"]

    def reconfigure(pg, gen, members):
        handles = _quorum(store, gen, members, pid_id, pg.get_reconfigure_handle())
        opts = ReconfigureOptions()
        opts.uuid = gen
        opts.handles = handles
        opts.timeout = timedelta(seconds=timeout_s)
        pg.reconfigure(opts).wait()

    try:
        store = _store(master, port, host_store)
        # Every process makes its own group in the regime: no peers are needed to make it.
        dist.init_process_group("myccl", store=dist.PrefixStore("job", store), rank=min(pid_id, 2), world_size=3,
                                timeout=timedelta(seconds=timeout_s), enable_reconfigure=True)
        pg = dist.group.WORLD
        be = pg._get_backend(torch.device("cpu"))
        model, data = model_and_data(steps)
        lr = 0.05
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        if not joiner:
            reconfigure(pg, 0, [0, 1, 2])
            s = 0
        else:
            reconfigure(pg, 1, plan["after"])
            step = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(step, group_src=0)  # where the survivors are
            s = int(step.item())
            result["events"].append({"joined_at": s, "t_joined": time.time()})
        ddp = c10d_ext.DistributedDataParallel(model)
        while s < steps:
            n, me = be.size(), be.rank()
            x, y = data[s]
            k = BATCH // n
            handle = _die_in_backward(model, out_dir, pid_id) if plan["kill"] == pid_id and plan["at"] == s else None
            failed = _train_step(ddp, opt, x[me * k:(me + 1) * k], y[me * k:(me + 1) * k], handle)
            if failed is None:
                result["events"].append({"step": s, "world": n})
                s += 1
                continue
            t_fail = time.time()
            ddp = None
            gc.collect()
            alive = c10d_ext.survivors()
            reconfigure(pg, 1, plan["after"])
            step = torch.tensor([s], dtype=torch.int64)
            dist.broadcast(step, group_src=0)  # tell the joiner where we are
            t_good = time.time()
            result["events"].append({"step": s, "world": n, "error": failed[:300], "survivors": alive,
                                     "t_fail": t_fail, "t_good": t_good, "new_rank": be.rank(),
                                     "new_world": be.size()})
            opt.zero_grad()
            ddp = c10d_ext.DistributedDataParallel(model)
        dist.barrier()
        ddp = None
        _final(result, model, steps, lr)
    except BaseException as e:  # noqa: BLE001
        return _write(out_dir, pid_id, result, e)
    _write(out_dir, pid_id, result, None)


if __name__ == "__main__":
    # On the namespaced test hosts (tests/backend/test_multihost.py), one process per command:
    #   recovery_worker.py shrink <rank> <size> <master> <port> <out> <kills json> <steps>
    #   recovery_worker.py reconfigure <id> <master> <port> <out> <plan json> <steps>
    # The process with rank / id 0 hosts the store.
    import sys

    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "shrink":
        rank, size, master, port, out, kills, steps = args
        run(int(rank), int(size), int(port), out, json.loads(kills), int(steps), 15.0, master, int(rank) == 0)
    else:
        pid_id, master, port, out, plan, steps = args
        run_reconfigure(int(pid_id), int(port), out, json.loads(plan), int(steps), 15.0, master, int(pid_id) == 0)
