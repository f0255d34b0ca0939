"""Communication hooks for DistributedDataParallel (ours or torch's).

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: it starts reducing
``bucket.buffer()`` and its future yields the averaged bucket. ``state`` is the process group
(None: the default group). Each works with c10d_ext's GradBucket and with torch's
``dist.GradBucket`` alike:

    ddp.register_comm_hook(None, c10d_ext.hooks.fp16_compress_hook)

The compression hooks halve the bytes on the wire; their arithmetic is torch's (cast, divide
by the world size in the low precision, sum, cast back), so results match torch's hooks bit
for bit on the same backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


def _group(state):
    return state if state is not None else dist.group.WORLD


def allreduce_hook(state, bucket) -> torch.futures.Future:
    """Plain averaging: divide in place, sum across ranks. The same result as no hook, but
    divided before instead of scaled while copying in; a starting point for custom hooks."""
    group = _group(state)
    buf = bucket.buffer()
    buf.div_(group.size())
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compressed(dtype: torch.dtype):
    def hook(state, bucket) -> torch.futures.Future:
        group = _group(state)
        buf = bucket.buffer()
        # Divide after the cast, as torch's hook does (identical bits); sums of already averaged
        # values also stay in range where summing first could overflow float16.
        low = buf.to(dtype).div_(group.size())
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()

        def restore(f):
            buf.copy_(f.value()[0])
            return buf

        return fut.then(restore)

    return hook


fp16_compress_hook = _compressed(torch.float16)
fp16_compress_hook.__name__ = fp16_compress_hook.__qualname__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = "Reduce the bucket in float16 (half the bytes), then restore its dtype."

bf16_compress_hook = _compressed(torch.bfloat16)
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = "Reduce the bucket in bfloat16 (half the bytes, float32's range), then restore its dtype."
