"""Point-to-point: send/recv and isend/irecv with tags, sizes on both sides of the TCP eager
limit (64 KiB) up to several MB, many messages in flight, out-of-order tags, receive from any
source, batch_isend_irecv rings, strided buffers, and a receive nobody answers (timeout, then
the group still works).

Every payload is a deterministic function of (sender, tag, size) so each receiver checks the
exact bytes it got.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from expect import make
from harness import Report, assert_reports, work_exception

EAGER = 64 * 1024  # MYCCL_TCP_EAGER_BYTES
LOCAL_EAGER = 1024 * 1024  # MYCCL_LOCAL_EAGER_BYTES: peers on this host (shared-memory mailbox slots)
MAILBOX_MIN = 16 * 1024  # local messages from this size up to LOCAL_EAGER use a free mailbox slot
MAILBOX_SLOTS = 4  # per ordered pair of local ranks
STRIPE = 512 * 1024  # TCP messages from this size to peers on other hosts use every socket to them


def payload(src: int, tag: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    return make(src * 1000 + tag, (numel,), dtype, 77)


def body_send_recv_basics(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    r = ctx.rank
    peer = 1 - r
    # blocking, in both directions, several dtypes (incl. ones without reduction kernels)
    for k, dtype in enumerate([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                               torch.complex64, torch.uint16]):
        if r == 0:
            dist.send(payload(0, k, 37, dtype), dst=1, tag=k)
            got = torch.empty(37, dtype=dtype)
            dist.recv(got, src=1, tag=k)
            rep.check(torch.equal(got, payload(1, k, 37, dtype)), f"blocking recv {dtype}")
        else:
            got = torch.empty(37, dtype=dtype)
            dist.recv(got, src=0, tag=k)
            rep.check(torch.equal(got, payload(0, k, 37, dtype)), f"blocking recv {dtype}")
            dist.send(payload(1, k, 37, dtype), dst=0, tag=k)
    # sizes around the eager limit and well beyond it; both ranks send and receive at once
    for numel in [0, 1, EAGER - 1, EAGER, EAGER + 1, 100 * 1024, LOCAL_EAGER, LOCAL_EAGER + 1, 3 * 1024 * 1024 + 7,
                  9 * 1024 * 1024]:
        out = payload(r, 100, numel, torch.uint8) if numel < 4 * 1024 * 1024 else torch.arange(numel, dtype=torch.int64).to(torch.uint8) + r
        want = payload(peer, 100, numel, torch.uint8) if numel < 4 * 1024 * 1024 else torch.arange(numel, dtype=torch.int64).to(torch.uint8) + peer
        got = torch.empty(numel, dtype=torch.uint8)
        ws = dist.isend(out, dst=peer, tag=100)
        wr = dist.irecv(got, src=peer, tag=100)
        ws.wait()
        wr.wait()
        rep.check(torch.equal(got, want), f"isend/irecv {numel} bytes")
    # a float tensor of several MB, blocking on one side, irecv on the other
    big = 2 * 1024 * 1024 + 3  # 8 MB of float32
    if r == 0:
        dist.send(payload(0, 7, big), dst=1, tag=7)
    else:
        got = torch.empty(big)
        w = dist.irecv(got, src=0, tag=7)
        w.wait()
        rep.check(torch.equal(got, payload(0, 7, big)), "8 MB float32 send -> irecv")
    # same tag, several messages: delivered in the order they were sent
    if r == 1:
        ws = [dist.isend(torch.full((n,), float(i)), dst=0, tag=3) for i, n in enumerate([5, 70000, 1, 20000, 3])]
        for w in ws:
            w.wait()
    else:
        for i, n in enumerate([5, 70000, 1, 20000, 3]):
            got = torch.empty(n)
            dist.recv(got, src=1, tag=3)
            rep.check(torch.equal(got, torch.full((n,), float(i))), f"same-tag message {i} in order")
    # tags at the ends of the int range torch accepts
    for tag in [2**31 - 1, -1, 0]:
        if r == 0:
            dist.send(torch.full((3,), float(tag)), dst=1, tag=tag)
        else:
            got = torch.zeros(3)
            dist.recv(got, src=0, tag=tag)
            rep.check(torch.equal(got, torch.full((3,), float(tag))), f"tag {tag}")
    # a rendezvous-size isend still pending while collectives run on the same group
    big = torch.arange(1_000_000.0)
    ws = dist.isend(big, dst=peer, tag=11)
    y = torch.ones(4)
    dist.all_reduce(y)
    rep.check(torch.equal(y, torch.full((4,), 2.0)), "all_reduce while an isend waits for its receiver")
    got = torch.empty(1_000_000)
    dist.recv(got, src=peer, tag=11)
    ws.wait()
    rep.check(torch.equal(got, big), "the pending 4 MB isend, received after the all_reduce")
    return rep.result()


def test_send_recv_basics(run):
    assert_reports(run(2, body_send_recv_basics, timeout=90))


def body_direct_copies(ctx, transport):
    """Large messages between ranks of one host: copied straight from the sender's memory
    (stats say "direct") unless TCP is forced; mid-size ones go through a shared-memory mailbox
    slot, small ones over the socket."""
    import c10d_ext

    ctx.init(timeout=30, pg_options=c10d_ext.Options(transport=transport))
    rep = Report(ctx)
    r, peer = ctx.rank, 1 - ctx.rank
    limit = LOCAL_EAGER if transport == "auto" else EAGER
    # at the eager limit, just past it, 12 MB, tiny: which path each took is in the stats
    at_limit = "mailbox" if transport == "auto" else "tcp"
    for numel, path in [(limit // 4, at_limit), (limit // 4 + 1, None), (3 * 1024 * 1024 + 5, None), (12, "tcp")]:
        c10d_ext.reset_stats()
        got = torch.empty(numel)
        ws = dist.isend(payload(r, 5, numel), dst=peer, tag=5)
        wr = dist.irecv(got, src=peer, tag=5)
        wr.wait()
        ws.wait()
        rep.check(torch.equal(got, payload(peer, 5, numel)), f"{numel} floats both ways")
        # over TCP, messages from 512 KiB are spread over MYCCL_SOCKETS_PER_PEER (2) sockets
        path = path or ("direct" if transport == "auto" else "tcp-striped" if numel * 4 >= STRIPE else "tcp")
        # from 1 MiB the receiver copies with two threads (MYCCL_COPY_THREADS)
        want = sorted([path, "direct-parallel" if path == "direct" and numel * 4 >= 1 << 20 else path])
        rep.check(sorted(k.split("/")[1] for k in c10d_ext.stats()) == want,
                  f"{numel} floats sent and received by {want}: {sorted(c10d_ext.stats())}")
    c10d_ext.reset_stats()
    # the sender's buffer is the message: a receive posted late still gets the bytes as sent
    if r == 0:
        src = payload(0, 6, 1 << 20)
        dist.send(src, dst=1, tag=6)
    else:
        time.sleep(0.3)
        got = torch.empty(1 << 20)
        dist.recv(got, src=0, tag=6)
        rep.check(torch.equal(got, payload(0, 6, 1 << 20)), "late receive of 4 MB")
    st = c10d_ext.stats()
    rep.check(any(k.split("/")[1].startswith("direct") for k in st) == (transport == "auto"), f"stats {sorted(st)}")
    if transport == "auto":
        # the copy split across 1 and 3 threads: odd sizes, every byte where it belongs
        for threads, numel in [(1, 3 * 1024 * 1024 + 5), (3, 3 * 1024 * 1024 + 5), (3, (1 << 18) + 1)]:
            g = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(copy_threads=threads))
            got = torch.empty(numel)
            ws = dist.isend(payload(r, threads, numel), dst=peer, tag=7, group=g)
            dist.recv(got, src=peer, tag=7, group=g)
            ws.wait()
            rep.check(torch.equal(got, payload(peer, threads, numel)), f"{numel} floats, {threads} copy threads")
            split = threads > 1 and numel * 4 >= 1 << 20
            want = sorted(["direct", "direct-parallel" if split else "direct"])
            st = c10d_ext.stats(g)
            rep.check(sorted(k.split("/")[1] for k in st) == want,
                      f"{numel} floats, {threads} copy threads: {want} != {sorted(st)}")
    return rep.result()


def body_striped_messages(ctx):
    """Large TCP messages spread over several sockets per peer (MYCCL_TRANSPORT=tcp treats every
    peer as remote): every byte lands where it belongs, whatever the number of sockets, the size
    (just below and at the threshold, odd sizes, parts of unequal length), the direction or the
    order in which many such messages are posted; the stats say which path each took."""
    import c10d_ext

    ctx.init(timeout=30)
    rep = Report(ctx)
    r, peer = ctx.rank, 1 - ctx.rank
    for socks in [1, 2, 3]:
        g = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(transport="tcp", sockets_per_peer=socks))
        for nbytes in [STRIPE - 1, STRIPE, 3 * 1024 * 1024 + 5, 9 * 1024 * 1024 + 4097]:
            c10d_ext.reset_stats(g)
            out = payload(r, socks, nbytes, torch.uint8)
            got = torch.empty(nbytes, dtype=torch.uint8)
            ws = dist.isend(out, dst=peer, tag=socks, group=g)  # both directions at once
            dist.recv(got, src=peer, tag=socks, group=g)
            ws.wait()
            rep.check(torch.equal(got, payload(peer, socks, nbytes, torch.uint8)), f"{nbytes} bytes, {socks} sockets")
            path = "tcp-striped" if socks > 1 and nbytes >= STRIPE else "tcp"
            st = sorted(k.split("/")[1] for k in c10d_ext.stats(g))
            rep.check(st == [path, path], f"{nbytes} bytes, {socks} sockets: {st}, want {path}")
        # many messages in flight, received in the opposite order: parts of different messages
        # share the lanes and are matched by receive, not by arrival
        sizes = [STRIPE + k * 333_331 for k in range(12)]
        sends = [dist.isend(payload(r, 20 + k, sizes[k], torch.uint8), dst=peer, tag=20 + k, group=g)
                 for k in range(12)]
        bufs = {k: torch.empty(sizes[k], dtype=torch.uint8) for k in range(12)}
        recvs = [dist.irecv(bufs[k], src=peer, tag=20 + k, group=g) for k in reversed(range(12))]
        for w in recvs + sends:
            w.wait()
        bad = [k for k in range(12) if not torch.equal(bufs[k], payload(peer, 20 + k, sizes[k], torch.uint8))]
        rep.check(not bad, f"{socks} sockets: 12 large messages in flight, wrong: {bad}")
        # collectives over the striped path: reduce-scatter segments and gathered slices
        x = payload(r, 40, 3 * 1024 * 1024 + 1)
        want = payload(0, 40, x.numel()) + payload(1, 40, x.numel())
        dist.all_reduce(x, group=g)
        rep.check(torch.equal(x, want), f"{socks} sockets: all_reduce of 12 MB")
        dist.destroy_process_group(g)
    # ranks that disagree about the number of sockets fail at once, saying what to set
    try:
        dist.new_group(backend="myccl", pg_options=c10d_ext.Options(transport="tcp", sockets_per_peer=2 + r))
        err = "no error"
    except Exception as e:  # noqa: BLE001
        err = str(e)
    rep.check("MYCCL_SOCKETS_PER_PEER" in err and f"rank {peer}" in err, f"mismatched sockets per peer: {err}")
    return rep.result()


def test_striped_messages(run):
    assert_reports(run(2, body_striped_messages, timeout=120))


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_direct_copies_between_local_ranks(run, transport):
    assert_reports(run(2, body_direct_copies, transport, timeout=60))


def _paths(stats, side: str) -> dict:
    """{path: count} of this rank's sends or receives in c10d_ext.stats()."""
    return {k.split("/")[1]: v["count"] for k, v in stats.items() if k.startswith(side + "/")}


def body_sender_leaves_after_send(ctx):
    """A send is complete once its bytes are on their way: the sender may then shut its group
    down at once, and the receiver still gets every byte. Over TCP large messages travel on the
    data sockets while the goodbye travels on the control socket, so the goodbye can be read
    first; it must not fail a receive whose bytes are still arriving. The sender freezes the
    receiver from the moment its send completes until its goodbye is out, so the receiver
    finds both waiting at once."""
    import os
    import signal

    import c10d_ext

    ctx.init(timeout=30)
    rep = Report(ctx)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    sizes = [(16 << 20) + 3, 4 << 20, STRIPE // 4 + 1, EAGER // 4 + 1]
    msgs = [payload(0, k, numel) for k, numel in enumerate(sizes)]
    # the goodbye overtook the data in one round of twenty to forty here before the fix
    for i in range(100):
        numel, msg = sizes[i % 4], msgs[i % 4]
        g = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(transport="tcp"))
        if ctx.rank == 0:
            w = dist.isend(msg, dst=1, tag=i, group=g)
            w.wait()
            os.kill(pids[1], signal.SIGSTOP)
            try:
                dist.destroy_process_group(g)
            finally:
                os.kill(pids[1], signal.SIGCONT)
        else:
            got = torch.empty(numel)
            dist.recv(got, src=0, tag=i, group=g)
            rep.check(torch.equal(got, msg), f"message {i} of {numel} floats")
            dist.destroy_process_group(g)
        dist.barrier()
    return rep.result()


def test_sender_leaves_right_after_send(run):
    assert_reports(run(2, body_sender_leaves_after_send, timeout=120))


def body_peer_leaves_while_receiving(ctx, transport):
    """A receive whose sender shuts its group down fails at once, in the words users match for
    gloo ("closed"), with the reason the peer gave."""
    import c10d_ext

    ctx.init(timeout=30)
    g = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(transport=transport))
    if ctx.rank == 1:
        dist.barrier()
        time.sleep(0.3)
        dist.destroy_process_group(g)
        dist.barrier()
        return ""
    w = dist.irecv(torch.empty(10), src=1, tag=3, group=g)
    dist.barrier()
    try:
        w.wait()
        err = "no error"
    except Exception as e:  # noqa: BLE001
        err = str(e)
    dist.barrier()
    return err


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_peer_leaving_fails_a_receive_with_its_reason(run, transport):
    err = run(2, body_peer_leaves_while_receiving, transport, timeout=60)[0]
    assert "rank 1 left the group and closed its connections: it shut down its process group" in err, err
    assert "Timed out" not in err, err  # the peer's leaving ended it, not the group's 30 s timeout


def body_mailbox(ctx):
    """Mid-size messages between ranks of one host go through shared-memory mailbox slots:
    every byte right around the size limits; more messages in flight than slots (the rest fall
    back to the socket or a direct copy) still arrive in order per tag; a sender may reuse its
    buffer as soon as its send completes; a receive of the wrong size fails alone and frees the
    slot (all slots are usable afterwards); receive-from-any takes mailbox messages too."""
    import c10d_ext

    ctx.init(timeout=30)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    right, left = (r + 1) % n, (r - 1) % n
    # a ring: every rank sends and receives, sizes around the mailbox's lower and upper limits
    for nbytes in [MAILBOX_MIN - 1, MAILBOX_MIN, MAILBOX_MIN + 3, 300_001, LOCAL_EAGER - 1, LOCAL_EAGER]:
        dist.barrier()
        c10d_ext.reset_stats()
        got = torch.full((nbytes,), 7, dtype=torch.uint8)
        ws = dist.isend(payload(r, 1, nbytes, torch.uint8), dst=right, tag=1)
        dist.recv(got, src=left, tag=1)
        ws.wait()
        rep.check(torch.equal(got, payload(left, 1, nbytes, torch.uint8)), f"ring {nbytes} bytes")
        want = {"tcp": 1} if nbytes < MAILBOX_MIN else {"mailbox": 1}
        st = c10d_ext.stats()
        rep.check(_paths(st, "send") == want and _paths(st, "recv") == want, f"{nbytes} bytes went by {want}: {st}")
    dist.barrier()
    # rank 0 -> 1: twice as many messages as slots before rank 1 receives any; each tag's
    # messages must come out in the order sent, whatever path each took
    if r < 2:
        c10d_ext.reset_stats()
        sizes = [(k % 3) * 150_000 + 20_000 + k for k in range(2 * MAILBOX_SLOTS)]  # 20 KB .. 320 KB
        tags = [10 + k % 2 for k in range(len(sizes))]
        if r == 0:
            works = [dist.isend(payload(0, k, sizes[k], torch.uint8), dst=1, tag=tags[k]) for k in range(len(sizes))]
            mine = _paths(c10d_ext.stats(), "send")
            rep.check(mine.get("mailbox") == MAILBOX_SLOTS, f"the first {MAILBOX_SLOTS} sends took the slots: {mine}")
            for w in works:
                w.wait()
        else:
            time.sleep(0.3)
            bufs = [torch.empty(sizes[k], dtype=torch.uint8) for k in range(len(sizes))]
            # the odd tag's messages first, each tag in send order
            order = [k for k in range(len(sizes)) if tags[k] == 11] + [k for k in range(len(sizes)) if tags[k] == 10]
            works = [dist.irecv(bufs[k], src=0, tag=tags[k]) for k in order]
            for w in works:
                w.wait()
            bad = [k for k in range(len(sizes)) if not torch.equal(bufs[k], payload(0, k, sizes[k], torch.uint8))]
            rep.check(not bad, f"messages {bad} of {len(sizes)} wrong or out of order")
            got = _paths(c10d_ext.stats(), "recv")
            rep.check(got.get("mailbox") == MAILBOX_SLOTS and sum(got.values()) == len(sizes),
                      f"{MAILBOX_SLOTS} via the slots, the rest another way: {got}")
    dist.barrier()
    # the sender's buffer is free once its send completed: overwrite it before the receive
    if r == 0:
        buf = payload(0, 20, 200_000, torch.uint8).clone()
        dist.send(buf, dst=1, tag=20)
        buf.zero_()
    elif r == 1:
        time.sleep(0.2)
        got = torch.empty(200_000, dtype=torch.uint8)
        dist.recv(got, src=0, tag=20)
        rep.check(torch.equal(got, payload(0, 20, 200_000, torch.uint8)), "buffer reused after the send completed")
    dist.barrier()
    # a receive of the wrong size fails alone; then all the slots still work
    if r == 0:
        dist.send(payload(0, 30, 100_000, torch.uint8), dst=1, tag=30)
    elif r == 1:
        time.sleep(0.2)
        guard = torch.full((200_020,), 9, dtype=torch.uint8)
        try:
            dist.recv(guard[10:200_010], src=0, tag=30)
            rep.fail("a 100000-byte message received into 200000 bytes raised nothing")
        except RuntimeError as e:
            rep.check("100000" in str(e) and "200000" in str(e), f"the error gives both sizes: {str(e)[:300]}")
        rep.check(bool((guard == 9).all()), "the refused message wrote into the receive buffer")
    dist.barrier()
    if r < 2:
        c10d_ext.reset_stats()
        if r == 0:
            works = [dist.isend(payload(0, 40 + k, 50_000, torch.uint8), dst=1, tag=40 + k) for k in range(MAILBOX_SLOTS)]
            for w in works:
                w.wait()
        else:
            time.sleep(0.2)
            for k in range(MAILBOX_SLOTS):
                got = torch.empty(50_000, dtype=torch.uint8)
                dist.recv(got, src=0, tag=40 + k)
                rep.check(torch.equal(got, payload(0, 40 + k, 50_000, torch.uint8)), f"message {k} after the mismatch")
            got = _paths(c10d_ext.stats(), "recv")
            rep.check(got == {"mailbox": MAILBOX_SLOTS}, f"every slot free again after the mismatch: {got}")
    dist.barrier()
    # receive-from-any: rank 0 takes one mailbox message from every other rank
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            got = torch.empty(70_000, dtype=torch.uint8)
            src = dist.recv(got, tag=50)
            rep.check(torch.equal(got, payload(src, 50, 70_000, torch.uint8)), f"any-source message from {src}")
            seen.add(src)
        rep.check(seen == set(range(1, n)), f"any-source senders {sorted(seen)}")
    else:
        dist.send(payload(r, 50, 70_000, torch.uint8), dst=0, tag=50)
    y = torch.ones(3)
    dist.all_reduce(y)
    rep.check(torch.equal(y, torch.full((3,), float(n))), "all_reduce after the mailbox traffic")
    return rep.result()


@pytest.mark.parametrize("world", [2, 3])
def test_mailbox(run, world):
    assert_reports(run(world, body_mailbox, timeout=90))


def body_mailbox_geometry_mismatch(ctx):
    """Ranks that disagree about MYCCL_LOCAL_EAGER_BYTES (the slot size) must not read each
    other's segments with the wrong layout: the group falls back to TCP between them and every
    message still arrives whole."""
    import c10d_ext

    ctx.init(timeout=30)
    rep = Report(ctx)
    r, peer = ctx.rank, 1 - ctx.rank
    g = dist.new_group(backend="myccl", pg_options=c10d_ext.Options(local_eager_bytes=(256 << 10) * (r + 1)))
    for nbytes in [20_000, 200_000, 300_000, 600_000]:
        c10d_ext.reset_stats(g)
        got = torch.empty(nbytes, dtype=torch.uint8)
        ws = dist.isend(payload(r, 60, nbytes, torch.uint8), dst=peer, tag=60, group=g)
        dist.recv(got, src=peer, tag=60, group=g)
        ws.wait()
        rep.check(torch.equal(got, payload(peer, 60, nbytes, torch.uint8)), f"{nbytes} bytes with unequal slot sizes")
        rep.check("mailbox" not in _paths(c10d_ext.stats(g), "recv"), f"no mailbox between unequal ranks: {c10d_ext.stats(g)}")
    y = torch.ones(2)
    dist.all_reduce(y, group=g)
    rep.check(torch.equal(y, torch.full((2,), 2.0)), "all_reduce on the fallback group")
    return rep.result()


def test_mailbox_geometry_mismatch(run):
    assert_reports(run(2, body_mailbox_geometry_mismatch, timeout=60))


def body_out_of_order_tags(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    for numel in [16, EAGER // 4 + 100, 1 << 20]:  # eager, just past eager, 4 MB
        eager = numel * 4 <= EAGER
        if ctx.rank == 1:
            if eager:  # small messages: blocking sends complete without the receiver
                dist.send(payload(1, 1, numel), dst=0, tag=1)
                dist.send(payload(1, 2, numel), dst=0, tag=2)
            else:
                w1 = dist.isend(payload(1, 1, numel), dst=0, tag=1)
                w2 = dist.isend(payload(1, 2, numel), dst=0, tag=2)
                w2.wait()
                w1.wait()
        else:
            if eager:
                time.sleep(0.2)  # let both messages arrive first
                a = torch.empty(numel)
                dist.recv(a, src=1, tag=2)
                b = torch.empty(numel)
                dist.recv(b, src=1, tag=1)
            else:
                a = torch.empty(numel)
                b = torch.empty(numel)
                w2 = dist.irecv(a, src=1, tag=2)
                w2.wait()  # tag 2 completes although tag 1 was sent first and is not posted yet
                w1 = dist.irecv(b, src=1, tag=1)
                w1.wait()
            rep.check(torch.equal(a, payload(1, 2, numel)), f"tag 2 received first ({numel} floats)")
            rep.check(torch.equal(b, payload(1, 1, numel)), f"tag 1 received second ({numel} floats)")
    return rep.result()


def test_out_of_order_tags(run):
    assert_reports(run(2, body_out_of_order_tags, timeout=60))


def body_many_in_flight(ctx):
    ctx.init(timeout=60)
    rep = Report(ctx)
    r, peer = ctx.rank, 1 - ctx.rank
    sizes = [(k * 7919) % 40000 + (k % 5) * 20000 for k in range(96)]  # 0 .. ~120k floats
    sends = [dist.isend(payload(r, k, sizes[k]), dst=peer, tag=k) for k in range(96)]
    bufs = {}
    recvs = []
    for k in reversed(range(96)):  # posted in the opposite order
        bufs[k] = torch.empty(sizes[k])
        recvs.append((k, dist.irecv(bufs[k], src=peer, tag=k)))
    for _, w in recvs:
        w.wait()
    for w in sends:
        w.wait()
    bad = [k for k in range(96) if not torch.equal(bufs[k], payload(peer, k, sizes[k]))]
    rep.check(not bad, f"{len(bad)} of 96 in-flight messages wrong (tags {bad[:10]})")
    return rep.result()


def test_many_messages_in_flight(run):
    assert_reports(run(2, body_many_in_flight, timeout=90))


def body_any_source(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    n = ctx.size
    if ctx.rank == 0:
        seen = []
        for _ in range(n - 1):
            buf = torch.empty(10)
            src = dist.recv(buf, tag=5)  # no src: whoever comes first
            seen.append(src)
            rep.check(torch.equal(buf, payload(src if isinstance(src, int) else 0, 5, 10)),
                      f"recv(any) returned source {src} but the data is not that rank's")
        rep.check(sorted(seen) == list(range(1, n)), f"recv(any) reported sources {seen}")
        seen = []
        for _ in range(n - 1):
            buf = torch.empty(70000)  # past the eager limit
            w = dist.irecv(buf, tag=6)
            w.wait()
            src = w._source_rank()
            seen.append(src)
            rep.check(torch.equal(buf, payload(src, 6, 70000)), f"irecv(any) source {src}: data mismatch")
        rep.check(sorted(seen) == list(range(1, n)), f"irecv(any) _source_rank() gave {seen}")
    else:
        dist.send(payload(ctx.rank, 5, 10), dst=0, tag=5)
        dist.send(payload(ctx.rank, 6, 70000), dst=0, tag=6)
    return rep.result()


def test_recv_any_source(run):
    assert_reports(run(3, body_any_source, timeout=60))


def body_batch_ring(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    n, r = ctx.size, ctx.rank
    right, left = (r + 1) % n, (r - 1) % n
    for numel in [5, 50000]:
        # one direction
        buf = torch.empty(numel)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, payload(r, 1, numel), right),
                                       dist.P2POp(dist.irecv, buf, left)])
        for w in reqs:
            w.wait()
        rep.check(torch.equal(buf, payload(left, 1, numel)), f"ring exchange {numel}")
        # both directions at once, receives listed first
        from_left, from_right = torch.empty(numel), torch.empty(numel)
        ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
               dist.P2POp(dist.isend, payload(r, 2, numel), right), dist.P2POp(dist.isend, payload(r, 3, numel), left)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if n > 2:
            rep.check(torch.equal(from_left, payload(left, 2, numel)), f"bidirectional ring from left {numel}")
            rep.check(torch.equal(from_right, payload(right, 3, numel)), f"bidirectional ring from right {numel}")
        else:  # left == right: two messages from the one peer, matched in order
            rep.check(torch.equal(from_left, payload(left, 2, numel)) and torch.equal(from_right, payload(left, 3, numel)),
                      f"bidirectional exchange with one peer {numel}")
    # the group still runs collectives after coalesced p2p
    y = torch.ones(2)
    dist.all_reduce(y)
    rep.check(torch.equal(y, torch.full((2,), float(n))), "all_reduce after batch_isend_irecv")
    return rep.result()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_batch_isend_irecv_ring(run, size):
    assert_reports(run(size, body_batch_ring, timeout=60))


def body_strided(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    src_t = torch.arange(48.0).reshape(6, 8)
    if ctx.rank == 1:
        dist.send(src_t.t(), dst=0)              # non-contiguous send: values in t() order
        dist.send(src_t[:, ::2].clone(), dst=0)
        dist.send(torch.arange(1000.0)[::3], dst=0, tag=1)
    else:
        base = torch.zeros(8, 6)
        view = base.t()                          # (6, 8), non-contiguous
        dist.recv(view.t(), src=1)               # receive into the (8, 6) view's transpose again
        rep.check(torch.equal(base, src_t.t()), "recv into a transposed view")
        holes = torch.full((6, 8), -1.0)
        dist.recv(holes[:, ::2], src=1)
        rep.check(torch.equal(holes[:, ::2], src_t[:, ::2]), "recv into a strided slice: values")
        rep.check(torch.equal(holes[:, 1::2], torch.full((6, 4), -1.0)), "recv into a strided slice: gaps untouched")
        got = torch.empty(334)
        dist.recv(got, src=1, tag=1)
        rep.check(torch.equal(got, torch.arange(1000.0)[::3]), "send of a strided 1-D tensor")
    return rep.result()


def test_noncontiguous_buffers(run):
    assert_reports(run(2, body_strided, timeout=60))


def body_recv_timeout(ctx):
    """rank 1 never sends; rank 0's recv must fail within the group timeout (3 s), and the
    withdrawn receive must not swallow the next message."""
    ctx.init(timeout=3)
    rep = Report(ctx)
    store = ctx.store("p2p-timeout")
    msg = None
    if ctx.rank == 0:
        buf = torch.zeros(10)
        try:
            dist.recv(buf, src=1, tag=9)
            rep.fail("recv from a silent peer returned")
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            rep.check(isinstance(e, dist.DistError), f"not a torch.distributed error: {msg}")
            rep.check("myccl" in msg and "recv" in msg, f"error does not name the op: {msg}")
            rep.check("Timed out in wait() after 3000 ms" in msg, f"not ended by the group's 3 s timeout: {msg}")
        # irecv + wait() without a timeout: also bounded by the group timeout
        w = dist.irecv(torch.zeros(10), src=1, tag=10)
        try:
            w.wait()
            rep.fail("irecv.wait() from a silent peer returned")
        except Exception as e:  # noqa: BLE001
            rep.check("Timed out in wait() after 3000 ms" in str(e), f"irecv.wait(): {str(e).splitlines()[0]}")
            rep.check(not w.is_success() and work_exception(w) is not None, "failed irecv: is_success/exception")
        store.set("timed-out", "1")
        got = torch.zeros(10)
        dist.recv(got, src=1, tag=9)
        rep.check(torch.equal(got, payload(1, 9, 10)), f"message after the withdrawn receive: {got[:3].tolist()}")
    else:
        store.get("timed-out")  # waits (store timeout 60 s) until rank 0 has given up
        dist.send(payload(1, 9, 10), dst=0, tag=9)
    y = torch.ones(2)
    try:
        dist.all_reduce(y)
        rep.check(torch.equal(y, torch.full((2,), 2.0)), "all_reduce after a p2p timeout")
    except Exception as e:  # noqa: BLE001
        rep.fail(f"group unusable after a p2p receive timed out: {str(e).splitlines()[0]}")
    return rep.result(), msg


def test_recv_from_silent_peer_times_out(run):
    results = run(2, body_recv_timeout, timeout=60)
    assert_reports([x[0] for x in results])


def body_wait_with_timeout(ctx):
    """Work.wait(timeout) shorter than the op: raises, the op stays pending and completes later."""
    ctx.init(timeout=30)
    rep = Report(ctx)
    store = ctx.store("wait-timeout")
    if ctx.rank == 0:
        buf = torch.zeros(100)
        w = dist.irecv(buf, src=1)
        try:
            w.wait(timedelta(milliseconds=300))
            rep.fail("wait(300 ms) returned before anybody sent")
        except Exception as e:  # noqa: BLE001
            # wait()'s own 300 ms ended it, not the group's timeout (30 s)
            rep.check("myccl" in str(e) and "Timed out in wait() after 300 ms" in str(e),
                      f"wait(timeout) error: {str(e).splitlines()[0]}")
        rep.check(not w.is_completed(), "irecv completed although nothing was sent")
        store.set("go", "1")
        w.wait()
        rep.check(w.is_completed() and w.is_success(), "irecv completed after the send")
        rep.check(torch.equal(buf, payload(1, 0, 100)), "irecv data after an earlier wait(timeout)")
    else:
        store.get("go")
        dist.send(payload(1, 0, 100), dst=0)
    return rep.result()


def test_wait_with_short_timeout_then_complete(run):
    assert_reports(run(2, body_wait_with_timeout, timeout=60))


def body_subgroup_p2p(ctx):
    ctx.init(timeout=30)
    rep = Report(ctx)
    g = dist.new_group([1, 2])
    if ctx.rank == 1:
        dist.send(payload(1, 0, 1000), dst=2, group=g)          # global rank
        dist.send(payload(1, 1, 1000), group_dst=1, group=g)    # group rank
    elif ctx.rank == 2:
        a, b = torch.empty(1000), torch.empty(1000)
        dist.recv(a, src=1, group=g)
        dist.recv(b, group_src=0, group=g)
        rep.check(torch.equal(a, payload(1, 0, 1000)), "subgroup recv by global rank")
        rep.check(torch.equal(b, payload(1, 1, 1000)), "subgroup recv by group rank")
    else:
        rep.check(True, "rank 0 is not in the subgroup")
    return rep.result()


def test_p2p_in_subgroup(run):
    assert_reports(run(3, body_subgroup_p2p, timeout=60))
