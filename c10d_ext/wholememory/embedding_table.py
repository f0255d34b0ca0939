"""What stands behind a WholeMemoryEmbedding (WholeMemory's C++ embedding object): the table and
the optimizer states as whole-memory tensors with one partition, the cache, lookups, and the
application of gradients at the rows' owners.

A gradient step: every rank's (row, gradient) pairs go to the rank holding the row (one
all-to-all), which sums the gradients of each distinct row (rows repeated within and across
ranks) and applies one optimizer step per row to its own part of the table and of every state.
A host-memory table spanning hosts has a copy per host: every copy's owner of a row gets all of
the row's gradients, in the same order, and makes the same update.
"""

from __future__ import annotations

import numbers
import os
import warnings

import torch
import torch.distributed as dist

from . import access, embedding_optimizer as rules
from .embedding_cache import LocalCache, OwnerCache, check_memory, compute_device, group_of, put_rows, take_rows
from .embedding_exchange import Owners, check_ids, to_owners
from .wg_tensor import create_wholememory_tensor
from .tensor import agree_on_error, fail

_ORDER = {"continuous": 0, "chunked": 1, "distributed": 2, "hierarchy": 3}
_DTYPES = (torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.int16,
           torch.int8)
_OTHERS = "rank {rank} passed bad input (its error says what)"


def new_tensor(comm, memory_type: str, memory_location: str, sizes, dtype, partition):
    """A WholeMemoryTensor (zero-filled) on ``comm`` with ``partition``'s rows per rank (None: equal)."""
    return create_wholememory_tensor(comm, memory_type, memory_location, list(sizes), dtype, None,
                                     tensor_entry_partition=partition)


def barrier(comm, group) -> None:
    """Waits until every rank of the embedding's group got here (its memory writes visible)."""
    if not isinstance(comm, dist.ProcessGroup) and hasattr(comm, "barrier"):
        comm.barrier()
    elif group.size() > 1:
        dist.barrier(group=group)


def round_robin_rows(rows: int, world: int, rr: int) -> int:
    """Rows per rank when blocks of ``rr`` rows are dealt to the ranks in turn (WholeMemory's
    round-robin sharding): the table grows to that times the ranks."""
    per = rows // (world * rr) * rr + min(rows % (world * rr), rr)
    return per


def check_create(op: str, group, memory_type, memory_location, dtype, sizes, cache_policy, partition,
                 round_robin_size, gather_sms):
    """The checks of create_embedding's arguments that every rank makes alike. Returns the
    (possibly adjusted) partition and round_robin_size."""
    check_memory(op, group, memory_type, memory_location)
    if dtype not in _DTYPES:
        fail(op, group, f"dtype {dtype!r} is not supported (one of {', '.join(str(d) for d in _DTYPES)})", TypeError)
    if isinstance(sizes, int) or not hasattr(sizes, "__len__") or len(sizes) != 2:
        fail(op, group, f"sizes must be 2-D [rows, embedding_dim], got {sizes!r}")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in sizes):
        fail(op, group, f"sizes must be two counts > 0, got {list(sizes)!r}")
    if isinstance(gather_sms, bool) or not isinstance(gather_sms, int):
        fail(op, group, f"gather_sms must be an int, got {gather_sms!r}", TypeError)
    if isinstance(round_robin_size, bool) or not isinstance(round_robin_size, int) or round_robin_size < 0:
        fail(op, group, f"round_robin_size must be an int >= 0, got {round_robin_size!r}")
    if partition is not None and cache_policy is not None:
        warnings.warn("embedding_entry_partition is ignored because cache_policy is specified", stacklevel=3)
        partition = None
    if partition is not None and round_robin_size != 0:
        warnings.warn("round_robin_size is ignored because embedding_entry_partition is specified", stacklevel=3)
        round_robin_size = 0
    if partition is not None:
        n = group.size()
        if (not hasattr(partition, "__len__") or len(partition) != n
                or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in partition)
                or sum(partition) != sizes[0]):
            fail(op, group, f"embedding_entry_partition must be {n} counts >= 0 (one per rank) adding up to the "
                 f"{sizes[0]} rows, got {partition!r}")
        partition = [int(p) for p in partition]
    if memory_type == "hierarchy" and cache_policy is not None:
        fail(op, group, "hierarchy embedding is not supported with a cache")
    if cache_policy is not None:
        p = getattr(cache_policy, "wmb_cache_policy", None)
        if p is None:
            fail(op, group, f"cache_policy must be a WholeMemoryCachePolicy (not destroyed), got {cache_policy!r}",
                 TypeError)
        if p.group is group:
            if _ORDER[p.memory_type] < _ORDER[memory_type]:
                fail(op, group, f"a cache on the embedding's communicator covers the rows of its memory: cache "
                     f"memory_type {p.memory_type!r} cannot cache {memory_type!r} memory")
        else:
            if p.memory_type not in ("continuous", "chunked"):
                fail(op, group, f"a cache on another communicator (read-only, local) has memory_type continuous or "
                     f"chunked, got {p.memory_type!r}")
            if p.access_type != "readonly":
                fail(op, group, "only the readonly access type is supported for a cache on another communicator "
                     "than the embedding's (a local copy of rows other ranks own)")
            if p.group.size() > group.size():
                fail(op, group, f"the cache communicator ({p.group.size()} ranks) is larger than the embedding's "
                     f"({group.size()})")
    return partition, round_robin_size


class EmbeddingImpl:
    """The embedding object; collective at creation (over ``comm``)."""

    def __init__(self, op, comm, group, memory_type, memory_location, dtype, sizes, cache_policy, partition, rr):
        self.comm, self.group = comm, group
        self.memory_type, self.memory_location, self.dtype = memory_type, memory_location, dtype
        self.logical_rows, self.dim = int(sizes[0]), int(sizes[1])
        sizes = [self.logical_rows, self.dim]
        self.rr = rr
        rows = self.logical_rows
        if rr:
            self.rr_per = round_robin_rows(rows, group.size(), rr)
            rows = self.rr_per * group.size()
        self.rows = rows
        self.partition = partition
        self.table = new_tensor(comm, memory_type, memory_location, [rows, self.dim], dtype, partition)
        local, start = self.table.get_local_tensor()
        self.owners = Owners(group, start, local.shape[0])
        self.device = local.device
        self.policy = cache_policy.wmb_cache_policy if cache_policy is not None else None
        self.cache = None
        self.rule, self.kind, self.params, self.states = None, None, None, {}
        if self.policy is not None:
            self._make_cache(op)
        barrier(comm, group)

    # ---- the parts --------------------------------------------------------------------------

    def local(self, name: str = "embedding") -> torch.Tensor:
        t = self.table if name == "embedding" else self.states[name]
        return t.get_local_tensor()[0]

    def _make_cache(self, op) -> None:
        p = self.policy
        error = None
        try:
            if p.group is self.group:
                if not self.owners.ordered:
                    fail(op, self.group, "a read-write cache needs one owner per row; a continuous (host) table "
                         "across hosts has one per host: use chunked or distributed memory")
            device = compute_device(op, self.group, p.memory_location)
        except (ValueError, NotImplementedError) as e:
            error = e
        agree_on_error(op, self.group, error, "rank {rank} cannot make the cache (its error says why)")
        if p.group is self.group:
            self.cache = OwnerCache(p, self.owners, self.dim, self.dtype, self.local, device)
            self.device = device
        else:
            read, collective = self.raw_gather, self.memory_type == "distributed" and self.group.size() > 1
            seed = self.table.wmb_tensor
            if collective and p.group.size() == 1 and access.mapped_here(seed):
                # every part mapped here: this rank's own cache reads its misses alone, in place
                read, collective = (lambda ids: access.gather_in_place(seed, ids)), False
            self.cache = LocalCache(p, self.rows, self.dim, self.dtype, read, self.group, collective)

    @property
    def collective(self) -> bool:
        """Whether a lookup is collective over the embedding's group."""
        return self.cache is not None or self.memory_type in ("distributed", "hierarchy")

    def storage_to_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Round-robin sharding: storage row -> table row (blocks of rr rows dealt to the ranks)."""
        if not self.rr:
            return ids
        world = self.group.size()
        block = torch.div(ids, self.rr, rounding_mode="floor")
        return (block % world) * self.rr_per + torch.div(block, world, rounding_mode="floor") * self.rr + ids % self.rr

    def raw_gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.gather(ids)

    # ---- lookups ----------------------------------------------------------------------------

    def lookup(self, op: str, indice, adjust: bool) -> torch.Tensor:
        if self.cache is None and not self.rr:
            return self.table.gather(indice)  # checks (on every rank where collective) and reads
        bound = self.logical_rows if self.rr else self.rows
        if isinstance(self.cache, OwnerCache):
            error, ids = None, None
            try:
                ids = self.storage_to_rows(check_ids(op, self.group, indice, bound, self.device, False))
            except (TypeError, ValueError, IndexError) as e:
                error = e
            return self.cache.gather(op, ids, error, adjust)
        if isinstance(self.cache, LocalCache) and not self.cache.shared:
            # this rank's own cache: the ids are checked here, and bad ones fail in the cache's
            # first agreement on every rank where the table's lookup is collective
            error, ids = None, None
            try:
                ids = self.storage_to_rows(check_ids(op, self.group, indice, bound, self.device, False))
            except (TypeError, ValueError, IndexError) as e:
                error = e
            return self.cache.gather(ids, adjust, self.device, error)
        ids = self.storage_to_rows(check_ids(op, self.group, indice, bound, self.device, self.collective))
        if isinstance(self.cache, LocalCache):
            return self.cache.gather(ids, adjust, self.device)
        return self.raw_gather(ids)

    # ---- training -----------------------------------------------------------------------------

    def set_optimizer(self, op: str, kind: str, rule, params: dict) -> None:
        error = None
        try:
            if self.rule is not None:
                fail(op, self.group, "optimizer can only be set once.")
            if self.dtype != torch.float32:
                fail(op, self.group, f"only float32 embeddings support training, this one is {self.dtype}")
            if isinstance(self.cache, LocalCache):
                fail(op, self.group, "an optimizer is not supported for an embedding with a read-only cache on "
                     "another communicator (use a readwrite cache on the embedding's communicator)")
            if isinstance(self.cache, OwnerCache) and self.policy.access_type != "readwrite":
                fail(op, self.group, "a trainable embedding's cache needs access_type readwrite, this one is readonly")
        except (ValueError, TypeError) as e:
            error = e
        agree_on_error(op, self.group, error, "rank {rank} cannot set this optimizer (its error says why)")
        self.rule, self.kind, self.params = rule, kind, params
        for name, width, init, cachable in rule.states:
            w = self.dim if width == "dim" else width
            t = new_tensor(self.comm, self.memory_type, self.memory_location, [self.rows, w], torch.float32,
                           self.partition)
            t.get_local_tensor()[0].fill_(init)
            self.states[name] = t
            if cachable and isinstance(self.cache, OwnerCache):
                self.cache.add_state(name, w)
        barrier(self.comm, self.group)

    def apply_gradients(self, op: str, indices: list, grads: list, lr: float) -> None:
        """Collective: every rank's gradients to the rows' owners, summed per row, one step each."""
        error, ids, g = None, None, None
        try:
            if self.rule is None:
                fail(op, self.group, "this embedding has no optimizer (create_wholememory_optimizer first)")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)):
                fail(op, self.group, f"lr must be a number, got {lr!r}", TypeError)
            bound = self.logical_rows if self.rr else self.rows
            ids = torch.cat([i.to(self.device, torch.int64) for i in indices]) if indices else \
                torch.empty(0, dtype=torch.int64, device=self.device)
            ids = self.storage_to_rows(check_ids(op, self.group, ids, bound, self.device, False))
            g = torch.cat([x.to(self.device, torch.float32) for x in grads]) if grads else \
                torch.empty((0, self.dim), dtype=torch.float32, device=self.device)
            if tuple(g.shape) != (ids.numel(), self.dim):
                fail(op, self.group, f"gradients have shape {list(g.shape)}, expected {[ids.numel(), self.dim]}")
        except (TypeError, ValueError, IndexError) as e:
            error = e
        got_ids, got_g, _ = to_owners(op, self.owners, ids, g, error, self.device, self.dim)
        local = got_ids - self.owners.start
        rows, inverse = torch.unique(local, return_inverse=True)
        summed = torch.zeros((rows.numel(), self.dim), dtype=torch.float32, device=self.device)
        summed.index_add_(0, inverse, got_g)
        self.step(rows, summed, float(lr))

    def step(self, rows: torch.Tensor, g: torch.Tensor, lr: float, adjust: bool = True) -> None:
        """One optimizer step of distinct local rows with summed gradients g."""
        if not rows.numel():
            return
        cache = self.cache if isinstance(self.cache, OwnerCache) else None
        if cache is not None and adjust:
            cache.adjust(rows)
        cachable = {s[0] for s in self.rule.states if s[3]}

        def read(name):
            if cache is not None and (name == "embedding" or name in cachable):
                return cache.read(name, rows)
            return take_rows(self.local(name), rows)

        def write(name, values):
            if cache is not None and (name == "embedding" or name in cachable):
                cache.write(name, rows, values)
            else:
                put_rows(self.local(name), rows, values)

        w = read("embedding")
        states = {name: read(name) for name in self.rule.state_names}
        new_w, new_states = rules.update(self.kind, self.params, w, g.to(w.device), states, lr)
        write("embedding", new_w)
        for name, values in new_states.items():
            write(name, values)

    # ---- caches and files ---------------------------------------------------------------------

    def writeback(self) -> None:
        """Collective. The first barrier: every rank's earlier direct reads of a mapped table are
        done before rows are written under them."""
        if self.cache is not None:
            barrier(self.comm, self.group)
            self.cache.writeback()
            barrier(self.comm, self.group)

    def drop(self, writeback: bool = True) -> None:
        if self.cache is not None:
            barrier(self.comm, self.group)
            self.cache.drop(writeback)
            barrier(self.comm, self.group)

    def load_files(self, filelist: list) -> None:
        """Fills the table from the concatenated files, each rank reading the rows it holds (with
        round-robin sharding, the storage rows dealt to it). Collective."""
        self.table.from_filelist(filelist, self.rr)

    def destroy(self) -> None:
        self.cache = None
        self.states = {}
        self.table = None


def file_sizes(op: str, group, filelist, dtype, last_dim_size: int):
    """(files, sizes, rows) of a file list, each file checked (it exists, is readable, holds whole rows)."""
    files = [filelist] if isinstance(filelist, str) else list(filelist)
    if not files or not all(isinstance(f, str) for f in files):
        fail(op, group, f"filelist must be a file name or a list of them, got {filelist!r}", TypeError)
    if isinstance(last_dim_size, bool) or not isinstance(last_dim_size, int) or last_dim_size <= 0:
        fail(op, group, f"last_dim_size must be a count > 0, got {last_dim_size!r}")
    entry = torch.tensor([], dtype=dtype).element_size() * last_dim_size
    sizes = []
    for f in files:
        if not os.path.isfile(f):
            fail(op, group, f"File {f} not found or not file")
        if not os.access(f, os.R_OK):
            fail(op, group, f"File {f} not readable")
        size = os.path.getsize(f)
        if size % entry:
            fail(op, group, f"File {f} size is {size} not multiple of {entry}")
        sizes.append(size)
    return files, sizes, sum(sizes) // entry


def resolve_group(op: str, comm):
    group = group_of(comm)
    if not isinstance(group, dist.ProcessGroup):
        fail(op, None, f"comm must be a WholeMemoryCommunicator, got {type(comm).__name__} {comm!r}", TypeError)
    return group

