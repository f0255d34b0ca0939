"""Elastic training (Horovod's ``horovod.torch.elastic``): ``run`` re-runs the training function
after a failure or a host change, from the last committed state, on the world as it is now.

Here a reset is ``shutdown(); init()``: after a rank is lost (HorovodInternalError), the new
``init()`` forms the world of the survivors (torch >= 2.14); after a commit that admitted new
processes (join.py; the launcher's elastic mode, driver.py, starts them on discovered slots), it
forms the larger world. Other host updates reach a state through
``notification_manager.handle_hosts_updated`` or ``State.on_hosts_updated``.
"""

from __future__ import annotations

import functools

from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..mpi_ops import init, shutdown
from .sampler import ElasticSampler
from .state import TorchState, notification_manager


def run_fn(func, reset):
    """Wraps func(state, ...) in the elastic loop, with `reset` the framework's reset."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()  # a collective failed: back to the last commit
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync  # committed state is current; only removals skip the sync
                reset()
                state.on_reset()
        finally:
            notification_manager.remove_listener(state)

    return wrapper


def run(func):
    """Decorator for the elastic training function: ``func(state, *args, **kwargs)`` takes a
    State (e.g. TorchState) first.

    Each attempt syncs the state from rank 0, then calls func. On HorovodInternalError the
    state is restored to its last commit; on HostsUpdatedInterrupt it is kept. Either way the
    framework is reset (``shutdown(); init()``), the state's reset callbacks run and the loop
    tries again. Do not run collectives before calling the decorated function: the sync at its
    start is where ranks meet.
    """
    return run_fn(func, _reset)


def _reset():
    shutdown()
    init()


__all__ = [
    'TorchState',
    'ElasticSampler',
    'run',
    'HorovodInternalError',
    'HostsUpdatedInterrupt',
]
