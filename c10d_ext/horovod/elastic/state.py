"""Elastic state (Horovod's ``horovod.common.elastic`` State/ObjectState and
``horovod.torch.elastic.state`` TorchState).

A state object holds what a training needs to go on after a reset: ``commit()`` saves a copy
in host memory, ``restore()`` goes back to the last commit after a failure, ``sync()`` makes
every rank take rank 0's committed state (after a reset, before training resumes).

Host-change notifications: Horovod's elastic driver pushes them to each worker's notification
service, which calls ``on_hosts_updated`` on the registered states. There is no such service
here; ``notification_manager.handle_hosts_updated(timestamp, update_res)`` (or a direct
``state.on_hosts_updated``) is how a caller feeds them, and ``commit()`` /
``check_host_updates()`` then act on them exactly as Horovod's do. The launcher's elastic mode
reaches the workers through the job's store instead: at a commit rank 0 admits new processes and
lets go of the ones whose host left (join.py), and every rank raises alike.
"""

from __future__ import annotations

import copy
import enum
import queue
import threading
import time

import torch

from ..basics import STATE
from ..exceptions import HostsUpdatedInterrupt
from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import rank
from .join import admit
from .sampler import ElasticSampler


class HostUpdateResult(enum.IntFlag):
    """What a host update did; flags of several updates are ORed."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class WorkerNotificationManager:
    """Keeps the states to notify of host updates (`run` registers its state for the duration
    of the call). `init()` has nothing to start: no driver sends notifications here."""

    def __init__(self):
        self._lock = threading.Lock()
        self._listeners = set()

    def init(self, *args, **kwargs):
        pass

    def register_listener(self, listener):
        with self._lock:
            self._listeners.add(listener)

    def remove_listener(self, listener):
        with self._lock:
            self._listeners.discard(listener)

    def handle_hosts_updated(self, timestamp, update_res):
        """Delivers a host update to every registered state (what Horovod's notification
        service does when the driver reports one)."""
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_hosts_updated(timestamp, update_res)


notification_manager = WorkerNotificationManager()


class State:
    """The base of elastic states.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 and returns it on every rank.
        get_rank: returns this worker's rank.
    """

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Adds functions (no arguments) to call after every reset, e.g. to rescale the
        learning rate to the new number of workers."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        self._host_messages.put((timestamp, update_res))

    def commit(self):
        """Saves the state, then checks for host updates (raises HostsUpdatedInterrupt if there
        are). A collective: every rank must commit at the same point."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank alike when rank 0 has seen a host update
        newer than the last one acted on; skip_sync is set when hosts were only removed."""
        prev_ts = newest_ts = self._last_updated_timestamp
        flags = HostUpdateResult.no_update
        while not self._host_messages.empty():
            ts, update = self._host_messages.get()
            if ts > newest_ts:
                newest_ts = ts
                flags |= update
        # Processes waiting to join, and members the launcher asked to leave (join.py), are admitted
        # or let go here, by rank 0: a host update too.
        join = admit() if self._rank() == 0 else None
        if join is not None:
            newest_ts = max(newest_ts, prev_ts + 1, time.time())
            members = join[1]
            if any(m.startswith("j") for m in members):
                flags |= HostUpdateResult.added
            if any(f"r{r}" not in members for r in range(STATE.size)):
                flags |= HostUpdateResult.removed
        # Rank 0 decides for everyone, so that every rank raises (or not) at the same commit.
        prev_ts, self._last_updated_timestamp, flags, join = self._bcast_object((prev_ts, newest_ts, flags, join))
        if join is not None:
            STATE.join = join  # the reset's init makes that world
        if self._last_updated_timestamp > prev_ts:
            raise HostsUpdatedInterrupt(flags == HostUpdateResult.removed)

    def save(self):
        """Saves the state to host memory."""
        raise NotImplementedError()

    def restore(self):
        """Goes back to the last committed state."""
        raise NotImplementedError()

    def sync(self):
        """Makes every rank's state rank 0's."""
        raise NotImplementedError()

    def reset(self):
        """Called after a reset, before the sync (nothing by default)."""
        pass


class ObjectState(State):
    """A state of plain Python objects, given as keyword arguments and exposed as attributes;
    they are also the first committed state."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._bcast_object = bcast_object
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        # rank 0's last *committed* values, not its current ones
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class StateHandler:
    """Saves, restores and syncs one kind of object of a TorchState."""

    def __init__(self, value):
        self.value = value

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def set_value(self, value):
        self.value = value
        self.save()


class _StateDictHandler(StateHandler):
    """For objects with state_dict()/load_state_dict(): the commit is a deep copy."""

    def __init__(self, value):
        super().__init__(value)
        self._saved = copy.deepcopy(self.value.state_dict())

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(_StateDictHandler):
    def sync(self):
        # loading resets the sampler: it re-reads size() and rank() and repartitions
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    return _handler_registry


def set_handler_registry(registry):
    global _handler_registry
    _handler_registry = registry


def _get_handler(value):
    for kind, handler_cls in _handler_registry:
        if isinstance(value, kind):
            return handler_cls(value)
    return None


def _split_handled(kwargs):
    handlers, plain = {}, {}
    for name, value in kwargs.items():
        handler = _get_handler(value)
        if handler is not None:
            handlers[name] = handler
        else:
            plain[name] = value
    return handlers, plain


class TorchState(ObjectState):
    """The state of a PyTorch training: models, optimizers and ElasticSamplers (and anything
    else the handler registry knows) are saved, restored and synced through their handlers;
    every other keyword argument is a plain attribute (ObjectState).

    Assigning a new object to a handled attribute (``state.model = other``) replaces the
    handler's object and commits it at once.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, plain = _split_handled(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def on_reset(self):
        # The world changed: samplers split what is left of the epoch among the ranks as they are
        # now, also when the sync is skipped (hosts only removed).
        for handler in self._handlers.values():
            if isinstance(handler, SamplerStateHandler):
                handler.value.reset()
        super().on_reset()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        if hasattr(self, name) and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)
