"""Horovod's exception types (``horovod.common.exceptions``), same names and bases."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer was lost, the ranks disagreed on a tensor, or Horovod was shut
    down. Elastic training treats it as recoverable: it restores the last commit and resets."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``State.commit()`` / ``check_host_updates()`` when the set of hosts changed.
    ``skip_sync`` is true when hosts were only removed (the state need not be broadcast)."""

    def __init__(self, skip_sync):
        self.skip_sync = skip_sync
        self.args = (skip_sync,)


class HorovodVersionMismatchError(ImportError):
    """The framework found at run time is not the one this layer was built for."""

    def __init__(self, name, version, found_version):
        super().__init__(
            f"Framework {name} installed with version {found_version} but found version {version}."
        )
        self.name = name
        self.version = version
        self.found_version = found_version


NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
SHUT_DOWN = (
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an "
    "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message."
)
DUPLICATE_NAME = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name."
)
