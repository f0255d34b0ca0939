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

from .. import _C
from . import device as device_mod
from .embedding_exchange import Owners, rows_back, to_owners
from .tensor import WmTensorType, create_wm_tensor, fail, local_partition
from .access import BAD_PEER, gather as seed_gather, result_rows

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

def refresh(tags: torch.Tensor, counts: torch.Tensor, slot_of: torch.Tensor, coverage: int, rows: int,
            sets: torch.Tensor, line_base: int = 0):
    """Recomputes ``sets`` (local set numbers) from the access counts: each keeps its (up to) 32 most
    used rows that were used at all, a row already cached winning a tie; rows staying keep their
    line. ``tags`` [sets, 32] holds each line's row within its set (-1: empty); ``slot_of`` each
    local row's line (``line_base`` + set * 32 + line, -1: not cached). Both are updated. Returns
    (evicted, loaded), each (line index, local row), for the lines whose row leaves or arrives."""
    k = sets.numel()
    dev = tags.device
    if not k:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return (empty, empty), (empty, empty)
    old = tags.index_select(0, sets)  # [k, 32]
    valid_old = old >= 0
    old_at = old.clamp(min=0)
    set_idx = torch.arange(k, device=dev).unsqueeze(1)
    key = counts.view(-1, coverage).index_select(0, sets).mul_(2)  # [k, cov]: twice the counts, + 1 if cached
    if int(sets[-1]) * coverage + coverage > rows:  # (sets are sorted) the last set runs past the rows
        key[-1, rows - int(sets[-1]) * coverage:] = 0
    key.index_put_((set_idx.expand(k, SET_SIZE)[valid_old], old[valid_old]),
                   torch.ones((), dtype=key.dtype, device=dev), accumulate=True)
    top = min(SET_SIZE, coverage)
    val, lid = torch.topk(key, top, dim=1)
    chosen_ok = val > 0  # (a cached row was counted, so every chosen row was used)
    chosen = torch.zeros((k, coverage), dtype=torch.bool, device=dev)
    chosen.scatter_(1, lid, chosen_ok)
    stays = chosen.gather(1, old_at) & valid_old  # [k, 32]: the line keeps its row
    incoming = chosen_ok & (val % 2 == 0)  # [k, top]: rows to load (an odd key: cached already)
    free = ~stays
    evict = free & valid_old
    lines = torch.arange(SET_SIZE, device=dev).expand(k, SET_SIZE)
    # the j-th incoming row of a set takes the set's j-th free line
    free_rank = free.long().cumsum(1) - 1
    line_of_rank = torch.full((k, SET_SIZE), -1, dtype=torch.int64, device=dev)
    line_of_rank[set_idx.expand(k, SET_SIZE)[free], free_rank[free]] = lines[free]
    inc_set = set_idx.expand(k, top)[incoming]
    inc_line = line_of_rank[inc_set, (incoming.long().cumsum(1) - 1)[incoming]]
    ev_set = set_idx.expand(k, SET_SIZE)[evict]
    ev_line = lines[evict]
    ev_row = sets[ev_set] * coverage + old[evict]
    in_set = sets[inc_set]
    in_row = in_set * coverage + lid[incoming]
    tags[sets[ev_set], ev_line] = -1
    tags[in_set, inc_line] = lid[incoming]
    slot_of[ev_row] = -1
    in_index = line_base + in_set * SET_SIZE + inc_line
    slot_of[in_row] = in_index
    return (line_base + sets[ev_set] * SET_SIZE + ev_line, ev_row), (in_index, in_row)


class Counters:
    def __init__(self):
        self.hits = self.misses = self.loaded = self.written_back = 0

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "loaded": self.loaded, "written_back": self.written_back}


def _kernel_ok(t: torch.Tensor, other: torch.Tensor | None = None) -> bool:
    """Whether rows of ``t`` move through the C++ row kernels (host memory, packed rows)."""
    return (t.device.type == "cpu" and t.dim() == 2 and t.is_contiguous() and t.shape[0] > 0
            and (other is None or (other.device.type == "cpu" and other.dtype == t.dtype)))


def take_rows(t: torch.Tensor, rows: torch.Tensor, device=None) -> torch.Tensor:
    """t[rows] (a new tensor, on ``device`` if given)."""
    if _kernel_ok(t) and rows.numel():
        out = torch.empty((rows.numel(), t.shape[1]), dtype=t.dtype)
        _C._wm_gather_rows([t.view(-1)], t.shape[0], t.shape[0], t.shape[1], rows.to("cpu", torch.int64).contiguous(),
                           out)
    else:
        out = t.index_select(0, rows.to(t.device))
    return out if device is None else out.to(device)


def put_rows(t: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """t[rows] = values, for distinct rows."""
    if _kernel_ok(t, values) and rows.numel():
        _C._wm_scatter_rows([t.view(-1)], t.shape[0], t.shape[0], t.shape[1], rows.to("cpu", torch.int64).contiguous(),
                            values.contiguous())
    else:
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
        self.slot_of = torch.full((sets * self.coverage,), -1, dtype=torch.int64, device=device)
        self.modified = torch.zeros(sets * SET_SIZE, dtype=torch.bool, device=device)
        self.counts = torch.zeros(sets * self.coverage, dtype=torch.int64, device=device)
        self.data = {"embedding": torch.zeros((sets * SET_SIZE, dim), dtype=dtype, device=device)}
        self.counters = Counters()

    def add_state(self, name: str, width: int) -> None:
        """A cachable optimizer state's rows beside the embedding's, loaded for the cached lines."""
        self.data[name] = torch.zeros((self.tags.shape[0] * SET_SIZE, width), dtype=torch.float32, device=self.device)
        rows = (self.slot_of >= 0).nonzero().view(-1)
        if rows.numel():
            put_rows(self.data[name], self.slot_of[rows], take_rows(self.raw(name), rows, self.device))

    def adjust(self, local: torch.Tensor) -> None:
        """Counts an access of each local row and refills the sets they fall in."""
        if not local.numel():
            return
        local = local.to(self.device)
        self.counts.index_add_(0, local, torch.ones_like(local))
        sets = torch.unique(torch.div(local, self.coverage, rounding_mode="floor"))
        (e_line, e_row), (l_line, l_row) = refresh(self.tags, self.counts, self.slot_of, self.coverage, self.rows, sets)
        dirty = self.modified[e_line]
        if dirty.any():
            self._write_lines(e_line[dirty], e_row[dirty])
        self.modified[e_line] = False
        for name, d in self.data.items():
            put_rows(d, l_line, take_rows(self.raw(name), l_row, self.device))
        self.counters.loaded += l_line.numel()

    def _write_lines(self, line: torch.Tensor, row: torch.Tensor) -> None:
        for name, d in self.data.items():
            put_rows(self.raw(name), row, take_rows(d, line))
        self.counters.written_back += line.numel()

    def lines(self, local: torch.Tensor) -> torch.Tensor:
        """The line of each local row, -1 where it is not cached."""
        return self.slot_of.index_select(0, local.to(self.device))

    def read(self, name: str, local: torch.Tensor, count: bool = False) -> torch.Tensor:
        line = self.lines(local)
        hit = line >= 0
        h = int(hit.sum())
        if h == line.numel():
            out = take_rows(self.data[name], line)
        else:
            out = take_rows(self.raw(name), local, self.device)
            if h:
                at = hit.nonzero().view(-1)
                out.index_copy_(0, at, take_rows(self.data[name], line[at]).to(out.dtype))
        if count:
            self.counters.hits += h
            self.counters.misses += local.numel() - h
        return out

    def write(self, name: str, local: torch.Tensor, values: torch.Tensor) -> None:
        """New values of distinct local rows: into their lines (then modified) or into the table."""
        line = self.lines(local)
        hit = line >= 0
        values = values.to(self.device)
        if hit.any():
            put_rows(self.data[name], line[hit], values[hit])
            self.modified[line[hit]] = True
        if not hit.all():
            put_rows(self.raw(name), local.to(self.device)[~hit], values[~hit])

    def gather(self, op: str, ids, error, adjust: bool) -> torch.Tensor:
        """Collective lookup: the ids go to their owners, which answer from their caches."""
        got, _, plan = to_owners(op, self.owners, ids, None, error, self.device)
        local = got - self.owners.start
        if adjust:
            self.adjust(local)
        return rows_back(self.owners, plan, self.read("embedding", local, count=True))

    def writeback(self) -> None:
        line = self.modified.nonzero().view(-1)
        if line.numel():
            s = torch.div(line, SET_SIZE, rounding_mode="floor")
            self._write_lines(line, s * self.coverage + self.tags.view(-1)[line])
        self.modified.zero_()

    def drop(self, writeback: bool = True) -> None:
        if writeback:
            self.writeback()
        self.modified.zero_()
        self.tags.fill_(-1)
        self.slot_of.fill_(-1)


class LocalCache:
    """The read-only cache: hot rows of the whole table in memory of the cache communicator (this
    rank's, or its host's shared by the host's ranks). ``raw_gather(ids)`` reads rows from the
    table; ``collective``: it is collective over the embedding's group ``table_group`` (every rank
    calls it, with its own ids). Where it is, the ranks first agree in one small all-reduce
    whether any of them has rows to read from the table (or bad input): a lookup every rank's
    cache answers reads nothing from the table and exchanges nothing else."""

    def __init__(self, policy: CachePolicy, rows: int, dim: int, dtype, raw_gather, table_group=None,
                 collective: bool = False):
        self.policy, self.raw_gather = policy, raw_gather
        self.table_group, self.collective = table_group, collective
        self.coverage = cov = policy.coverage
        group = self.group = policy.group
        cw = group.size()
        sets = -(-rows // cov)
        sets = -(-sets // cw) * cw  # an equal share of sets per cache rank
        kind = WmTensorType.HOST if policy.memory_type == "continuous" else WmTensorType.CHUNKED
        place = "cpu" if policy.memory_location == "cpu" else None  # (cuda: the current device, checked)
        self.tags = create_wm_tensor(group, [sets, SET_SIZE], [], torch.int64, kind, device=place)
        self.slot_of = create_wm_tensor(group, [sets * cov], [], torch.int64, kind, device=place)
        self.counts = create_wm_tensor(group, [sets * cov], [], torch.int64, kind, device=place)
        self.data = create_wm_tensor(group, [sets * SET_SIZE, dim], [], dtype, kind, device=place)
        self.my_tags, first_set = local_partition(self.tags)
        self.my_slots, _ = local_partition(self.slot_of)
        self.my_counts, _ = local_partition(self.counts)
        self.my_data, _ = local_partition(self.data)
        self.my_tags.fill_(-1)
        self.my_slots.fill_(-1)
        self.my_counts.zero_()
        self.first_set = first_set
        self.device = self.my_tags.device
        self.owners = Owners(group, first_set * cov, self.my_tags.shape[0] * cov) if cw > 1 else None
        self.rows = self.my_tags.shape[0] * cov
        self.counters = Counters()
        self._barrier()

    @property
    def shared(self) -> bool:
        """Whether ranks other than this one use the cache (their lookups are collective over it)."""
        return self.owners is not None

    def _barrier(self) -> None:
        if self.group.size() > 1:
            dist.barrier(group=self.group)

    def fetch(self, ids: torch.Tensor | None, error: BaseException | None = None) -> torch.Tensor | None:
        """The table's rows ``ids`` (None when nothing was read). Every rank calls it where the
        table's lookup is collective; a rank with ``error`` set takes part and raises it, the
        others raise naming it."""
        if self.collective:
            g = self.table_group
            flags = torch.zeros(g.size(), dtype=torch.int32)
            flags[g.rank()] = 2 if error is not None else int(ids.numel() > 0)
            dist.all_reduce(flags, group=g)
            if error is not None:
                raise error
            bad = (flags == 2).nonzero()
            if bad.numel():
                fail("gather", g, BAD_PEER.format(rank=int(bad[0])))
            if not bool(flags.any()):
                return None  # no rank reads: nobody calls the table's collective lookup
        elif error is not None:
            raise error
        elif not ids.numel():
            return None
        return self.raw_gather(ids)

    def adjust(self, ids: torch.Tensor) -> None:
        """Counts the accesses at the cache ranks whose sets they fall in, which refill those sets
        (the new rows read from the table, collectively)."""
        if self.owners is not None:
            ids, _, _ = to_owners("gather", self.owners, ids.to(self.device), None, None, self.device)
        local = ids.to(self.device) - self.first_set * self.coverage
        line = row = torch.empty(0, dtype=torch.int64, device=self.device)
        if local.numel():
            self.my_counts.index_add_(0, local, torch.ones_like(local))
            sets = torch.unique(torch.div(local, self.coverage, rounding_mode="floor"))
            _, (line, row) = refresh(self.my_tags, self.my_counts, self.my_slots, self.coverage, self.rows, sets,
                                     self.first_set * SET_SIZE)
        rows = self.fetch(row + self.first_set * self.coverage)
        if rows is not None and line.numel():
            put_rows(self.my_data, line - self.first_set * SET_SIZE, rows)
        self.counters.loaded += line.numel()
        if self.owners is not None:
            self._barrier()  # the sets are ready before anyone reads them

    def _lines(self, ids: torch.Tensor) -> torch.Tensor:
        """The line of each row, -1 where it is not cached."""
        ids = ids.to(self.device)
        if self.owners is None:  # this rank's own cache: all of it is here
            return self.my_slots.index_select(0, ids)
        return seed_gather(self.slot_of, ids)

    def _cached_rows(self, line: torch.Tensor) -> torch.Tensor:
        if self.owners is None:
            out = result_rows(line.numel(), tuple(self.my_data.shape[1:]), self.my_data.dtype, self.device)
            return torch.index_select(self.my_data, 0, line, out=out)
        return seed_gather(self.data, line)

    def gather(self, ids: torch.Tensor | None, adjust: bool, out_device,
               error: BaseException | None = None) -> torch.Tensor:
        """The rows ``ids`` (checked), from the cache where it holds them, else from the table.
        ``error``: this rank's ids were bad (only for a cache of this rank alone, whose ids no
        one checked together): it fails here and on every rank of the table's group."""
        if error is not None:
            self.fetch(None, error)
        if adjust:
            self.adjust(ids)
        line = self._lines(ids)
        n = ids.numel()
        hit = None if not n or int(line.min()) >= 0 else line >= 0
        h = n if hit is None else int(hit.sum())
        if h == n:
            self.fetch(ids[:0])  # (every rank takes part: others may miss)
            out = self._cached_rows(line).to(out_device)
        else:
            miss = (~hit).nonzero().view(-1)
            out = self.fetch(ids.index_select(0, miss.to(ids.device))).to(out_device)
            if h:
                at = hit.nonzero().view(-1)
                full = torch.empty((n,) + tuple(out.shape[1:]), dtype=out.dtype, device=out_device)
                full.index_copy_(0, miss.to(out_device), out)
                full.index_copy_(0, at.to(out_device), self._cached_rows(line[at]).to(out_device))
                out = full
        self.counters.hits += h
        self.counters.misses += n - h
        return out

    def writeback(self) -> None:
        """Nothing to write: the rows were only read."""

    def drop(self, writeback: bool = True) -> None:
        self._barrier()  # the cache ranks' lookups so far are done reading these sets
        self.my_tags.fill_(-1)
        self.my_slots.fill_(-1)
