"""The layer's CUDA discipline, as Horovod's GPU ops have it.

* At submission an op records a **ready event** on the caller's current stream (the producer's):
  its data work never starts before everything queued there so far.
* A set's data work (fusion copies, scaling, the collectives, copies out) runs on a **stream of
  the set's own** per device, never on the caller's or the default stream, so gradient
  allreduces run while backward's kernels are still queued. myccl's engine puts the NCCL kernel
  of a synchronous op on the current stream, which is this one.
* The work ends with a **done event**; ``synchronize`` makes the caller's current stream wait on
  it and ``record_stream``s the results the layer allocated (on the set's stream) onto the
  caller's stream, so their memory is not reused while the caller's kernels still read them.

Every call goes through myccl's device seam (``c10d_ext._C._cuda_*``): torch's CUDA calls on a
GPU, the strict test double in CI. Where the seam says the host reads tensors itself (the double:
``_cuda_stream_ordered()`` is False), host-side tensor work first waits for the set's stream.
"""

from __future__ import annotations

import torch

from .. import _C

engine_device = _C._cuda_engine_device  # tensor -> CUDA device index, -1 where the CPU engine takes it


def ready_event(device: int):
    """An event recorded on the calling thread's current stream of `device` (the producer's)."""
    ev = _C._CudaEvent()
    ev.record(_C._cuda_current_stream(device))
    return ev


class SetStreams:
    """One set's streams, one per device, made at the set's first CUDA op there. `device`: the
    device of the set's first CUDA op (-1 before), where its cycles run (``cycle``)."""

    def __init__(self):
        self._streams: dict[int, tuple] = {}
        self._ordered: bool | None = None
        self.device = -1

    def note(self, device: int) -> None:
        if self.device < 0:
            self.device = device

    def cycle(self):
        """Where a cycle of a set that has CUDA work runs: the set's stream current on its
        device, so nothing of it (on the test double, not even its control messages, which the
        double's routing puts on the current stream) queues behind the caller's or backward's
        kernels. A no-op for a set that never had a CUDA op."""
        return _NO_SCOPE if self.device < 0 else _Scope(self, self.device)

    def stream(self, device: int):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = _C._cuda_new_stream(device)
        return s

    def ordered(self) -> bool:
        if self._ordered is None:
            self._ordered = bool(_C._cuda_stream_ordered())
        return self._ordered


class _Scope:
    __slots__ = ("streams", "device", "_prev_device", "_prev_stream")

    def __init__(self, streams: SetStreams, device: int):
        self.streams, self.device = streams, device

    def __enter__(self):
        self._prev_device = _C._cuda_current_device()
        _C._cuda_set_device(self.device)
        self._prev_stream = _C._cuda_current_stream(self.device)
        _C._cuda_set_stream(self.streams.stream(self.device))
        return self

    def __exit__(self, *exc):
        _C._cuda_set_stream(self._prev_stream)
        _C._cuda_restore_device(self._prev_device)
        return False


class _NoScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_SCOPE = _NoScope()


class OnStream(_Scope):
    """``with OnStream(streams, device, ready) as on:`` the calling thread works on `device` with
    the set's stream current, after the stream has waited on each ready event; ``on.empty``
    allocates there. Leaves with the thread's device and stream as they were; ``on.done`` is the
    event recorded at the end."""

    __slots__ = ("ready", "stream", "done")

    def __init__(self, streams: SetStreams, device: int, ready):
        super().__init__(streams, device)
        self.ready, self.done = ready, None

    def __enter__(self):
        super().__enter__()
        self.stream = self.streams.stream(self.device)
        for ev in self.ready:
            ev.block(self.stream)
        if not self.streams.ordered():  # the host reads the inputs: wait for their producers
            mark = _C._CudaEvent()
            mark.record(self.stream)
            mark.synchronize()
        return self

    def empty(self, shape, like: torch.Tensor) -> torch.Tensor:
        """A result or staging tensor of `like`'s dtype, allocated on the set's stream."""
        return _C._cuda_empty(list(shape), like, self.stream)

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self.done = _C._CudaEvent()
                self.done.record(self.stream)
        finally:
            super().__exit__(*exc)
        return False


def consume(device: int, done, staged) -> None:
    """The caller's side of ``synchronize``: its current stream on `device` waits for the op's
    done event, and the layer's own results are kept until that stream has used them."""
    current = _C._cuda_current_stream(device)
    if done is not None:
        done.block(current)
    for t in staged:
        _C._cuda_record_stream(t, current)
