"""DistributedDataParallel on c10d_ext's own C++ Reducer (src/reducer).

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same constructor arguments, same
``state_dict`` keys (``module.*``), ``no_sync()``, ``join()``, ``register_comm_hook()``, on any
backend (myccl, gloo, nccl). This file is only the nn.Module face: bucketing, autograd hooks,
launching, waiting and averaging happen in the C++ Reducer.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import _C, trace

__all__ = ["DistributedDataParallel"]

logger = logging.getLogger("c10d_ext")

_DEFAULT_BUCKET_CAP_MB = 25
_MB = 1024 * 1024
# Model states (construction, buffers, final model after join) travel in chunks this large.
_BROADCAST_CHUNK_BYTES = 250 * _MB


class _OutputSink(torch.autograd.Function):
    """Identity on the forward's outputs. Its backward runs before any parameter's gradient, on
    the outermost graph task of the backward, and tells the Reducer to queue its end-of-backward
    callback there: nested (reentrant checkpoint) backwards end earlier than the real one."""

    @staticmethod
    def forward(ctx, reducer, *tensors):
        ctx.set_materialize_grads(False)  # an unused output keeps a None gradient
        ctx.reducer = reducer
        # Returned inputs would become views, and views made by a custom Function may not be
        # modified in place later; a clone keeps the outputs ordinary tensors.
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reducer.backward_started()
        return (None, *grads)


def _find_tensors(obj) -> list:
    """Tensors inside containers pytree does not know (dataclasses), for the unused-parameter walk."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _find_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _find_tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _find_tensors(getattr(obj, f.name))]
    return []


def _emit_trace(it: dict) -> None:
    """Timeline events for one synchronised backward (called only while tracing)."""
    n = it["iteration"]
    trace.complete("ddp backward", it["backward_start_us"], it["backward_end_us"], category="ddp",
                   track="ddp", iteration=n)
    trace.complete("ddp wait + write-back", it["backward_end_us"], it["finished_us"], category="ddp",
                   track="ddp", iteration=n)
    for b in it["buckets"]:
        done = b["done_us"] or it["finished_us"]
        trace.complete(f"ddp bucket {b['index']}", b["launch_us"], done, category="ddp", track="ddp buckets",
                       iteration=n, bucket=b["index"], nbytes=b["nbytes"], num_params=b["num_params"],
                       ready_us=b["ready_us"], launch_delay_us=b["launch_us"] - b["ready_us"],
                       backend_memory=b["backend_memory"], fused_average=b["fused_average"],
                       grad_copies=b["grad_copies"])


class _JoinHook(JoinHook):
    """For a rank that ran out of inputs: mirrors each forward/backward's collectives of the
    ranks still training, in the same order, contributing zeros."""

    def __init__(self, ddp: "DistributedDataParallel", divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._joined = True
        should_sync = ddp._sync_flag(False)
        if should_sync:
            ddp.reducer.rebuild_buckets()
        if ddp._will_sync_buffers():
            ddp._sync_buffers()
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)
        self.ddp._joined = False


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism with c10d_ext's Reducer; see ``torch.nn.parallel.DistributedDataParallel``.

    Differences from torch's: buckets overlap backward from the first iteration on (torch uses
    one bucket until it has seen an iteration); with ``find_unused_parameters=False`` a parameter
    that gets no gradient raises at the end of that same backward, naming it, instead of at the
    next forward after the optimizer has stepped; ``bucket_stats()`` gives per-bucket timings.
    Without ``gradient_as_bucket_view`` (on CPU), each ``.grad`` is a tensor with a storage of
    its own, not a view, placed over its slot in the bucket, so gradients are accumulated and
    averaged where they are reduced instead of being copied into the bucket and back every step
    (``reducer.set_grad_alias(False)`` restores the copies).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
    ):
        super().__init__()
        Joinable.__init__(self)
        for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                            ("mixed_precision", mixed_precision)):
            if value is not None:
                raise NotImplementedError(f"myccl: ddp: {name} is not supported by c10d_ext.DistributedDataParallel")
        if check_reduction:
            warnings.warn("check_reduction is deprecated and ignored: the Reducer always checks", FutureWarning,
                          stacklevel=2)
        if process_group is not None and device_mesh is not None:
            raise ValueError("myccl: ddp: pass process_group or device_mesh, not both")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(f"myccl: ddp: device_mesh must be 1-D, got {device_mesh.ndim} dimensions")
            process_group = device_mesh.get_group()
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("myccl: ddp: no process group: call dist.init_process_group() first")
            process_group = dist.group.WORLD
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"myccl: ddp: bucket_cap_mb must be > 0, got {bucket_cap_mb}")

        self.module = module
        self.process_group = process_group
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._joined = False  # set while this rank shadows the others under join()
        self._rank = dist.get_rank(process_group)

        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = ignore
        params, names, sparse = self._params_for_reducer(ignore)
        if not params:
            raise RuntimeError("myccl: ddp: the module has no parameter that requires a gradient; "
                               "DistributedDataParallel is not needed")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"myccl: ddp: parameters live on several devices ({sorted(map(str, devices))}); "
                             "use one device per process")
        self.device = next(iter(devices))
        self.device_type = self.device.type
        if self.device_type == "cpu" and (device_ids or output_device is not None):
            raise ValueError(f"myccl: ddp: device_ids={device_ids} / output_device={output_device} are for "
                             "single-device GPU modules; the module is on the CPU")
        if device_ids is not None:
            ids = [torch.device(self.device_type, d) if isinstance(d, int) else torch.device(d) for d in device_ids]
            if len(ids) != 1 or ids[0] != self.device:
                raise ValueError(f"myccl: ddp: device_ids must name the module's one device {self.device}, "
                                 f"got {device_ids}")
        self.device_ids = None if device_ids is None else [self.device.index]
        self.output_device = self.device if output_device is None else torch.device(output_device)

        if init_sync:
            # Same parameters everywhere (names the first that differs), then rank 0's values.
            _C._ddp_verify_params(process_group, params, names)
            states = [p.detach() for p in params]
            if broadcast_buffers:
                states += [b.detach() for b in self._buffers_to_sync()]
            with torch.no_grad():
                _C._ddp_broadcast_coalesced(process_group, states, _BROADCAST_CHUNK_BYTES, 0)

        cap = _DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        cap_bytes = int(cap * _MB)
        # As torch: with the default cap the first bucket is small, so communication starts early.
        first_bytes = min(dist._DEFAULT_FIRST_BUCKET_BYTES, cap_bytes) if bucket_cap_mb is None else cap_bytes
        self.bucket_bytes_cap = cap_bytes
        self.reducer = _C.Reducer(params, names, sparse, process_group, cap_bytes, first_bytes,
                                  find_unused_parameters, gradient_as_bucket_view, static_graph)
        self.reducer.set_iteration_observer(_emit_trace)
        self._comm_hook: tuple[Callable, Any] | None = None

    # ---- construction helpers ----------------------------------------------------------------

    def _params_for_reducer(self, ignore):
        params, names, sparse, seen = [], [], [], set()
        for mod_name, mod in self.module.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                fqn = f"{mod_name}.{p_name}" if mod_name else p_name
                if not p.requires_grad or fqn in ignore or p in seen:
                    continue
                seen.add(p)
                params.append(p)
                names.append(fqn)
                sparse.append(isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse)
        return params, names, sparse

    def _buffers_to_sync(self):
        # Buffers may be reassigned by the module, so they are looked up every time.
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("c10d_ext.DistributedDataParallel.forward"):
            grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
            if grad_sync:
                self.reducer.prepare_for_forward()
            work = Join.notify_join_context(self)
            if work is not None:
                self.reducer.set_join_future(work.get_future(), self._divide_by_initial_world_size)
            if self._join_config.enable:
                self._sync_flag(grad_sync)  # joined ranks learn whether to shadow a backward
            if grad_sync and self.reducer.rebuild_buckets():
                logger.info("myccl: ddp: rank %d: buckets rebuilt in gradient-ready order: %s", self._rank,
                            [len(b) for b in self.reducer.bucket_plan()])
            if self._will_sync_buffers():
                self._sync_buffers()
            if self.device_ids:
                inputs, kwargs = tree_map(self._to_device, (inputs, kwargs))
            output = self.module(*inputs, **kwargs)
            if not grad_sync:
                self.require_forward_param_sync = False
                return output
            self.require_forward_param_sync = True
            output, routed = self._attach_sink(output)
            walked = []
            if self.find_unused_parameters and not self.static_graph:
                walked = routed or [t for t in _find_tensors(output) if t.requires_grad]
            # Without the sink (no output tensor pytree can see) the Reducer falls back to
            # finishing at the end of the graph task that runs the first gradient hook.
            self.reducer.prepare_for_backward(walked, bool(routed))
            return output

    def _to_device(self, x):
        return x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x

    def _attach_sink(self, output):
        flat, spec = tree_flatten(output)
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return output, []
        routed = _OutputSink.apply(self.reducer, *[flat[i] for i in idx])
        for i, t in zip(idx, routed):
            flat[i] = t
        return tree_unflatten(flat, spec), list(routed)

    # ---- collectives outside the Reducer -----------------------------------------------------

    def _will_sync_buffers(self) -> bool:
        return self.require_forward_param_sync and self.broadcast_buffers and len(self._buffers_to_sync()) > 0

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank for which `candidate` holds (an allreduce MAX)."""
        t = torch.tensor([self._rank if candidate else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        root = int(t.item())
        if root < 0:
            raise RuntimeError("myccl: ddp: no rank qualifies as the source of the model state")
        return root

    def _sync_buffers(self) -> None:
        # Under join(), rank 0 may have stopped training: take a rank that still does.
        root = self._common_rank(not self._is_joined()) if self._join_config.enable else 0
        buffers = self._buffers_to_sync()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
            _C._ddp_broadcast_coalesced(self.process_group, [b.detach() for b in buffers],
                                        _BROADCAST_CHUNK_BYTES, root)

    def _is_joined(self) -> bool:
        return self._joined

    def _sync_flag(self, grad_sync: bool) -> bool:
        """join(): allreduce of 'a backward sync follows'. Active ranks do not wait for it."""
        t = torch.ones(1, device=self.device) if grad_sync else torch.zeros(1, device=self.device)
        work = dist.all_reduce(t, group=self.process_group, async_op=True)
        if grad_sync or not self._is_joined():
            return grad_sync
        work.wait()
        return bool(t.item() != 0)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        root = self._common_rank(is_last_joiner)
        states = [p.detach() for p in self.module.parameters()]
        if self.broadcast_buffers:
            states += [b.detach() for b in self._buffers_to_sync()]
        with torch.no_grad():
            _C._ddp_broadcast_coalesced(self.process_group, states, _BROADCAST_CHUNK_BYTES, root)

    # ---- public API --------------------------------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first synchronised backward after it reduces them."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """``hook(state, bucket) -> torch.futures.Future[Tensor]``; ``bucket`` has buffer(), index(),
        is_last(), parameters(), gradients(), set_buffer(). The hook must average (the Reducer
        does not divide when a hook is registered). Before the first backward; once."""
        if not callable(hook):
            raise TypeError(f"myccl: ddp: the comm hook must be callable, got {type(hook).__name__}")
        try:
            nparams = len(inspect.signature(hook).parameters)
        except (TypeError, ValueError):
            nparams = 2
        if nparams != 2:
            raise ValueError(f"myccl: ddp: the comm hook must take (state, bucket), {hook} takes {nparams} arguments")
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook = (hook, state)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """Context manager for uneven inputs: ranks that run out of inputs shadow the others'
        collectives; at the end the last rank to finish broadcasts the model."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def bucket_stats(self) -> list[dict]:
        """Per synchronised backward (the last ten): backward start/end, and per bucket its size,
        when its last gradient was ready, when its reduction was launched and when it completed
        (CLOCK_REALTIME microseconds, the timeline's clock), whether the average was folded into
        the reduction (``fused_average``) and how many gradients had to be copied into it
        (``grad_copies``: none once every ``.grad`` lives in its bucket)."""
        return self.reducer.bucket_stats()

