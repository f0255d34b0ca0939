"""save_to_files / load_from_files: WholeMemory's file sets, each rank reading or writing only its
own part, all ranks at once.

A set is ``{prefix}_part_{i}_of_{n}``: raw rows, no header, native byte order, only the logical
columns (stride padding is not written); the files of a set concatenated in order are the tensor.
A load reads any set whose rows add up to the tensor's, whatever its n: each rank reads the pieces
of the files that overlap its rows. Both are collective over the tensor's group and end with an
agreement, so a rank that failed (a missing file, a short read) makes every rank raise.

create_wm_tensor_from_file makes a tensor holding a file's (or a file set's) elements, the seed
API's way to load a table that has no tensor yet.
"""

from __future__ import annotations

import glob
import math
import os
import re

import torch

from . import comm as comm_mod
from .errors import agree_on_error
from .tensor import WmTensorType, create_wm_tensor, local_partition, meta_of


def part_file_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}_part_{i}_of_{n}"


def _row_bytes(m) -> int:
    per_row = 1
    for d in m.shape[1:]:
        per_row *= d
    return per_row * m.dtype.itemsize


def _as_bytes(rows: torch.Tensor) -> memoryview:
    flat = rows.cpu().contiguous().view(-1)  # CUDA rows: through a host copy
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _agree(op, group, error: BaseException | None) -> None:
    agree_on_error(op, group, error, "rank {rank} failed (its error says why)", OSError)


def _writer(m) -> bool:
    """HOST tensors exist once per host: the first host's ranks write them."""
    return m.kind is not WmTensorType.HOST or m.host == 0


def save_to_files(t, prefix: str) -> None:
    """Each rank writes its part to ``{prefix}_part_{i}_of_{n}`` (i its part, n the parts)."""
    m = meta_of(t, "save_to_files")
    error = None
    if _writer(m):
        try:
            rows, _ = local_partition(t)
            path = part_file_name(prefix, m.index, len(m.members))
            with open(path + ".tmp", "wb") as f:
                f.write(_as_bytes(rows))
            os.replace(path + ".tmp", path)
        except OSError as e:
            error = OSError(f"myccl: save_to_files (rank {m.group.rank()}): {e}")
    _agree("save_to_files", m.group, error)


def _file_set(prefix: str, part_count):
    if part_count is None:
        found = {}
        pattern = re.compile(re.escape(os.path.basename(prefix)) + r"_part_(\d+)_of_(\d+)$")
        for p in glob.glob(glob.escape(prefix) + "_part_*_of_*"):
            mt = pattern.match(os.path.basename(p))
            if mt:
                found.setdefault(int(mt.group(2)), set()).add(int(mt.group(1)))
        complete = [n for n, ids in found.items() if ids == set(range(n))]
        if len(complete) != 1:
            raise FileNotFoundError(
                f"no single complete file set {prefix}_part_<i>_of_<n> (found sets of {sorted(found) or 'none'}, "
                f"complete: {sorted(complete) or 'none'}); pass part_count")
        part_count = complete[0]
    return [part_file_name(prefix, i, part_count) for i in range(part_count)]


def load_from_files(t, prefix: str, part_count: int | None = None) -> None:
    """Fills the tensor from a file set: each rank reads the rows of its own part."""
    m = meta_of(t, "load_from_files")
    op = "load_from_files"
    error = None
    try:
        rb = _row_bytes(m)
        files = _file_set(prefix, part_count)
        sizes = [os.path.getsize(p) for p in files]
        for p, s in zip(files, sizes):
            if s % rb:
                raise ValueError(f"{p} has {s} bytes, not a multiple of a row ({rb} bytes)")
        total = sum(sizes) // rb
        if total != m.rows:
            raise ValueError(f"the files of {prefix} hold {total} rows, the tensor has {m.rows}")
        rows, first = local_partition(t)
        read_rows(files, sizes, rb, first, rows)
    except (OSError, ValueError) as e:
        error = type(e)(f"myccl: {op} (rank {m.group.rank()}): {e}")
    _agree(op, m.group, error)


def read_rows(files, sizes, rb: int, first: int, dest: torch.Tensor) -> None:
    """Reads rows [first, first + len(dest)) of the concatenated files into dest."""
    count = dest.shape[0]
    if not count:
        return
    direct = dest.is_contiguous() and dest.device.type == "cpu"
    buf = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
    out = _as_bytes(buf)  # buf is contiguous: this is its memory, not a copy
    want_lo, want_hi = first * rb, (first + count) * rb
    at = 0
    for path, size in zip(files, sizes):
        lo, hi = max(at, want_lo), min(at + size, want_hi)
        if lo < hi:
            with open(path, "rb", buffering=0) as f:
                f.seek(lo - at)
                view = out[lo - want_lo:hi - want_lo]
                got = 0
                while got < len(view):
                    k = f.readinto(view[got:])
                    if not k:
                        raise OSError(f"{path}: short read at byte {lo - at + got}")
                    got += k
        at += size
    if buf is not dest:
        dest.copy_(buf)


def _source_files(path: str, part_count: int) -> list[str]:
    """part_count 0: the file ``path`` itself, else (where there is none) the one complete set
    ``path_part_<i>_of_<n>``; part_count n > 0: that set."""
    if part_count == 0 and os.path.isfile(path):
        return [path]
    return _file_set(path, part_count or None)


def create_wm_tensor_from_file(shape, dtype, wm_comm, filename: str, wm_tensor_type=WmTensorType.CHUNKED,
                               part_count: int = 0):
    """Collective over ``wm_comm``: a new whole-memory tensor of ``dtype`` holding the elements of
    ``filename`` (raw, native byte order), each rank reading only its own rows. ``shape`` [] makes
    it 1-D, one row per element; otherwise the files must hold exactly its elements. part_count as
    described in _source_files."""
    op = "create_wm_tensor_from_file"
    group = comm_mod.resolve_group(op, wm_comm)
    error, files, sizes = None, [], []
    try:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if isinstance(part_count, bool) or not isinstance(part_count, int) or part_count < 0:
            raise ValueError(f"part_count must be an int >= 0, got {part_count!r}")
        files = _source_files(filename, part_count)
        sizes = [os.path.getsize(p) for p in files]
        for p, n in zip(files, sizes):
            if n % dtype.itemsize:
                raise ValueError(f"{p} has {n} bytes, not a whole number of {dtype} elements")
        count = sum(sizes) // dtype.itemsize
        shape = [int(d) for d in shape] if shape is not None and len(shape) else [count]
        if math.prod(shape) != count:
            raise ValueError(f"shape {shape} has {math.prod(shape)} elements, the files of {filename} hold {count}")
    except (OSError, ValueError, TypeError) as e:
        error = type(e)(f"myccl: {op} (rank {group.rank()}): {e}")
    agree_on_error(op, group, error, "rank {rank} cannot read the files (its error says why)", OSError)
    t = create_wm_tensor(group, shape, [], dtype, wm_tensor_type)
    try:  # (a HOST tensor: every host fills its own copy)
        rows, first = local_partition(t)
        read_rows(files, sizes, _row_bytes(meta_of(t, op)), first, rows)
    except OSError as e:
        error = OSError(f"myccl: {op} (rank {group.rank()}): {e}")
    agree_on_error(op, group, error, "rank {rank} failed to read its rows (its error says why)", OSError)
    return t
