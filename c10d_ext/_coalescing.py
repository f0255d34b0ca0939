"""torch's coalescing manager made exception-safe for myccl groups.

torch.distributed's ``_coalescing_manager`` (used by ``batch_isend_irecv`` and by code that
coalesces collectives) never finishes a block whose body raised: the group stays in coalescing
mode, and torch's Python keeps collecting every later ``all_reduce`` (and the like) of that
group into the dead block's list instead of running it, silently. For groups whose backend is
myccl the wrapper below ends such a block: torch's list is dropped and the backend abandons
what it held back (its ops fail with a clear error), then the exception goes on as before.
Other backends see torch's own behaviour unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.distributed_c10d as _c10d

from . import _C


def _myccl_backend_of(group, device):
    try:
        be = group._get_backend(torch.device(device) if device is not None else torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no backend for that device: not ours
        return None
    return be if isinstance(be, _C.MycclBackend) else None


def install() -> None:
    original = _c10d._coalescing_manager
    if getattr(original, "_myccl_exception_safe", False):
        return

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        g = group or _c10d._get_default_group()
        block = original(group, device, async_ops)
        cm = block.__enter__()
        try:
            yield cm
        except BaseException:
            be = _myccl_backend_of(g, device)
            if be is not None:
                _c10d._world.pg_coalesce_state.pop(g, None)
                if device is not None:
                    be._abandon_coalescing("the body of the coalescing block raised")
            raise
        block.__exit__(None, None, None)

    _coalescing_manager.__doc__ = original.__doc__
    _coalescing_manager._myccl_exception_safe = True
    _c10d._coalescing_manager = _coalescing_manager
