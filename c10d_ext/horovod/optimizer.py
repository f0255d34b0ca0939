"""DistributedOptimizer (Horovod's ``horovod.torch.optimizer``).

``DistributedOptimizer(opt, ...)`` returns an instance of a class made on the fly: it has the
wrapped optimizer's class name, subclasses that class, and takes its methods from
``_DistributedOptimizer`` (gradients reduced across ranks before the step) or, for
``op=Adasum`` on more than one rank, from ``_DistributedAdasumOptimizer`` (each rank steps
locally and the parameter deltas are combined with Adasum). The generated class lives in this
module (``__module__``), which is how ``broadcast_optimizer_state`` recognises it.

The reductions start from hooks on each parameter's gradient accumulator, so they overlap the
rest of the backward pass; ``step()`` (or ``synchronize()``) waits for them.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

from . import mpi_ops as _ops
from .compression import Compression
from .functions import broadcast_object
from .mpi_ops import (Adasum, Average, _allreduce_async, _grouped_allreduce_async, allreduce_async_, size,
                      sparse_allreduce_async, synchronize)
from .process_sets import global_process_set

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
_ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                   "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                    "your code.")


def _rocm_built() -> bool:
    fn = getattr(_ops, "rocm_built", None)
    return bool(fn()) if fn is not None else False


def _find_duplicates(items):
    seen, dups = set(), set()
    for item in items:
        if item in seen:
            dups.add(item)
        seen.add(item)
    return dups


def _checked_names(param_groups, named_parameters, default_names):
    """The (name, parameter) list after Horovod's three checks: tuples only, unique names,
    every optimizer parameter named."""
    named = list(named_parameters) if named_parameters is not None else default_names
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError('named_parameters should be a sequence of tuples (name, parameter), '
                         'usually produced by model.named_parameters().')
    dups = _find_duplicates([name for name, _ in named])
    if dups:
        raise ValueError('Parameter names in named_parameters must be unique. '
                         'Found duplicates: %s' % ', '.join(dups))
    named_ids = {id(p) for _, p in named}
    missing = [id(p) for group in param_groups for p in group["params"] if id(p) not in named_ids]
    missing = list(dict.fromkeys(missing))
    if missing:
        raise ValueError('named_parameters was specified, but one or more model parameters were not '
                         'named. Python object ids: %s' % ', '.join(str(i) for i in missing))
    return named


def _grad_accumulator(p):
    """The AccumulateGrad node of a leaf parameter: its hooks run once the gradient is in p.grad."""
    return p.expand_as(p).grad_fn.next_functions[0][0]


def _count_pass(opt, p) -> bool:
    """A gradient hook's bookkeeping, the same in both optimizers: refuses one backward pass too
    many, and says whether this pass is the one that reduces (backward_passes_per_step reached)."""
    pending = opt._handles.get(p)
    if pending is not None and pending[0] is not None and opt._allreduce_delay[p] <= 0:
        raise AssertionError(_TOO_MANY_PASSES)
    assert not p.grad.requires_grad
    assert opt._allreduce_delay[p] > 0
    opt._allreduce_delay[p] -= 1
    return opt._allreduce_delay[p] == 0


def _split_list(items, n):
    """n contiguous chunks of nearly equal length, the first len % n one longer."""
    base, extra = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


class _DistributedOptimizer(torch.optim.Optimizer):
    # Set on each generated class to the wrapped optimizer class; every call into the wrapped
    # optimizer goes through it (never zero-argument super(): these methods are copied).
    _hvd_wrapped = torch.optim.Optimizer

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=Average,
                 gradient_predivide_factor=1.0, groups=None, sparse_as_dense=False,
                 process_set=global_process_set):
        self._hvd_wrapped.__init__(self, params)
        self._compression = compression

        defaults = [(f'allreduce.noname.{i}.{j}', p)
                    for i, group in enumerate(self.param_groups)
                    for j, p in enumerate(group["params"])]
        named = _checked_names(self.param_groups, named_parameters, defaults)

        self._parameter_names = {p: name for name, p in named}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for _, p in named}
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        self._handles = {}  # parameter, or tuple of parameters (a group) -> (handle, ctx)
        self._grad_accs = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True

        if groups is not None:
            if not (isinstance(groups, list) or groups > 0):
                raise ValueError('groups should be a non-negative integer or '
                                 'a list of list of torch.Tensor.')
            if isinstance(groups, list):
                grouped = set()
                for group in groups:
                    for p in group:
                        if not isinstance(p, torch.Tensor):
                            raise ValueError('groups must consist of torch.Tensor.')
                        if id(p) in grouped:
                            raise ValueError('A parameter can only appear once in groups.')
                        grouped.add(id(p))
        self._groups = groups
        self._p_to_group = {}
        self._group_counts = {}

        if self.process_set.included() and (size() > 1 or os.environ.get('HOROVOD_ELASTIC') == '1'):
            self._register_hooks()

    @staticmethod
    def find_duplicates(lst):
        return _find_duplicates(lst)

    def load_state_dict(self, *args, **kwargs):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._hvd_wrapped.load_state_dict(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _form_groups(self, trainable):
        # Every rank must group (and so name) identically: rank 0's parameter order decides.
        names = broadcast_object([self._parameter_names.get(p) for p in trainable], root_rank=0,
                                 process_set=self.process_set)
        trainable = sorted(trainable, key=lambda p: names.index(self._parameter_names.get(p)))
        if isinstance(self._groups, list):
            trainable_ids = {id(p) for p in trainable}
            formed, placed = [], set()
            for group in self._groups:
                members = [p for p in group if id(p) in trainable_ids]
                formed.append(members)
                placed.update(id(p) for p in members)
            formed += [[p] for p in trainable if id(p) not in placed]
        else:
            formed = _split_list(trainable, self._groups)
        for members in formed:
            group = tuple(members)
            for p in group:
                self._p_to_group[p] = group
            self._group_counts[group] = 0

    def _register_hooks(self):
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if self._groups is not None:
            self._form_groups(trainable)
        for p in trainable:
            self._requires_update.add(p)
            acc = _grad_accumulator(p)
            acc.register_hook(self._make_hook(p))
            self._grad_accs.append(acc)

    def _allreduce_grad_async(self, p):
        if p.grad is None:
            # Not computed on this rank this step (a branch not taken); peers may have it.
            p.grad = p.data.new(p.size()).zero_()
        name = self._parameter_names.get(p)
        tensor = p.grad
        if tensor.is_sparse:
            if not self.sparse_as_dense:
                return sparse_allreduce_async(tensor, name=name, op=self.op,
                                              process_set=self.process_set), None
            tensor = tensor.to_dense()
        compressed, ctx = self._compression.compress(tensor)
        if self.op == Average:
            # The backend divides by the set's size on top of the postscale.
            prescale, postscale = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            prescale, postscale = 1.0, 1.0
        # allreduce_async_, untimed: synchronize() always waits for it (so a held list of
        # gradients ends where the program says on every rank, not on a timer)
        handle = _allreduce_async(compressed, compressed, name, self.op, prescale, postscale, self.process_set,
                                  timed=False)
        return handle, ctx

    def _grouped_allreduce_grad_async(self, group):
        compressed, ctxs = zip(*[self._compression.compress(p.grad) for p in group])
        compressed = list(compressed)  # grouped_allreduce_async_, untimed as above
        handle = _grouped_allreduce_async(compressed, compressed, self._parameter_names.get(group[0]), self.op, 1.0,
                                          1.0, self.process_set, timed=False)
        return handle, ctxs

    def _make_hook(self, p):
        def hook(*_):
            handle, ctx = None, None
            if _count_pass(self, p):
                if self._groups is not None:
                    group = self._p_to_group[p]
                    self._group_counts[group] += 1
                    if self._group_counts[group] == len(group):
                        self._handles[group] = self._grouped_allreduce_grad_async(group)
                        for member in group:
                            self._handles.pop(member, None)
                        self._group_counts[group] = 0
                        return
                else:
                    handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self):
        if not self.process_set.included():
            self._synchronized = True
            return

        submitted = set()
        for key in self._handles:
            submitted.update(key) if isinstance(key, tuple) else submitted.add(key)
        # Parameters whose hook never fired, then those still short of backward_passes_per_step.
        for p in self._requires_update - submitted:
            self._handles[p] = self._allreduce_grad_async(p)
        for key, (handle, _) in list(self._handles.items()):
            if handle is None:
                self._handles[key] = self._allreduce_grad_async(key)

        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, tuple):
                outputs = synchronize(handle)
                for p, output, pctx in zip(key, outputs, ctx):
                    self._allreduce_delay[p] = self.backward_passes_per_step
                    p.grad.set_(self._compression.decompress(output, pctx))
                if self._groups is not None:
                    self._group_counts[key] = 0
                continue
            p = key
            if callable(handle):  # a sparse allreduce: calling it waits and gives the result
                output = handle()
            else:
                output = synchronize(handle)
            self._allreduce_delay[p] = self.backward_passes_per_step
            if self._groups is not None:
                self._group_counts[self._p_to_group[p]] = 0
            if p.grad.is_sparse:
                result = output if callable(handle) else self._compression.decompress(output, ctx)
                if not result.is_sparse:
                    result = result.to_sparse()  # reduced dense (sparse_as_dense): back to sparse
                p.grad.zero_().add_(result)  # sparse tensors have no set_
            else:
                p.grad.set_(self._compression.decompress(output, ctx))
        self._handles.clear()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Inside this context, step() does not synchronize (after an explicit synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC)
            self.synchronize()
        self._synchronized = False
        return self._hvd_wrapped.step(self, closure)

    def zero_grad(self):
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        return self._hvd_wrapped.zero_grad(self)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    _hvd_wrapped = torch.optim.Optimizer

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1):
        self._hvd_wrapped.__init__(self, params)
        self._compression = compression

        defaults = [('allreduce.noname.%s' % i, p)
                    for group in self.param_groups
                    for i, p in enumerate(group["params"])]
        named = _checked_names(self.param_groups, named_parameters, defaults)

        self._parameter_names = {p: name for name, p in named}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for _, p in named}
        self._handles = {}
        self._grad_accs = []
        self._requires_update = set()
        self._synchronized = False
        self._should_synchronize = True
        # Per parameter: the value before the local step, to which the combined delta is added.
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._register_hooks()

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _register_hooks(self):
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                p.grad = p.data.new(p.size()).zero_()
                self._requires_update.add(p)
                acc = _grad_accumulator(p)
                acc.register_hook(self._make_hook(p))
                self._grad_accs.append(acc)

    def _allreduce_grad_async(self, p):
        """Steps p alone with the wrapped optimizer, turns p into its own change (new - old) and
        starts the Adasum reduction of that delta in place."""
        start = self._starting_models[p]
        stashed = []
        for group in self.param_groups:
            stashed.append(group["params"])
            group["params"] = [p] if any(p is q for q in group["params"]) else []
        try:
            start.data.copy_(p)
            self._hvd_wrapped.step(self)
            p.data.sub_(start)
            compressed, ctx = self._compression.compress(p)
            handle = allreduce_async_(compressed.data, name=self._parameter_names.get(p), op=Adasum)
        finally:
            for group, params in zip(self.param_groups, stashed):
                group["params"] = params
        return handle, ctx

    def _make_hook(self, p):
        def hook(*_):
            handle, ctx = None, None
            if _count_pass(self, p):
                handle, ctx = self._allreduce_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def synchronize(self):
        pass

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - makes this a generator, so the error comes when the block is entered

    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, (handle, ctx) in self._handles.items():
            if not handle:  # step() before backward_passes_per_step passes: reduce now
                handle, ctx = self._allreduce_grad_async(p)
                self._handles[p] = (handle, ctx)
            delta = self._compression.decompress(synchronize(handle), ctx)
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self):
        if self._handles:
            raise AssertionError(_ZERO_GRAD_RACE)
        return self._hvd_wrapped.zero_grad(self)


def _generated_class(wrapped, implementation):
    """A class named like `wrapped`, subclassing it, with `implementation`'s methods."""
    namespace = {k: v for k, v in implementation.__dict__.items() if k not in ("__dict__", "__weakref__")}
    namespace["_hvd_wrapped"] = wrapped
    return type(wrapped.__name__, (wrapped,), namespace)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set):
    """Wraps ``optimizer`` so that gradients are averaged (``op``) across the ranks of
    ``process_set`` before each step; the reductions start during ``loss.backward()``.

    Arguments (Horovod's): ``named_parameters`` names the reductions (usually
    ``model.named_parameters()``); ``compression`` (``Compression.none``/``.fp16``) is applied
    to each gradient; ``backward_passes_per_step`` accumulates that many backward passes
    locally before reducing; ``gradient_predivide_factor`` splits the averaging into a
    prescale of 1/f and a postscale of f/size (op=Average only); ``groups`` (an int, or a list
    of lists of parameters) reduces parameters together as grouped allreduces (``num_groups``
    is its deprecated name); ``sparse_as_dense`` reduces sparse gradients densely.

    Use ``synchronize()`` then ``with optimizer.skip_synchronize(): optimizer.step()`` to act
    on the reduced gradients (e.g. clipping) before the step.
    """
    if gradient_predivide_factor != 1.0:
        if _rocm_built():
            raise ValueError('gradient_predivide_factor not supported yet with ROCm')
        if op != Average:
            raise ValueError('gradient_predivide_factor not supported with op != Average')

    if num_groups != 0:
        warnings.warn('Parameter `num_groups` has been replaced by `groups` '
                      'and will be removed in v0.23.0.', DeprecationWarning)
        if groups is None:
            groups = num_groups

    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")

    if op != Adasum or size() == 1:
        cls = _generated_class(optimizer.__class__, _DistributedOptimizer)
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set)
    if process_set != global_process_set:  # identity: ProcessSet has no __eq__
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    cls = _generated_class(optimizer.__class__, _DistributedAdasumOptimizer)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
