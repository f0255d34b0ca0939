"""Gradient compression for the collectives and DistributedOptimizer (Horovod's
``horovod.torch.compression``).

A compressor is a pair of static functions: ``compress(tensor) -> (compressed, ctx)`` runs
before the collective, ``decompress(compressed, ctx) -> tensor`` after it.
"""

from __future__ import annotations

import torch


class Compressor:
    """The interface; both functions of the base class do nothing and return None."""

    @staticmethod
    def compress(tensor):
        """Returns the tensor to send and whatever decompress needs to undo the change."""
        pass

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor as it was before compress, given that function's ctx."""
        pass


class NoneCompressor(Compressor):
    """Sends the tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype; every
    other dtype passes through unchanged."""

    @staticmethod
    def compress(tensor):
        original = tensor.dtype
        if original.is_floating_point:
            tensor = tensor.to(torch.float16)
        return tensor, original

    @staticmethod
    def decompress(tensor, ctx):
        if ctx.is_floating_point:
            tensor = tensor.to(ctx)
        return tensor


class Compression:
    """The compressors by name: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
