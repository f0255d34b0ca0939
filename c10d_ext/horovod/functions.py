"""Helpers built from the collectives (Horovod's ``horovod.torch.functions``): broadcasting a
model's parameters or an optimizer's state from one rank, and moving arbitrary picklable
objects (broadcast from a root, allgather from every rank)."""

from __future__ import annotations

import collections
import io

import torch

from .mpi_ops import allgather, broadcast_, broadcast_async_, rank, size, synchronize
from .process_sets import global_process_set

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle where it is missing
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - depends on the environment
    import pickle as _pickler

# The module names under which DistributedOptimizer's generated classes live: Horovod's, and ours.
_DISTRIBUTED_OPTIMIZER_MODULES = ("horovod.torch.optimizer", "c10d_ext.horovod.optimizer")


def _to_bytes_tensor(obj) -> torch.Tensor:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(array) -> object:
    return _pickler.load(io.BytesIO(array.tobytes()))


def broadcast_parameters(params, root_rank):
    """Broadcasts the tensors in ``params`` from ``root_rank`` to every other rank, in place.

    ``params`` is a dict of name -> tensor (``model.state_dict()``; the names are the
    collective names) or a list whose elements are tensors or (name, tensor) tuples
    (``list(model.named_parameters())``). Generators are refused: wrap them in ``list()``.
    """
    if isinstance(params, dict):
        named = sorted(params.items())
    elif isinstance(params, list):
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError('invalid params of type: %s' % type(params))

    handles = [broadcast_async_(tensor, root_rank, name) for name, tensor in named]
    for handle in handles:
        synchronize(handle)


def _initialize_empty_state(optimizer, sparse_param_ids) -> None:
    """Gives an optimizer without state its state: a step on zero gradients (sparse zeros
    where the step expects sparse ones). A DistributedOptimizer takes its wrapped class's step,
    which does not reduce, so no rank waits for peers that are not stepping."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            p.grad = p.data.new(p.size()).zero_()
            if isinstance(optimizer, torch.optim.SparseAdam) or (
                isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_param_ids
            ):
                p.grad = p.grad.to_sparse()
    if type(optimizer).__module__ in _DISTRIBUTED_OPTIMIZER_MODULES:
        super(type(optimizer), optimizer).step()
    else:
        optimizer.step()


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Broadcasts the optimizer's state (per-parameter tensors and values, and every option of
    every param group) from ``root_rank`` to every other rank, in place.

    ``model``, if given, names the parameters of sparse ``nn.Embedding`` modules, whose zero
    gradients must be sparse when an empty state is first initialised by a step.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError('cannot broadcast torch.optim.LBFGS state')

    state_dict = optimizer.state_dict()

    sparse_param_ids = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                sparse_param_ids.update(id(p) for p in module.parameters())

    if len(state_dict["state"]) == 0:
        _initialize_empty_state(optimizer, sparse_param_ids)
        state_dict = optimizer.state_dict()
    if len(state_dict["state"]) == 0:
        return  # a stateless optimizer (e.g. SGD without momentum): nothing to send

    tensors = []  # (collective name, tensor), broadcast in place
    values = {}  # key -> the root's value, sent in one broadcast_object
    setters = {}  # key -> how a received value goes back into the optimizer
    seen = collections.defaultdict(int)

    def set_option(index, key):
        def apply(value):
            optimizer.param_groups[index][key] = value
        return apply

    def set_state(pid, key):
        # The per-parameter dicts of state_dict() are the optimizer's own (torch shares them).
        def apply(value):
            state_dict["state"][pid][key] = value
        return apply

    for index, group in enumerate(state_dict["param_groups"]):
        for option, value in group.items():
            if option == "params":
                continue
            key = "%s.%d" % (option, index)
            values[key] = value
            setters[key] = set_option(index, option)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for name, value in state_dict["state"][pid].items():
                seen[name] += 1
                key = "%s.%d" % (str(name), seen[name])
                if torch.is_tensor(value):
                    tensors.append((key, value))
                else:
                    values[key] = value
                    setters[key] = set_state(pid, name)

    broadcast_parameters(tensors, root_rank)
    values = broadcast_object(values, root_rank)
    for key, value in values.items():
        setters[key](value)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Pickles ``obj`` on ``root_rank`` (a global rank) and returns it on every rank of
    ``process_set``: the root gets its own object back, the others an unpickled copy.

    Two broadcasts, named ``<name>.sz`` (the length) and ``<name>.t`` (the bytes); ``name``
    defaults to the object's type name.
    """
    if name is None:
        name = type(obj).__name__

    if rank() == root_rank:
        data = _to_bytes_tensor(obj)
        length = torch.tensor([data.numel()], dtype=torch.int32)
        broadcast_(length, root_rank, name + '.sz', process_set)
    else:
        length = torch.tensor([0], dtype=torch.int32)
        broadcast_(length, root_rank, name + '.sz', process_set)
        data = torch.empty(int(length.item()), dtype=torch.uint8)

    broadcast_(data, root_rank, name + '.t', process_set)

    if rank() == root_rank:
        return obj
    return _from_bytes(data.numpy())


def allgather_object(obj, name=None):
    """Pickles ``obj`` on every rank and returns the list of every rank's object, in rank
    order (the global process set). Two allgathers, named ``<name>.sz`` and ``<name>.t``;
    ``name`` defaults to the object's type name."""
    if name is None:
        name = type(obj).__name__

    data = _to_bytes_tensor(obj)
    length = torch.tensor([data.numel()], dtype=torch.int32)

    lengths = allgather(length, name=name + '.sz').numpy()
    gathered = allgather(data, name=name + '.t').numpy()

    objects = []
    start = 0
    for i in range(size()):
        end = start + int(lengths[i])
        objects.append(_from_bytes(gathered[start:end]))
        start = end
    return objects

