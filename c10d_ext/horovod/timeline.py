"""Horovod's timeline: a Chrome trace (the JSON array format of chrome://tracing and Perfetto).

Rank 0's controller records, per tensor name, the negotiation (``NEGOTIATE_<TYPE>`` with one
zero-length ``X`` event per rank that reported the tensor ready), the processing
(``<RESPONSE_TYPE>``) and the activities nested in it (``MEMCPY_IN_FUSION_BUFFER``, ...), and the
end of the op with the output's dtype and shape. The layout is Horovod 0.28.1's:

* two metadata records for pid 0 first: ``process_name`` with the wall-clock start
  (``start_time_since_epoch_in_micros``) and ``process_sort_index`` 0;
* each tensor name is a "process": on first sight it gets the next pid (1, 2, ...) and two
  metadata records, ``process_name`` (``args.name`` = the tensor name) and ``process_sort_index``;
* events are ``{"ph", "name", "ts", "pid"}`` (no ``tid``), ``name`` left out of ``E`` records,
  ``"dur": 0`` on ``X`` records and ``args`` only where there are some;
* cycle markers are global instant events ``{"ph": "i", "name": "CYCLE_START", "ts", "s": "g"}``;
* ``ts`` is in microseconds since the timeline was created (a monotonic clock).

Every record is written followed by ``]`` and the next one overwrites that ``]`` with ``,``, so
the file is a complete JSON document after every record (it can be read while training runs).
Unlike Horovod, tensor names are JSON-escaped, and the header is written when the file is
opened, so even a timeline with no events is valid JSON.

All methods may be called from several threads (one lock); after ``close()`` they do nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

__all__ = ["Timeline"]

# The Timeline rank 0 writes while one is on (controller.set_timeline turns it on and off): while
# it is on, no set holds ops (agreed.py), so that each op shows in it as a request.
ACTIVE: list = [None]

_log = logging.getLogger(__name__)

# Per-tensor state, as Horovod tracks it: what the next record may be.
_NEGOTIATING = "negotiating"
_TOP_LEVEL = "top_level"
_ACTIVITY = "activity"


def _dtype_name(dtype) -> str:
    """Horovod's data type names: float32, int64, bool, ... (torch dtypes or strings)."""
    if isinstance(dtype, str):
        return dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def _shape_text(shape) -> str:
    """Horovod's TensorShape::DebugString: "[d0, d1, ...]" ("[]" for a scalar)."""
    if isinstance(shape, str):
        return shape
    if shape is None:
        return "[]"
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _str(text: str) -> str:
    return json.dumps(str(text), ensure_ascii=False)


class Timeline:
    """Writes Horovod's timeline file at ``path``; ``mark_cycles`` enables CYCLE_START markers."""

    def __init__(self, path: str, mark_cycles: bool = False):
        self.path = path
        self.mark_cycles = bool(mark_cycles)
        self._lock = threading.RLock()
        self._pids: dict[str, int] = {}
        self._states: dict[str, str] = {}
        self._file = None
        self._records = 0
        self._start_ns = time.monotonic_ns()
        self.start_time_since_epoch_in_micros = time.time_ns() // 1000
        try:
            self._file = open(path, "wb")
        except OSError as e:
            _log.error("Error opening the Horovod Timeline file %s, will not write a timeline. (%s)", path, e)
            return
        self._write('{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":'
                    f'{self.start_time_since_epoch_in_micros}}}}}')
        self._write('{"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}')

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """True while the file is open and writable."""
        return self._file is not None

    def _ts(self) -> int:
        return (time.monotonic_ns() - self._start_ns) // 1000

    # ------------------------------------------------------------------ low level
    def _write(self, record: str) -> None:
        """Appends one record so that the file stays a complete JSON array."""
        f = self._file
        if f is None:
            return
        try:
            if self._records == 0:
                f.write(b"[\n")
            else:
                f.seek(-1, os.SEEK_END)  # the "]" that closed the array
                f.write(b",\n")
            f.write(record.encode("utf-8") + b"]")
            f.flush()
            self._records += 1
        except (OSError, ValueError) as e:
            _log.error("Error writing to the Horovod Timeline after it was successfully opened, "
                       "will stop writing the timeline. (%s)", e)
            self._close_file()

    def _pid(self, name: str) -> int:
        pid = self._pids.get(name)
        if pid is None:
            pid = len(self._pids) + 1
            self._pids[name] = pid
            self._write(f'{{"name": "process_name", "ph": "M", "pid": {pid}, "args": {{"name": {_str(name)}}}}}')
            self._write(f'{{"name": "process_sort_index", "ph": "M", "pid": {pid}, "args": {{"sort_index": {pid}}}}}')
        return pid

    def _event(self, name: str, phase: str, op_name: str = "", args: str = "") -> None:
        if self._file is None:
            return
        ts = self._ts()
        pid = self._pid(name)
        parts = [f'"ph": "{phase}"']
        if phase != "E":
            parts.append(f'"name": {_str(op_name)}')
        parts.append(f'"ts": {ts}')
        parts.append(f'"pid": {pid}')
        if phase == "X":
            parts.append('"dur": 0')
        if args:
            parts.append(f'"args": {{{args}}}')
        self._write("{" + ", ".join(parts) + "}")

    # ------------------------------------------------------------------ negotiation
    def negotiate_start(self, name: str, request_type: str) -> None:
        """B ``NEGOTIATE_<request_type>``; repeated calls while negotiating are ignored."""
        with self._lock:
            if self._file is None or self._states.get(name) == _NEGOTIATING:
                return
            self._event(name, "B", "NEGOTIATE_" + str(request_type))
            self._states[name] = _NEGOTIATING

    def negotiate_rank_ready(self, name: str, rank: int) -> None:
        """X event named after the rank that reported ``name`` ready."""
        with self._lock:
            self._event(name, "X", str(int(rank)))

    def negotiate_end(self, name: str) -> None:
        """E: every rank is ready."""
        with self._lock:
            self._event(name, "E")
            self._states.pop(name, None)

    # ------------------------------------------------------------------ processing
    def start(self, name: str, response_type: str) -> None:
        """B ``<response_type>`` (ALLREDUCE, ALLGATHER, BROADCAST, ...)."""
        with self._lock:
            self._event(name, "B", str(response_type))
            if self._file is not None:
                self._states[name] = _TOP_LEVEL

    def activity_start(self, name: str, activity: str) -> None:
        """B ``activity`` nested in the op (ends the previous activity if one is open)."""
        with self._lock:
            if self._file is None:
                return
            if self._states.get(name) == _ACTIVITY:
                self._event(name, "E")
            self._event(name, "B", str(activity))
            self._states[name] = _ACTIVITY

    def activity_end(self, name: str) -> None:
        """E of the open activity (nothing if none is open)."""
        with self._lock:
            if self._file is None or self._states.get(name) != _ACTIVITY:
                return
            self._event(name, "E")
            self._states[name] = _TOP_LEVEL

    def end(self, name: str, dtype: str | None = None, shape=None) -> None:
        """E of the op, with ``args {"dtype", "shape"}`` when ``dtype`` is given (a failed op
        passes none); an activity still open is ended first."""
        with self._lock:
            if self._file is None:
                return
            if self._states.get(name) == _ACTIVITY:
                self._event(name, "E")
            args = ""
            if dtype is not None:
                args = f'"dtype": {_str(_dtype_name(dtype))}, "shape": {_str(_shape_text(shape))}'
            self._event(name, "E", args=args)
            self._states.pop(name, None)

    # ------------------------------------------------------------------ cycles, close
    def mark_cycle_start(self) -> None:
        """A global instant event CYCLE_START (only when cycles are marked)."""
        with self._lock:
            if self._file is None or not self.mark_cycles:
                return
            self._write(f'{{"ph": "i", "name": "CYCLE_START", "ts": {self._ts()}, "s": "g"}}')

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Flushes and closes the file; later calls do nothing."""
        with self._lock:
            self._close_file()
            self._states.clear()

    def __enter__(self) -> "Timeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self._close_file()
        except Exception:  # noqa: BLE001
            pass
