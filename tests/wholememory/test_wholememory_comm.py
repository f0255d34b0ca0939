"""c10d_ext.wholememory's own start-up, without torch.distributed's default group: init_lib, the
unique id made on rank 0 and passed on by the script (a file or the harness's store, never
torch.distributed), create_communicator, tensors on it, barrier, destroy and finalize_lib. Values
against a local reference at 1-3 ranks, every bad input, and the default-group helpers."""

from __future__ import annotations

import gc
import json
import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist

from cuda_helpers import WORLD
from harness import Report, assert_reports, open_sockets

EXCHANGE = {"MYCCL_WM_DIRECT": "0"}  # DISTRIBUTED through the exchange (the path across hosts)
KINDS = ["HOST", "CHUNKED", "DISTRIBUTED", "DISTRIBUTED-exchange"]


def _reference(rows: int, dim: int, rank_of_row=None) -> torch.Tensor:
    """Row i, column j: i * 100 + j, plus 10000 * (the rank that wrote it + 1) where given."""
    t = torch.arange(rows, dtype=torch.float64).unsqueeze(1) * 100 + torch.arange(dim, dtype=torch.float64)
    if rank_of_row is not None:
        t += 10000 * (torch.tensor(rank_of_row, dtype=torch.float64).unsqueeze(1) + 1)
    return t.float()


def _wait_file(path: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def _publish(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def share_id(ctx, wm, channel: str, where: str, key: str = "uid"):
    """Rank 0 makes a unique id; every rank gets it the script's own way: a JSON file of the ints,
    a tensor saved with torch.save, or the id's 128 bytes in the harness's store."""
    uid = wm.get_unique_id() if ctx.rank == 0 else None
    path = os.path.join(where, f"{key}.{channel}")
    if channel.startswith("file"):
        os.makedirs(where, exist_ok=True)
    if channel == "file-list":
        if ctx.rank == 0:
            _publish(path, json.dumps(uid).encode())
        _wait_file(path)
        with open(path) as f:
            return json.load(f)
    if channel == "file-tensor":
        if ctx.rank == 0:
            torch.save(torch.tensor(uid, dtype=torch.int64), path + ".pt")
            _publish(path, b"1")
        _wait_file(path)
        return torch.load(path + ".pt")
    store = ctx.store("ids")
    if ctx.rank == 0:
        store.set(key, struct.pack("<16q", *uid))
    return store.get(key)


def meet(ctx, name: str) -> None:
    """Every rank of the harness's world has reached this point (before the id's maker stops
    serving it, the others must be done with it)."""
    store = ctx.store("meet")
    store.add(name, 1)
    end = time.monotonic() + 60
    while int(store.add(name, 0)) < ctx.size and time.monotonic() < end:
        time.sleep(0.01)


def _expect(rep: Report, fn, exc, *words, what: str) -> BaseException | None:
    """fn() must raise exc with every one of words in its message."""
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        rep.check(not missing, f"{what}: message lacks {missing}: {e}")
        return e
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        return e
    rep.fail(f"{what}: expected {exc.__name__}, nothing raised")
    return None


def body_flow(ctx, where, channel):
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        comm = wm.create_communicator(n, share_id(ctx, wm, channel, where), r, timeout=30)
        rep.check(not dist.is_initialized(), "a default group appeared")
        rep.check((wm.get_rank(comm), wm.get_size(comm)) == (r, n),
                  f"get_rank/get_size {wm.get_rank(comm)}/{wm.get_size(comm)}")
        rows, dim = 11, 3
        per = -(-rows // n)
        want_plan = (min(r * per, rows), min((r + 1) * per, rows) - min(r * per, rows), per, rows)
        plan = wm.get_partition_plan(comm, rows)
        rep.check(plan == want_plan, f"the communicator's plan {plan}, expected {want_plan}")
        x = torch.full((2,), float(r + 1))
        dist.all_reduce(x, group=comm)  # a communicator is a torch group too
        rep.check(x.tolist() == [n * (n + 1) / 2] * 2, f"all_reduce on the communicator: {x.tolist()}")
        for kind in KINDS:
            direct = os.environ.get("MYCCL_WM_DIRECT")
            if kind.endswith("-exchange"):
                os.environ["MYCCL_WM_DIRECT"] = "0"
            try:
                _one_kind(wm, comm, kind.split("-")[0], rows, dim, r, n, rep)
            finally:
                if direct is None:
                    os.environ.pop("MYCCL_WM_DIRECT", None)
                else:
                    os.environ["MYCCL_WM_DIRECT"] = direct
        wm.destroy_communicator(comm)
        rep.check(comm.destroyed and not wm.comm._live, "destroy_communicator left it live")
    finally:
        wm.finalize_lib()
    return rep.result()


def _one_kind(wm, comm, kind, rows, dim, r, n, rep):
    t = wm.create_wm_tensor(comm, [rows, dim], [], torch.float32, getattr(wm.WmTensorType, kind))
    rep.check(wm.get_wm_communicator(t) is comm, f"{kind}: get_wm_communicator is not the communicator")
    local = wm.get_local_tensor(t)
    first, count, _, _ = wm.get_partition_plan(t)
    rep.check(local.shape[0] == count, f"{kind}: local tensor of {local.shape[0]} rows, plan says {count}")
    # each rank fills its own part, then overwrites the rows i % n == r of everybody's parts with
    # a scatter: every rank's rows end up written by some other rank too
    owner = [i // (-(-rows // n)) for i in range(rows)]
    local.copy_(_reference(rows, dim, owner)[first:first + count])
    wm.barrier(comm)
    mine = torch.arange(r, rows, n)
    final = [i % n for i in range(rows)]
    wm.scatter(t, _reference(rows, dim, final)[mine], mine)
    wm.barrier(comm)
    got = wm.gather(t, torch.arange(rows - 1, -1, -1))
    want = _reference(rows, dim, final).flip(0)
    rep.check(torch.equal(got, want), f"{kind}: rows read back differ: {got[:, 0].tolist()} vs {want[:, 0].tolist()}")
    wm.barrier(comm)  # every rank read before the tensor goes


@pytest.mark.parametrize("channel", ["file-list", "file-tensor", "store-bytes"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_flow(run, tmp_path, size, channel):
    assert_reports(run(size, body_flow, str(tmp_path), channel, timeout=120))


def body_finalize(ctx, where):
    """finalize_lib destroys every communicator, stops serving the ids, and leaves no socket;
    a second init_lib / create_communicator cycle works."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    ctx.store("ids")  # the harness's own connection, made before counting
    gc.collect()
    sockets = open_sockets()
    for cycle in range(2):
        wm.init_lib()
        uid = share_id(ctx, wm, "file-list", where, f"uid{cycle}")
        a = wm.create_communicator(n, uid, r, timeout=30)
        b = wm.create_communicator(n, share_id(ctx, wm, "store-bytes", where, f"uid{cycle}b"), r, timeout=30)
        for comm in (a, b):
            t = wm.create_wm_tensor(comm, [5, 2], [], torch.float64, wm.WmTensorType.DISTRIBUTED)
            wm.scatter(t, torch.full((1, 2), float(cycle * 10 + r)), torch.tensor([r]))
            got = wm.gather(t, torch.arange(n))
            rep.check(torch.equal(got, torch.arange(n, dtype=torch.float64).unsqueeze(1).expand(n, 2) + cycle * 10),
                      f"cycle {cycle}: rows {got[:, 0].tolist()}")
        del t, comm  # (a communicator's object holds its store connection until it goes)
        rep.check(len(wm.comm._live) == 2, f"cycle {cycle}: {len(wm.comm._live)} live communicators, made 2")
        port = wm.comm._decode("test", r, uid)[2]
        meet(ctx, f"cycle{cycle}")
        wm.finalize_lib()
        rep.check(a.destroyed and b.destroyed and not wm.comm._live, f"cycle {cycle}: communicators left live")
        _expect(rep, lambda: wm.get_size(a), ValueError, "get_size", f"(rank {r})", "destroyed", what="after finalize")
        _expect(rep, lambda: wm.get_unique_id(), RuntimeError, "init_lib", what="get_unique_id after finalize")
        if r == 0:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                rep.fail(f"cycle {cycle}: the id's store still listens on {port} after finalize_lib")
            except OSError:
                pass
        del a, b
        gc.collect()
        left = open_sockets() - sockets
        rep.check(left == 0, f"cycle {cycle}: {left} sockets left open after finalize_lib")
    return rep.result()


@pytest.mark.parametrize("size", [1, 2])
def test_finalize_frees_everything(run, tmp_path, size):
    assert_reports(run(size, body_finalize, str(tmp_path), timeout=120))


def body_bad_id(ctx):
    """A unique id of the wrong type, length or origin: the rank that passed it gets an error
    naming the function, its rank and the value; nothing waits."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r = ctx.rank
    where = f"(rank {r})"
    _expect(rep, lambda: wm.create_communicator(2, [0] * 16, r), RuntimeError, "init_lib", where,
            what="create_communicator before init_lib")
    wm.init_lib()
    try:
        uid = wm.get_unique_id()
        cases = [
            ("abc", TypeError, "str"),
            (None, TypeError, "NoneType"),
            (uid[:8], ValueError, "list of 8"),
            (b"x" * 20, ValueError, "20 bytes"),
            (torch.zeros(16, dtype=torch.int32), TypeError, "torch.int32 tensor of 16"),
            (uid[:15] + ["x"], TypeError, "int64"),
            ([0] * 16, ValueError, "not one from get_unique_id"),
        ]
        for value, exc, word in cases:
            _expect(rep, lambda: wm.create_communicator(1, value, 0, timeout=5), exc, "create_communicator",
                    "(rank 0)", word, what=f"unique id {value!r:.40}")
        for fn in (wm.get_rank, wm.get_size, wm.barrier, wm.destroy_communicator):
            _expect(rep, lambda: fn(7), TypeError, fn.__name__, "int", what=f"{fn.__name__}(7)")
        _expect(rep, lambda: wm.create_wm_tensor("group", [4], [], torch.float32, wm.WmTensorType.HOST),
                TypeError, "create_wm_tensor", "str", what="create_wm_tensor on a string")
        _expect(rep, lambda: wm.create_wm_tensor(None, [4], [], torch.float32, wm.WmTensorType.HOST),
                RuntimeError, "create_wm_tensor", "create_communicator", what="create_wm_tensor without any group")
        # a rank passes size and rank that are not ints: its own error, before any meeting
        _expect(rep, lambda: wm.create_communicator("2", uid, r, timeout=30), TypeError, "size", "'2'", where,
                what="size as a string")
        _expect(rep, lambda: wm.create_communicator(2, uid, True, timeout=30), TypeError, "rank", "True",
                what="rank as a bool")
    finally:
        wm.finalize_lib()
    return rep.result()


def test_bad_unique_id(run):
    assert_reports(run(2, body_bad_id, timeout=60))


def body_bad_meeting(ctx, case, where):
    """One rank's arguments disagree with the others': every rank raises as soon as the meeting
    sees it, not at the meeting's timeout of 60 s (that error says "Timed out"), the bad one naming
    its value, the others the bad rank's error."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        uid = share_id(ctx, wm, "file-list", where)
        size, rank = n, r
        if case == "rank-out-of-range" and r == n - 1:
            rank = n + 4
        if case == "size-mismatch" and r == n - 1:
            size = n + 1
        if case == "negative-size" and r == 0:
            size = -1
        if case == "duplicate-rank" and r == n - 1:
            rank = 0
        try:
            wm.create_communicator(size, uid, rank, timeout=60)
            rep.fail(f"{case}: a communicator was made")
        except (ValueError, RuntimeError) as e:
            msg = str(e)
            rep.check(msg.startswith("myccl: create_communicator (rank "), f"{case}: {msg}")
            words = {"rank-out-of-range": f"rank {n + 4}", "size-mismatch": "size",
                     "negative-size": "size", "duplicate-rank": "rank 0"}[case]
            rep.check(words in msg, f"{case}: message lacks {words!r}: {msg}")
            rep.check("Timed out" not in msg, f"{case}: waited for the meeting's timeout: {msg}")
    finally:
        meet(ctx, "end")
        wm.finalize_lib()
    return rep.result()


@pytest.mark.parametrize("case", ["rank-out-of-range", "size-mismatch", "negative-size", "duplicate-rank"])
def test_bad_size_or_rank(run, tmp_path, case):
    assert_reports(run(3, body_bad_meeting, case, str(tmp_path), timeout=90))


def body_reused_id(ctx, where):
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        import c10d_ext

        uid = share_id(ctx, wm, "file-list", where)
        comm = wm.create_communicator(n, uid, r, timeout=30, options=c10d_ext.Options(transport="tcp"))
        rep.check(not comm._get_backend(torch.device("cpu")).uses_shared_memory, "options= was not applied")
        _expect(rep, lambda: wm.create_communicator(n, uid, r, timeout=30), ValueError, f"(rank {r})",
                "joined this unique id twice", what="an id used twice")
        wm.barrier(comm)
        rep.check(wm.get_size(comm) == n, "the first communicator broke")
    finally:
        meet(ctx, "end")
        wm.finalize_lib()
    return rep.result()


def test_reused_id(run, tmp_path):
    assert_reports(run(2, body_reused_id, str(tmp_path), timeout=60))


def body_missing_rank(ctx, where):
    """Every rank asks for one rank more than there are: the meeting ends at its timeout, naming
    the rank that never came."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        uid = share_id(ctx, wm, "file-list", where)
        # (8 s: on some VMs one TCPStore connection in 25 takes 5 s, which the meeting's time includes)
        _expect(rep, lambda: wm.create_communicator(n + 1, uid, r, timeout=8), RuntimeError, f"(rank {r})",
                "Timed out", f"[{n}]", what="a rank that never joins")
    finally:
        meet(ctx, "end")
        wm.finalize_lib()
    return rep.result()


def test_missing_rank_times_out(run, tmp_path):
    assert_reports(run(2, body_missing_rank, str(tmp_path), timeout=60))


def body_gone_maker(ctx):
    """An id whose maker stopped serving it (finalize_lib): create_communicator fails within its
    timeout, saying so."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    wm.init_lib()
    uid = wm.get_unique_id()
    wm.finalize_lib()
    wm.init_lib()
    try:
        _expect(rep, lambda: wm.create_communicator(1, uid, 0, timeout=3), RuntimeError, "(rank 0)",
                "the process that made the unique id", what="an id no process serves")
    finally:
        wm.finalize_lib()
    return rep.result()


def test_maker_gone(run):
    assert_reports(run(1, body_gone_maker, timeout=60))


def body_destroyed(ctx, where):
    """A destroyed communicator is refused by name; the memory of its tensors stays; collective
    accesses through it fail with the group's own error."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        comm = wm.create_communicator(n, share_id(ctx, wm, "store-bytes", where), r, timeout=30)
        host = wm.create_wm_tensor(comm, [4, 2], [], torch.float32, wm.WmTensorType.HOST)
        dist_t = wm.create_wm_tensor(comm, [4, 2], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
        if r == 0:
            host.fill_(3)
        wm.destroy_communicator(comm)  # (its barrier orders rank 0's write before the reads)
        rep.check(bool((host == 3).all()), "a HOST tensor's memory changed when its communicator went")
        for name, fn in [("create_wm_tensor", lambda: wm.create_wm_tensor(comm, [4], [], torch.float32,
                                                                          wm.WmTensorType.HOST)),
                         ("get_rank", lambda: wm.get_rank(comm)), ("get_size", lambda: wm.get_size(comm)),
                         ("barrier", lambda: wm.barrier(comm)),
                         ("destroy_communicator", lambda: wm.destroy_communicator(comm)),
                         ("get_partition_plan", lambda: wm.get_partition_plan(comm, 4))]:
            _expect(rep, fn, ValueError, f"myccl: {name} (rank {r})", comm.group_name, "destroyed", what=name)
        if n > 1:
            _expect(rep, lambda: wm.gather(dist_t, torch.tensor([0])), RuntimeError, f"rank {r}", "shut down",
                    what="a gather through a destroyed communicator")
    finally:
        wm.finalize_lib()
    return rep.result()


@pytest.mark.parametrize("size", [1, 2])
def test_destroyed_communicator(run, tmp_path, size):
    assert_reports(run(size, body_destroyed, str(tmp_path), timeout=60))


def body_from_file(ctx, where, path, part_count, shape, kind):
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        comm = wm.create_communicator(n, share_id(ctx, wm, "file-list", where), r, timeout=30)
        t = wm.create_wm_tensor_from_file(shape, torch.float32, comm, path, getattr(wm.WmTensorType, kind),
                                          part_count)
        want = _reference(12, 5)
        if not shape:
            want = want.view(-1)
        rep.check(tuple(t.shape) == tuple(want.shape), f"shape {tuple(t.shape)}")
        got = wm.gather(t, torch.arange(want.shape[0]))
        rep.check(torch.equal(got, want), f"{kind} from {os.path.basename(path)}: the rows differ")
        local, first = wm.local_partition(t)
        rep.check(torch.equal(wm.get_local_tensor(t), want[first:first + local.shape[0]]), "local tensor")
        _expect(rep, lambda: wm.create_wm_tensor_from_file([7, 5], torch.float32, comm, path,
                                                           wm.WmTensorType.CHUNKED, part_count),
                ValueError, f"create_wm_tensor_from_file (rank {r})", "35 elements", "60",
                what="a shape that is not the file's")
        _expect(rep, lambda: wm.create_wm_tensor_from_file([], torch.float32, comm, path + "-none",
                                                           wm.WmTensorType.CHUNKED, 0),
                FileNotFoundError, f"create_wm_tensor_from_file (rank {r})", "-none", what="no such file")
        wm.barrier(comm)
    finally:
        wm.finalize_lib()
    return rep.result()


@pytest.mark.parametrize("kind", ["HOST", "CHUNKED", "DISTRIBUTED"])
@pytest.mark.parametrize("layout", ["one-file", "parts-named", "parts-found"])
def test_create_wm_tensor_from_file(run, tmp_path, layout, kind):
    data = _reference(12, 5).numpy().tobytes()
    base = str(tmp_path / "table")
    if layout == "one-file":
        with open(base, "wb") as f:
            f.write(data)
    else:  # three parts cut at element (not row) boundaries: 7, 31, 22 elements
        cuts = [0, 7 * 4, 38 * 4, len(data)]
        for i in range(3):
            with open(f"{base}_part_{i}_of_3", "wb") as f:
                f.write(data[cuts[i]:cuts[i + 1]])
    part_count = 3 if layout == "parts-named" else 0
    for shape in ([12, 5], []):
        assert_reports(run(3 if kind != "HOST" else 2, body_from_file, str(tmp_path / f"ids{len(shape)}"),
                           base, part_count, shape, kind, timeout=90))


def body_default_group_helpers(ctx, local_size):
    """create_global_communicator and create_intra_node_communicator pass their ids over the
    default group, as the seed API's do."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    ctx.init(timeout=30)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        g = wm.create_global_communicator(r, n, timeout=30)
        rep.check((wm.get_rank(g), wm.get_size(g)) == (r, n), f"global: {wm.get_rank(g)}/{wm.get_size(g)}")
        local = wm.create_intra_node_communicator(r, n, local_size, timeout=30)
        rep.check((wm.get_rank(local), wm.get_size(local)) == (r % local_size, local_size),
                  f"intra-node: {wm.get_rank(local)}/{wm.get_size(local)}")
        block = r // local_size
        c = wm.create_wm_tensor(local, [6, 2], [], torch.int64, wm.WmTensorType.CHUNKED)
        part, first = wm.local_partition(c)
        part.copy_(torch.arange(first, first + part.shape[0]).unsqueeze(1).expand(-1, 2) + 1000 * block)
        wm.barrier(local)
        want = torch.arange(6).unsqueeze(1).expand(-1, 2) + 1000 * block
        rep.check(torch.equal(wm.gather(c, torch.arange(6)), want), "the intra-node table differs")
        d = wm.create_wm_tensor(g, [n], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
        wm.scatter(d, torch.tensor([float(r)]), torch.tensor([n - 1 - r]))
        rep.check(torch.equal(wm.gather(d, torch.arange(n)), torch.arange(n - 1, -1, -1).float()), "global table")
        uid = wm.broadcast_unique_id_array([5] * 16 if r == n - 1 else None, n - 1)
        rep.check(uid == [5] * 16, f"broadcast_unique_id_array gave {uid}")
        wm.barrier(g)
        # the same bad local size on every rank, and a bad world_rank on one: all raise, none waits
        _expect(rep, lambda: wm.create_intra_node_communicator(r, n, n + 1), ValueError, f"(rank {r})",
                f"local_size {n + 1}", what="a local size that does not divide the world")
        bad_rank = r + 1 if r == 0 else r
        _expect(rep, lambda: wm.create_global_communicator(bad_rank, n), ValueError,
                "world_rank 1" if r == 0 else "rank 0 passed bad arguments", what="a wrong world_rank")
    finally:
        wm.finalize_lib()
    return rep.result()


@pytest.mark.parametrize("size,local_size", [(2, 1), (4, 2)])
def test_default_group_helpers(run, size, local_size):
    assert_reports(run(size, body_default_group_helpers, local_size, timeout=120))


def test_default_group_helpers_need_a_default_group():
    import c10d_ext.wholememory as wm

    wm.init_lib()
    try:
        with pytest.raises(RuntimeError, match="create_global_communicator: .*init_process_group"):
            wm.create_global_communicator(0, 1)
    finally:
        wm.finalize_lib()


def test_unique_id_forms():
    """The id is 16 int64; its bytes and tensors name the same id; a fresh one each call."""
    import c10d_ext.wholememory as wm

    wm.init_lib()
    try:
        a, b = wm.get_unique_id(), wm.get_unique_id()
        assert len(a) == 16 and all(isinstance(w, int) and -2**63 <= w < 2**63 for w in a) and a != b
        parsed = wm.comm._decode("test", 0, a)
        assert parsed == wm.comm._decode("test", 0, struct.pack("<16q", *a))
        assert parsed == wm.comm._decode("test", 0, torch.tensor(a))
        assert parsed == wm.comm._decode("test", 0, torch.tensor(a).view(torch.uint8))
        assert parsed[3] == os.getpid() and parsed[4], parsed
    finally:
        wm.finalize_lib()


def test_interface_names_follow_the_socket_ifname_rule():
    from c10d_ext.wholememory.comm import _ifname_matches

    assert _ifname_matches("eth", "eth0") and not _ifname_matches("eth", "ib0")
    assert _ifname_matches("=eth0", "eth0") and not _ifname_matches("=eth0", "eth01")
    assert not _ifname_matches("^docker,lo", "lo") and _ifname_matches("^docker,lo", "eth0")
    assert _ifname_matches("ib,eth", "eth1")


def body_cuda(ctx, mode):
    """DEVICE, CHUNKED and DISTRIBUTED in CUDA memory on a communicator: the handle exchange and
    the NCCL engine's exchanges run on a group torch.distributed does not know."""
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    if mode == "gpu":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        import cuda_double

        cuda_double.set_device(r % 2)
        dev = torch.device("cpu")  # the double's CUDA tensors are CPU tensors
    wm.init_lib()
    try:
        comm = wm.create_communicator(n, share_id(ctx, wm, "store-bytes", ""), r, timeout=60)

        def fence():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wm.barrier(comm)

        rows, dim = 300, 33
        sends = cuda_double.counters().get("sends", 0) if mode == "double" else 0
        for kind in ("DEVICE", "CHUNKED", "DISTRIBUTED"):
            extra = {"device": "cuda"} if kind == "DISTRIBUTED" and mode == "gpu" else {}
            t = wm.create_wm_tensor(comm, [rows, dim], [], torch.float32, getattr(wm.WmTensorType, kind), **extra)
            ref = _reference(rows, dim).to(dev)
            local, first = wm.local_partition(t)
            local.copy_(ref[first:first + local.shape[0]])
            fence()
            got = wm.gather(t, torch.arange(rows - 1, -1, -1, device=dev))
            rep.check(torch.equal(got, ref.flip(0)), f"{kind}: rows read back differ")
            fence()
            mine = torch.arange(r, rows, n, device=dev)
            wm.scatter(t, -ref[mine], mine)
            fence()
            rep.check(torch.equal(wm.gather(t, torch.arange(rows, device=dev)), -ref), f"{kind}: after scatter")
            fence()
            del t, local
        if mode == "double":
            rep.check(not cuda_double.violations(), f"the double saw violations: {cuda_double.violations()}")
            sends = cuda_double.counters().get("sends", 0) - sends
            rep.check(sends > 0, "DISTRIBUTED did not run over the CUDA engine")
    finally:
        wm.finalize_lib()
    return rep.result()


@pytest.mark.parametrize("mode", [pytest.param("double", id="double"),
                                  pytest.param("gpu", id="gpu", marks=pytest.mark.cuda)])
def test_cuda_memory_on_a_communicator(run, mode):

    assert_reports(run(2, body_cuda, mode, world_env=WORLD[mode], timeout=120))


def body_across_hosts(ctx):
    """Ranks that count as different hosts (MYCCL_HOST_ID) reach the maker's store at its
    advertised addresses, not over loopback, and the communicator runs over TCP."""
    import c10d_ext
    import c10d_ext.wholememory as wm

    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    wm.init_lib()
    try:
        uid = share_id(ctx, wm, "store-bytes", "")
        _, host, _, _, addrs = wm.comm._decode("test", r, uid)
        rep.check((host == wm.comm._host_hash()) == (r == 0), "the id's host is not rank 0's alone")
        others = [a for _, a, loopback in wm.comm._interface_addresses() if not loopback]
        rep.check(bool(addrs) and (addrs != ["127.0.0.1"] or not others), f"the id advertises {addrs}")
        comm = wm.create_communicator(n, uid, r, timeout=30)
        rep.check(c10d_ext.cross_size(comm) == n, f"{c10d_ext.cross_size(comm)} hosts, expected {n}")
        t = wm.create_wm_tensor(comm, [9, 2], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
        wm.scatter(t, _reference(9, 2)[r::n], torch.arange(r, 9, n))
        rep.check(torch.equal(wm.gather(t, torch.arange(9)), _reference(9, 2)), "rows across hosts differ")
        _expect(rep, lambda: wm.create_wm_tensor(comm, [4], [], torch.float32, wm.WmTensorType.CHUNKED),
                ValueError, "spans 2 hosts", what="CHUNKED across hosts")
    finally:
        wm.finalize_lib()
    return rep.result()


def test_across_hosts(run):
    assert_reports(run(2, body_across_hosts, world_env={"MYCCL_HOST_ID": "host{rank}"}, timeout=90))
