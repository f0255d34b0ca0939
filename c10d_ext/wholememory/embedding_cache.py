"""Embedding caches: WholeMemory's cache policies and the two caches they make.

Rows are grouped in sets of ``coverage`` consecutive rows (``round(32 / ratio)``, at most 16384);
each set has 32 lines, which hold the set's most used rows (least-frequently-used replacement on
the rows' access counts, a row already cached winning a tie). A policy whose communicator is the
embedding's makes a read-write cache, anything else a read-only one:

- read-only (a feature store): the cache communicator is a part of the embedding's (this rank
  alone, or the ranks of one host, sharing the cache in host memory). It holds hot rows of the
  whole table, so looking them up again reads local memory instead of asking the rows' owners.
  Its sets are split over the cache communicator's ranks; each rank refills only its own sets.
- read-write (a trainable table): each rank caches the hot rows of its own part. Lookups and
  optimizer steps for a cached row use the cached copy (states included), which is marked
  modified; ``writeback_all_cache`` writes modified rows to the table, ``drop_all_cache`` writes
  them back and empties the cache. Until then the table holds those rows' older values. A row has
  one writer (its owner), so copies of it elsewhere would be stale after each step: the cache
  sits at the owner, where WholeMemory puts it (GPU memory in front of a table in host memory).

Each cache counts, per rank: lookups served from the cache (hits) and from the table (misses),
rows loaded into it and rows written back to the table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import device as device_mod
from .embedding_exchange import Owners, rows_back, to_owners
from .tensor import WmTensorType, create_wm_tensor, fail, local_partition
from .access import gather as seed_gather

__all__ = ["WholeMemoryCachePolicy", "create_wholememory_cache_policy", "destroy_wholememory_cache_policy",
           "create_builtin_cache_policy"]

SET_SIZE = 32
MAX_COVERAGE = 1 << 14
MEMORY_TYPES = ("continuous", "chunked", "distributed", "hierarchy")
LOCATIONS = ("cuda", "cpu")
ACCESS = {"readonly": "readonly", "ro": "readonly", "readwrite": "readwrite", "rw": "readwrite"}


def group_of(comm):
    """The torch group behind a communicator (WholeMemoryCommunicator's wmb_comm, or a group)."""
    if comm is None:
        return dist.group.WORLD if dist.is_initialized() else None
    return getattr(comm, "wmb_comm", comm)


def check_memory(op: str, group, memory_type, memory_location, what: str = "") -> None:
    if memory_type not in MEMORY_TYPES:
        fail(op, group, f"WholeMemory type {memory_type!r}{what} not supported, should be "
             f"({', '.join(MEMORY_TYPES)})")
    if memory_location not in LOCATIONS:
        fail(op, group, f"WholeMemory location {memory_location!r}{what} not supported, should be "
             f"({', '.join(LOCATIONS)})")


def compute_device(op: str, group, memory_location: str) -> torch.device:
    """Where memory of a location goes in this process: "cuda" is its CUDA device (under the
    CUDA test double, whose CUDA tensors are CPU tensors, the CPU)."""
    if memory_location == "cpu":
        return torch.device("cpu")
    kind = device_mod.memory_kind()
    if kind == "double":
        return torch.device("cpu")
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    fail(op, group, "memory_location 'cuda' needs a CUDA device and this process has none; use 'cpu'")


class CachePolicy:
    """What a WholeMemory cache policy holds (the binding's object behind WholeMemoryCachePolicy)."""

    def __init__(self, cache_comm, memory_type: str, memory_location: str, access_type: str, ratio: float):
        self.cache_comm = cache_comm
        self.group = group_of(cache_comm)
        self.memory_type, self.memory_location = memory_type, memory_location
        self.access_type, self.ratio = access_type, ratio
        self.coverage = min(int(round(SET_SIZE / ratio)), MAX_COVERAGE)

    def destroy_policy(self) -> None:
        self.cache_comm = self.group = None


class WholeMemoryCachePolicy:
    """A cache policy for create_embedding; made by create_wholememory_cache_policy or
    create_builtin_cache_policy."""

    def __init__(self, wmb_cache_policy: CachePolicy):
        self.wmb_cache_policy = wmb_cache_policy


def create_wholememory_cache_policy(cache_comm, *, memory_type: str = "chunked", memory_location: str = "cuda",
                                    access_type: str = "readonly", ratio: float = 0.5):
    """A cache of ``ratio`` of an embedding's rows in ``memory_type`` / ``memory_location`` memory of
    ``cache_comm`` (the embedding's communicator: read-write at each row's owner; a part of it:
    read-only, shared by that part's ranks)."""
    op = "create_wholememory_cache_policy"
    group = group_of(cache_comm)
    if not isinstance(group, dist.ProcessGroup):
        fail(op, None, f"cache_comm must be a WholeMemoryCommunicator, got {type(cache_comm).__name__}", TypeError)
    check_memory(op, group, memory_type, memory_location)
    if access_type not in ACCESS:
        fail(op, group, f"WholeMemory access {access_type!r} not supported, should be (readonly, ro, readwrite, rw)")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1.0 / 512 <= ratio <= 1.0:
        fail(op, group, f"ratio should be in range [1/512, 1.0], got {ratio!r}")
    return WholeMemoryCachePolicy(CachePolicy(cache_comm, memory_type, memory_location, ACCESS[access_type],
                                              float(ratio)))


def destroy_wholememory_cache_policy(cache_policy: WholeMemoryCachePolicy) -> None:
    cache_policy.wmb_cache_policy.destroy_policy()
    cache_policy.wmb_cache_policy = None


def create_builtin_cache_policy(builtin_cache_type: str, embedding_memory_type: str, embedding_memory_location: str,
                                access_type: str, cache_ratio: float, *, cache_memory_type: str = "",
                                cache_memory_location: str = ""):
    """none (no cache: None), local_device (this rank's own), local_node (shared by a host's ranks)
    or all_devices (the global communicator: read-write at the owners)."""
    from . import wg_comm

    op = "create_builtin_cache_policy"
    group = group_of(None)
    check_memory(op, group, embedding_memory_type, embedding_memory_location, " (embedding)")
    if builtin_cache_type == "none":
        return None
    if cache_memory_location not in ("", "cpu", "cuda"):
        fail(op, group, f"cache_memory_location is {cache_memory_location!r}, should be empty or cpu, cuda")
    location = cache_memory_location or "cuda"
    if builtin_cache_type == "all_devices":
        return create_wholememory_cache_policy(wg_comm.get_global_communicator(),
                                               memory_type=cache_memory_type or embedding_memory_type,
                                               memory_location=location, access_type=access_type, ratio=cache_ratio)
    if builtin_cache_type == "local_node":
        return create_wholememory_cache_policy(wg_comm.get_local_node_communicator(),
                                               memory_type=cache_memory_type or "chunked",
                                               memory_location=location, access_type=access_type, ratio=cache_ratio)
    if builtin_cache_type == "local_device":
        return create_wholememory_cache_policy(wg_comm.get_local_device_communicator(), memory_type="continuous",
                                               memory_location=location, access_type=access_type, ratio=cache_ratio)
    fail(op, group, f"builtin_cache_type={builtin_cache_type!r} not supported, should be none, local_device, "
         "local_node or all_devices")


# ---- the sets: which rows the lines hold ----------------------------------------------------

def refresh(tags: torch.Tensor, counts: torch.Tensor, coverage: int, rows: int, sets: torch.Tensor):
    """Recomputes ``sets`` (local set numbers) from the access counts: each keeps its (up to) 32 most
    used rows that were used at all. ``tags`` [sets, 32] holds each line's row within its set, -1
    for an empty line; rows staying keep their line. Returns (evicted, loaded): each (set, line,
    row within the set) for the lines whose row leaves or arrives."""
    k = sets.numel()
    dev = tags.device
    empty = (torch.empty(0, dtype=torch.int64, device=dev),) * 3
    if not k:
        return empty, empty
    old = tags.index_select(0, sets)  # [k, 32]
    span = torch.arange(coverage, device=dev)
    rows_of = sets.unsqueeze(1) * coverage + span  # [k, cov] local rows
    c = counts.index_select(0, rows_of.clamp(max=counts.numel() - 1).view(-1)).view(k, coverage)
    c = torch.where(rows_of < rows, c, torch.zeros_like(c))
    cached = torch.zeros((k, coverage), dtype=torch.bool, device=dev)
    valid_old = old >= 0
    cached[torch.arange(k, device=dev).unsqueeze(1).expand_as(old)[valid_old], old[valid_old]] = True
    key = torch.where(c > 0, c * 2 + cached.long(), torch.zeros_like(c))
    top = min(SET_SIZE, coverage)
    val, lid = torch.topk(key, top, dim=1)
    new = torch.where(val > 0, lid, torch.full_like(lid, -1))  # [k, top]
    in_new = ((old.unsqueeze(2) == new.unsqueeze(1)) & valid_old.unsqueeze(2)).any(2)  # [k, 32]: line stays
    in_old = ((new.unsqueeze(2) == old.unsqueeze(1)) & (new >= 0).unsqueeze(2)).any(2)  # [k, top]
    incoming = (new >= 0) & ~in_old
    free = ~in_new
    evict = free & valid_old
    set_idx = torch.arange(k, device=dev).unsqueeze(1)
    # the j-th incoming row of a set takes the set's j-th free line
    free_rank = free.long().cumsum(1) - 1
    line_of_rank = torch.full((k, SET_SIZE), -1, dtype=torch.int64, device=dev)
    lines = torch.arange(SET_SIZE, device=dev).expand(k, SET_SIZE)
    line_of_rank[set_idx.expand(k, SET_SIZE)[free], free_rank[free]] = lines[free]
    inc_rank = incoming.long().cumsum(1) - 1
    inc_set = set_idx.expand(k, top)[incoming]
    inc_line = line_of_rank[inc_set, inc_rank[incoming]]
    ev_set = set_idx.expand(k, SET_SIZE)[evict]
    evicted = (sets[ev_set], lines[evict], old[evict])
    loaded = (sets[inc_set], inc_line, new[incoming])
    tags[evicted[0], evicted[1]] = -1
    tags[loaded[0], loaded[1]] = loaded[2]
    return evicted, loaded


def find(tag_rows: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
    """The line holding each row (``within`` its set, ``tag_rows`` its set's tags), -1 if none."""
    match = tag_rows == within.unsqueeze(1)
    hit = match.any(1)
    return torch.where(hit, match.int().argmax(1), torch.full_like(within, -1))


class Counters:
    def __init__(self):
        self.hits = self.misses = self.loaded = self.written_back = 0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "loaded": self.loaded, "written_back": self.written_back}


def _take(t: torch.Tensor, rows: torch.Tensor, device) -> torch.Tensor:
    return t.index_select(0, rows.to(t.device)).to(device)


def _put(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    t.index_copy_(0, rows.to(t.device), values.to(t.device, t.dtype))


class OwnerCache:
    """The read-write cache: this rank's hot rows of its own part, with the cachable optimizer
    states beside them in the same lines. ``raw(name)`` is this rank's part of the table
    ("embedding") or of a state, as a tensor of rows."""

    def __init__(self, policy: CachePolicy, owners: Owners, dim: int, dtype, raw, device):
        self.policy, self.owners, self.raw = policy, owners, raw
        self.coverage = policy.coverage
        self.rows = owners.count
        self.device = device
        sets = -(-self.rows // self.coverage)
        self.tags = torch.full((sets, SET_SIZE), -1, dtype=torch.int64, device=device)
        self.modified = torch.zeros((sets, SET_SIZE), dtype=torch.bool, device=device)
        self.counts = torch.zeros(sets * self.coverage, dtype=torch.int64, device=device)
        self.data = {"embedding": torch.zeros((sets * SET_SIZE, dim), dtype=dtype, device=device)}
        self.counters = Counters()

    def add_state(self, name: str, width: int) -> None:
        """A cachable optimizer state's rows beside the embedding's, loaded for the cached lines."""
        self.data[name] = torch.zeros((self.tags.shape[0] * SET_SIZE, width), dtype=torch.float32, device=self.device)
        s, line = (self.tags >= 0).nonzero(as_tuple=True)
        if s.numel():
            _put(self.data[name], s * SET_SIZE + line, _take(self.raw(name), s * self.coverage + self.tags[s, line],
                                                             self.device))

    def adjust(self, local: torch.Tensor) -> None:
        """Counts an access of each local row and refills the sets they fall in."""
        if not local.numel():
            return
        local = local.to(self.device)
        self.counts.index_add_(0, local, torch.ones_like(local))
        sets = torch.unique(torch.div(local, self.coverage, rounding_mode="floor"))
        (es, el, er), (ls, ll, lr) = refresh(self.tags, self.counts, self.coverage, self.rows, sets)
        dirty = self.modified[es, el]
        if dirty.any():
            self._write_lines(es[dirty], el[dirty], er[dirty])
        self.modified[es, el] = False
        for name, d in self.data.items():
            _put(d, ls * SET_SIZE + ll, _take(self.raw(name), ls * self.coverage + lr, self.device))
        self.counters.loaded += ls.numel()

    def _write_lines(self, s, line, within) -> None:
        for name, d in self.data.items():
            _put(self.raw(name), s * self.coverage + within, d.index_select(0, s * SET_SIZE + line))
        self.counters.written_back += s.numel()

    def lines(self, local: torch.Tensor):
        """(set, line) of each local row; line -1 where it is not cached."""
        local = local.to(self.device)
        s = torch.div(local, self.coverage, rounding_mode="floor")
        if not self.tags.shape[0]:
            return s, torch.full_like(local, -1)
        return s, find(self.tags.index_select(0, s), local - s * self.coverage)

    def read(self, name: str, local: torch.Tensor, count: bool = False) -> torch.Tensor:
        s, line = self.lines(local)
        hit = line >= 0
        out = _take(self.raw(name), local, self.device)
        if hit.any():
            out[hit] = self.data[name].index_select(0, s[hit] * SET_SIZE + line[hit]).to(out.dtype)
        if count:
            h = int(hit.sum())
            self.counters.hits += h
            self.counters.misses += local.numel() - h
        return out

    def write(self, name: str, local: torch.Tensor, values: torch.Tensor) -> None:
        """New values of distinct local rows: into their lines (then modified) or into the table."""
        s, line = self.lines(local)
        hit = line >= 0
        values = values.to(self.device)
        if hit.any():
            _put(self.data[name], s[hit] * SET_SIZE + line[hit], values[hit])
            self.modified[s[hit], line[hit]] = True
        if (~hit).any():
            _put(self.raw(name), local.to(self.device)[~hit], values[~hit])

    def gather(self, op: str, ids, error, adjust: bool) -> torch.Tensor:
        """Collective lookup: the ids go to their owners, which answer from their caches."""
        got, _, plan = to_owners(op, self.owners, ids, None, error, self.device)
        local = got - self.owners.start
        if adjust:
            self.adjust(local)
        return rows_back(self.owners, plan, self.read("embedding", local, count=True))

    def writeback(self) -> None:
        s, line = self.modified.nonzero(as_tuple=True)
        if s.numel():
            self._write_lines(s, line, self.tags[s, line])
        self.modified.zero_()

    def drop(self, writeback: bool = True) -> None:
        if writeback:
            self.writeback()
        self.modified.zero_()
        self.tags.fill_(-1)


class LocalCache:
    """The read-only cache: hot rows of the whole table in memory of the cache communicator (this
    rank's, or its host's shared by the host's ranks). ``raw_gather(ids)`` reads rows from the
    table (collective over the embedding's group: every rank calls it once per lookup)."""

    def __init__(self, op: str, policy: CachePolicy, rows: int, dim: int, dtype, raw_gather):
        self.policy, self.raw_gather = policy, raw_gather
        self.coverage = cov = policy.coverage
        group = self.group = policy.group
        cw = group.size()
        sets = -(-rows // cov)
        sets = -(-sets // cw) * cw  # an equal share of sets per cache rank
        kind = WmTensorType.HOST if policy.memory_type == "continuous" else WmTensorType.CHUNKED
        place = "cpu" if policy.memory_location == "cpu" else None
        if place is None:
            compute_device(op, group, "cuda")
        self.tags = create_wm_tensor(group, [sets, SET_SIZE], [], torch.int64, kind, device=place)
        self.counts = create_wm_tensor(group, [sets * cov], [], torch.int64, kind, device=place)
        self.data = create_wm_tensor(group, [sets * SET_SIZE, dim], [], dtype, kind, device=place)
        self.my_tags, first_set = local_partition(self.tags)
        self.my_counts, _ = local_partition(self.counts)
        self.my_data, _ = local_partition(self.data)
        self.my_tags.fill_(-1)
        self.my_counts.zero_()
        self.first_set = first_set
        self.device = self.my_tags.device
        self.owners = Owners(group, first_set * cov, self.my_tags.shape[0] * cov) if cw > 1 else None
        self.rows = self.my_tags.shape[0] * cov
        self.counters = Counters()
        self._barrier()

    def _barrier(self) -> None:
        if self.group.size() > 1:
            dist.barrier(group=self.group)

    def adjust(self, ids: torch.Tensor) -> None:
        """Counts the accesses at the cache ranks whose sets they fall in, which refill those sets
        (the new rows read from the table, collectively)."""
        if self.owners is not None:
            ids, _, _ = to_owners("gather", self.owners, ids.to(self.device), None, None, self.device)
        local = ids.to(self.device) - self.first_set * self.coverage
        loaded = (torch.empty(0, dtype=torch.int64, device=self.device),) * 3
        if local.numel():
            self.my_counts.index_add_(0, local, torch.ones_like(local))
            sets = torch.unique(torch.div(local, self.coverage, rounding_mode="floor"))
            _, loaded = refresh(self.my_tags, self.my_counts, self.coverage, self.rows, sets)
        ls, ll, lr = loaded
        rows = self.raw_gather((self.first_set + ls) * self.coverage + lr)  # every rank calls
        if ls.numel():
            _put(self.my_data, ls * SET_SIZE + ll, rows)
        self.counters.loaded += ls.numel()
        self._barrier()  # the sets are ready before anyone reads them

    def gather(self, ids: torch.Tensor, adjust: bool, out_device) -> torch.Tensor:
        if adjust:
            self.adjust(ids)
        cid = ids.to(self.device)
        s = torch.div(cid, self.coverage, rounding_mode="floor")
        line = find(seed_gather(self.tags, s), cid - s * self.coverage) if cid.numel() else cid
        hit = line >= 0
        h = int(hit.sum())
        miss_rows = self.raw_gather(ids[~hit.to(ids.device)])  # every rank calls
        out = torch.empty((ids.numel(),) + tuple(miss_rows.shape[1:]), dtype=miss_rows.dtype, device=out_device)
        if h:
            out[hit.to(out_device)] = seed_gather(self.data, s[hit] * SET_SIZE + line[hit]).to(out_device)
        if h < ids.numel():
            out[~hit.to(out_device)] = miss_rows.to(out_device)
        self.counters.hits += h
        self.counters.misses += ids.numel() - h
        return out

    def writeback(self) -> None:
        """Nothing to write: the rows were only read."""

    def drop(self, writeback: bool = True) -> None:
        self._barrier()  # the cache ranks' lookups so far are done reading these sets
        self.my_tags.fill_(-1)

