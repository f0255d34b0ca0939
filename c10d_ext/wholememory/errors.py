"""The whole-memory layer's error form and its agreement on errors: what every module of the layer
raises with, kept apart so that the modules depend one way (tensor and device both use it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rank(group) -> int | None:
    """This process's rank in ``group`` (None: the default group; None without one). The group's
    own rank(): torch's get_rank needs a default group, which a communicator does without."""
    if isinstance(group, dist.ProcessGroup):
        return group.rank()
    return dist.get_rank() if dist.is_initialized() else None


def fail(op: str, group, text: str, exc=ValueError):
    """Raises the project's error form: the op, this rank (in the group) and what is wrong."""
    rank = _rank(group)
    raise exc(f"myccl: {op}{'' if rank is None else f' (rank {rank})'}: {text}")


def agree_on_error(op: str, group, error: BaseException | None, others: str, exc=ValueError) -> None:
    """Collective: every rank learns whether any rank failed before a step all must take together.
    The rank that failed raises its own error; the others raise ``others`` (with ``{rank}``, the
    first rank that failed), so none waits in a step the others skip."""
    flags = torch.zeros(group.size(), dtype=torch.int32)
    flags[group.rank()] = error is not None
    dist.all_reduce(flags, group=group)
    if error is not None:
        raise error
    if flags.any():
        fail(op, group, others.format(rank=int(flags.nonzero()[0])), exc)
