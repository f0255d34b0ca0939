"""What an op hands a set's controller and what a cycle announces of it: the kinds of request,
the dtypes and their codes, the layout of a cycle's message (a header and fixed-size records),
``Request`` (one tensor of one op on this rank, with its record), ``Handle`` (what an op's
caller waits on) and the table of the handles of ops not held (agreed.py holds the others).
Below every other module of the layer: it imports none of them but ``streams``."""

from __future__ import annotations

import hashlib
import struct
import threading

import torch

from .streams import engine_device

ALLREDUCE, ALLGATHER, BROADCAST, JOIN, ADASUM, ALLTOALL, BARRIER, REDUCESCATTER = range(8)
KIND_NAMES = ["ALLREDUCE", "ALLGATHER", "BROADCAST", "JOIN", "ADASUM", "ALLTOALL", "BARRIER", "REDUCESCATTER"]

DTYPES = [torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.float32, torch.float64, torch.bool, torch.bfloat16]
DTYPE_NAMES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32",
               "float64", "bool", "bfloat16"]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}

SLOTS = 64  # requests a member announces per cycle (more go in the next, at once)
FIELDS = 8  # int64 per record
HEADER = 3  # count, flags, the key of the pending list the member runs in this cycle (agreed.flush)
# header flags: more queued, a stall past the shutdown time, shutting down, work in some set of the
# member's process (its peers' loops stay awake: loop.py)
MORE, STALLED, LEAVING, ACTIVE = 2, 4, 8, 16


_HASHES: dict = {}  # names and signatures repeat every step: hash each once


def _h64(text: str) -> int:
    h = _HASHES.get(text)
    if h is None:
        if len(_HASHES) > 1 << 16:
            _HASHES.clear()
        h = _HASHES[text] = struct.unpack("<q", hashlib.blake2b(text.encode(), digest_size=8).digest())[0]
    return h


def _fbits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bitsf(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


_SIGS: dict = {}


class Request:
    """One tensor of one op on this rank. ``desc`` is what must agree across ranks (printed in
    mismatch errors); ``rows`` the first dimension where ranks may differ (allgather, alltoall)."""

    __slots__ = ("kind", "name", "nhash", "tensor", "output", "op", "pre", "post", "root",
                 "splits", "handle", "desc", "sighash", "rows", "rowsize", "result",
                 "cuda_event", "is_cuda", "dtype", "device")

    def __init__(self, kind, name, tensor, output=None, op=0, pre=1.0, post=1.0, root=-1, splits=None):
        self.kind, self.name, self.tensor, self.output = kind, name, tensor, output
        self.op, self.pre, self.post, self.root, self.splits = op, pre, post, root, splits
        self.nhash = _h64(name)
        self.handle = None
        self.result = None
        self.cuda_event = None
        if tensor is None:  # join, barrier
            self.dtype, self.device, shape = None, -1, ()
        else:  # device: the CUDA engine's device index that takes the tensor, -1 for the CPU engine
            self.dtype, self.device, shape = tensor.dtype, engine_device(tensor), tuple(tensor.shape)
        self.is_cuda = self.device >= 0
        self.rows = shape[0] if shape else 0
        self.rowsize = 1
        for d in shape[1:]:
            self.rowsize *= d
        varies = kind in (ALLGATHER, ALLTOALL)
        self.desc = (KIND_NAMES[kind], DTYPE_NAMES[DTYPE_CODE[self.dtype]] if self.dtype is not None else "",
                     "GPU" if self.is_cuda else "CPU", shape, float(pre), float(post), int(op), int(root))
        sig = (kind, self.desc[1], self.is_cuda, (len(shape), shape[1:]) if varies else shape, self.desc[4],
               self.desc[5], self.desc[6], self.desc[7])
        h = _SIGS.get(sig)
        if h is None:
            if len(_SIGS) > 1 << 16:
                _SIGS.clear()
            h = _SIGS[sig] = _h64(repr(sig))
        self.sighash = h

    def record(self) -> list[int]:
        ndim = self.tensor.dim() if self.tensor is not None else 0
        code = (self.kind | (DTYPE_CODE.get(self.dtype, 0) << 8) | (int(self.is_cuda) << 16) | (self.op << 20)
                | (min(ndim, 255) << 24))
        numel = self.tensor.numel() if self.tensor is not None else 0
        return [self.nhash, self.sighash, code, numel, self.rows, _fbits(self.pre), _fbits(self.post), self.root]


class Handle:
    """What an async op returns a number for: done when every request of the op is."""

    __slots__ = ("remaining", "error", "event", "finish", "cuda_event", "ctrl", "device", "staged")

    def __init__(self, parts: list[Request], finish):
        self.remaining = len(parts)
        self.error = None
        self.event = threading.Event()
        self.finish = finish  # () -> the value synchronize returns
        self.cuda_event = None  # the done event of a CUDA op (streams.py)
        self.device = -1
        self.staged: list = []  # results the layer allocated on a set's stream
        self.ctrl = None
        for r in parts:
            r.handle = self

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.remaining = 0
        self.event.set()

    def part_done(self, req: Request, error: BaseException | None = None) -> None:
        if error is not None and self.error is None:
            self.error = error
        if req.cuda_event is not None:
            self.cuda_event, self.device = req.cuda_event, req.device
            res = req.result
            if res is not None:
                self.staged.extend(res if isinstance(res, tuple) else (res,))
        self.remaining -= 1
        if self.remaining <= 0:
            self.event.set()


# What Horovod's coordinator answers an op of these kinds while a rank has joined.
JOIN_UNSUPPORTED = {
    ALLGATHER: "Allgather is not supported with Join at this time. Specify sparse_to_dense=True if using DistributedOptimizer",
    ALLTOALL: "Alltoall is not supported with Join at this time.",
    BROADCAST: "Broadcast is not supported with Join at this time.",
    REDUCESCATTER: "Reducescatter is not supported with Join at this time.",
}


# The handles of ops not held, by number (agreed.py holds the others): handles.py registers and
# looks them up, agreed.py registers the ops a held list hands on to the negotiation.
HANDLES: dict[int, Handle] = {}
