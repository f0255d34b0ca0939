"""Horovod's stall inspector for one process set: which requests some members announced and
others did not, for how long, and when the set gives up (HOROVOD_STALL_CHECK_TIME_SECONDS,
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, HOROVOD_STALL_CHECK_DISABLE)."""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("c10d_ext.horovod")

STALL_WARNING = (
    "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and "
    "are waiting for remainder of ranks for more than {} seconds. This may indicate that different "
    "ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, "
    "which will cause deadlock. \nMissing ranks:\n{}"
)


def _env_seconds(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class StallInspector:
    """Every HOROVOD_STALL_CHECK_TIME_SECONDS the set's rank 0 warns of requests that some members
    sent and others did not, naming the missing ranks (and up to six names each); past
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS it says so in that warning and sets `stalled`, which its
    next cycle tells every member, and all of them fail the set together. Only rank 0 decides, as
    Horovod's coordinator does, so its warning always comes before the shutdown."""

    def __init__(self):
        self.enabled = _env_seconds("HOROVOD_STALL_CHECK_DISABLE", 0) <= 0
        self.warn_after = _env_seconds("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)
        self.shutdown_after = _env_seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0)
        if 0 < self.shutdown_after < self.warn_after:
            log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown.")
            self.shutdown_after = 0
        self.last_check = time.monotonic()
        self.stalled = False  # this rank saw a request wait past the shutdown time

    def inspect(self, ctrl) -> None:
        """Looks at `ctrl`'s table of announced requests (a SetController, after a negotiation)."""
        now = time.monotonic()
        if not self.enabled or not ctrl.table or now - self.last_check < self.warn_after:
            return
        self.last_check = now
        late = [(h, e) for h, e in ctrl.table.items() if now - e.since > self.warn_after]
        if not late or ctrl.me != 0:  # as Horovod's coordinator: the set's rank 0 inspects and decides
            return
        if self.shutdown_after > 0 and any(now - e.since > self.shutdown_after for _, e in late):
            self.stalled = True
        missing: dict[int, list[str]] = {}
        for h, e in late:
            name = ctrl.mine[h].name if h in ctrl.mine else f"<a tensor rank 0 did not submit, hash {h & 0xFFFFFFFF:08x}>"
            for m in range(ctrl.size):
                if m not in e.recs and m not in ctrl.joined:
                    missing.setdefault(m, []).append(name)
        lines = []
        for m, names in sorted(missing.items()):
            shown = ", ".join(names[:6]) + (" ..." if len(names) >= 6 else "")
            lines.append(f"{ctrl.entry.ranks[m]}{'!' if self.stalled else ''}: [{shown}]")
        text = STALL_WARNING.format(self.warn_after, "\n".join(lines))
        if self.stalled:
            text += (f"\nOne or more rank (marked by \"!\") is stalled for longer than {self.shutdown_after} "
                     "seconds. Will shutdown.")
        log.warning(text)
