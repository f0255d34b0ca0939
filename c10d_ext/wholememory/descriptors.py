"""Passing file descriptors (exported CUDA memory handles) between the processes of one host:
each process binds an abstract Unix datagram socket and sends every other one its descriptor with
SCM_RIGHTS. Abstract names leave no file behind, whatever way a process ends.

A datagram queue holds only a few messages (net.unix.max_dgram_qlen, 10 by default), fewer than a
host may have ranks, so nothing here blocks: sends and receives interleave under one poll, each
send on a socket connected to its peer (a connected datagram socket polls writable exactly when
the peer's queue has room), and a rank whose sends meet full queues keeps draining its own."""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time

_MSG = struct.Struct("qq")  # (sender's index, bytes of its memory)


class MissingPeers(TimeoutError):
    """Some peers' descriptors did not come in time; ``missing`` are their indices."""

    def __init__(self, missing: list[int], timeout: float):
        super().__init__(f"nothing came from index(es) {missing} within {timeout:.0f} s")
        self.missing = missing


class Mailbox:
    """One process's end of an exchange among ``len(names)`` processes, at ``names[index]``.
    Bind every process's mailbox before any calls swap (the caller's barrier)."""

    def __init__(self, names: list[str], index: int):
        self.names, self.index = names, index
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(names[index])
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def __enter__(self) -> "Mailbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def swap(self, fd: int, nbytes: int, timeout: float) -> list[tuple[int, int]]:
        """Sends (``fd``, ``nbytes``) to every peer and returns every process's pair, in index
        order: a received descriptor is the caller's to close, -1 where the peer sent none; this
        process's own entry is (-1, nbytes). Raises MissingPeers after ``timeout`` seconds, or
        OSError; either way having closed every descriptor received."""
        n = len(self.names)
        got: list[tuple[int, int] | None] = [None] * n
        got[self.index] = (-1, nbytes)
        payload = _MSG.pack(self.index, nbytes)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))] if fd >= 0 else []
        deadline = time.monotonic() + timeout
        outs: dict[int, socket.socket] = {}
        sel = selectors.DefaultSelector()
        try:
            sel.register(self.sock, selectors.EVENT_READ)
            for j in range(n):
                if j == self.index:
                    continue
                s = outs[j] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                s.setblocking(False)
                s.connect(self.names[j])
                if not _send(s, payload, rights):
                    sel.register(s, selectors.EVENT_WRITE, j)
                self._drain(got)  # room in this queue for the peers' sends, at once
            while True:
                self._drain(got)
                pending = [key.data for key in sel.get_map().values() if key.data is not None]
                if not pending and all(g is not None for g in got):
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MissingPeers([i for i, g in enumerate(got) if g is None] or pending, timeout)
                for key, _ in sel.select(left):
                    if key.data is not None and _send(outs[key.data], payload, rights):
                        sel.unregister(key.fileobj)
        except BaseException:
            for entry in got:
                if entry is not None and entry[0] >= 0:
                    os.close(entry[0])
            raise
        finally:
            sel.close()
            for s in outs.values():
                s.close()

    def _drain(self, got: list) -> None:
        """Takes every message waiting in this process's queue."""
        while True:
            try:
                msg, fds, flags, _ = socket.recv_fds(self.sock, _MSG.size, 1)
            except BlockingIOError:
                return
            i, b = _MSG.unpack(msg) if len(msg) == _MSG.size else (-1, 0)
            if len(msg) != _MSG.size or flags & socket.MSG_CTRUNC or not 0 <= i < len(got) or got[i] is not None:
                for f in fds:
                    os.close(f)
                raise OSError(f"an unexpected message ({len(msg)} bytes from index {i}, flags {flags:#x})")
            got[i] = (fds[0] if fds else -1, b)


def _send(s: socket.socket, payload: bytes, rights: list) -> bool:
    """One datagram to the connected peer; False while its queue is full."""
    try:
        s.sendmsg([payload], rights)
        return True
    except BlockingIOError:
        return False
