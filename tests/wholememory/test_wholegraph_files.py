"""WholeMemoryTensor's files at 1-3 ranks: to_file_prefix / from_file_prefix, from_filelist (cut
files, fewer entries, round robin, a sub tensor's columns), local_to_file,
create_wholememory_tensor_from_filelist and the part file names, each result against a local
reference, every bad file an error (on every rank where one rank's file is bad) with the job going
on."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from harness import Report, assert_reports
from wm_helpers import TYPES, _reference, expect as _expect, on_one_rank as _on_one_rank, parts as _parts
from wm_helpers import start as _start, uneven as _uneven

ROWS = 13


def _write(path, t):
    with open(path, "wb") as f:
        f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def body_files(ctx, tmp):
    wgth, g = _start(ctx)
    rep = Report(ctx)
    r, n = ctx.rank, ctx.size
    cols = 5
    ref = _reference(ROWS, (cols,), torch.float32)
    every = torch.arange(ROWS)
    # the reference cut in three files at entry boundaries (one of them empty), by rank 0
    pieces = [os.path.join(tmp, f"cut{i}") for i in range(3)]
    if r == 0:
        for path, (a, b) in zip(pieces, [(0, 4), (4, 4), (4, ROWS)]):
            _write(path, ref[a:b])
        _write(os.path.join(tmp, "ids"), torch.arange(ROWS * 2, dtype=torch.int64) * 3)
        _write(os.path.join(tmp, "short"), ref[:ROWS - 3])
        _write(os.path.join(tmp, "ragged"), ref.view(-1)[:7])
    g.barrier()
    for save_mt, load_mt in zip(TYPES, TYPES[1:] + TYPES[:1]):
        what = f"{save_mt} -> {load_mt}"
        t = wgth.create_wholememory_tensor(g, save_mt, "cpu", [ROWS, cols], torch.float32, [8, 1], _uneven(ROWS, n))
        local, first = t.get_local_tensor()
        local.copy_(ref[first:first + local.shape[0]])
        g.barrier()
        prefix = os.path.join(tmp, f"saved-{save_mt}")
        t.to_file_prefix(prefix)
        mine = wgth.get_part_file_name(prefix, r, n)
        rep.check(wgth.get_part_file_list(prefix, n) == [f"{prefix}_part_{i}_of_{n}" for i in range(n)], "names")
        rep.check(os.path.getsize(mine) == local.shape[0] * cols * 4, f"{what}: {mine} holds this rank's rows only")
        back = wgth.create_wholememory_tensor(g, load_mt, "cpu", [ROWS, cols], torch.float32, None)
        back.from_file_prefix(prefix)
        rep.check(torch.equal(back.gather(every), ref), f"{what}: to_file_prefix / from_file_prefix")
        back2 = wgth.create_wholememory_tensor(g, load_mt, "cpu", [ROWS, cols], torch.float32, [6, 1],
                                               _uneven(ROWS, n))
        back2.from_filelist(pieces)
        rep.check(torch.equal(back2.gather(every), ref), f"{what}: from_filelist of cut files")
        fewer = wgth.create_wholememory_tensor(g, load_mt, "cpu", [ROWS, cols], torch.float32, None)
        fewer.from_filelist(os.path.join(tmp, "short"))
        want = ref.clone()
        want[ROWS - 3:] = 0
        rep.check(torch.equal(fewer.gather(every), want), f"{what}: files with fewer entries")
        _round_robin(rep, wgth, g, load_mt, tmp, ref, r, n, what)
        # a sub tensor's columns from files, and back to a file
        wide = wgth.create_wholememory_tensor(g, load_mt, "cpu", [ROWS, cols + 2], torch.float32, None)
        sub = wide.get_sub_tensor([-1, 1], [-1, cols + 1])
        sub.from_filelist(pieces)
        want = torch.zeros(ROWS, cols + 2)
        want[:, 1:cols + 1] = ref
        rep.check(torch.equal(wide.gather(every), want), f"{what}: from_filelist into a sub tensor's columns")
        out = os.path.join(tmp, f"local-{load_mt}-{r}")
        sub.local_to_file(out)
        sl, _ = sub.get_local_tensor()
        with open(out, "rb") as f:
            rep.check(f.read() == sl.contiguous().numpy().tobytes(), f"{what}: local_to_file of a sub tensor")
        made = wgth.create_wholememory_tensor_from_filelist(g, load_mt, "cpu", pieces, torch.float32, cols, cols + 3)
        rep.check(made.shape == (ROWS, cols) and made.stride() == (cols + 3, 1) and
                  torch.equal(made.gather(every), ref), f"{what}: create_wholememory_tensor_from_filelist")
        ids = wgth.create_wholememory_tensor_from_filelist(g, load_mt, "cpu", os.path.join(tmp, "ids"), torch.int64)
        rep.check(ids.shape == (2 * ROWS,) and torch.equal(ids.gather(torch.arange(2 * ROWS)),
                                                          torch.arange(2 * ROWS) * 3), f"{what}: a 1-D file")
        g.barrier()
        _file_errors(rep, wgth, g, load_mt, tmp, pieces, back, r, n, what)
        rep.check(torch.equal(back.gather(every), ref), f"{what}: the job goes on")
    wgth.finalize()
    return rep.result()


def _round_robin(rep, wgth, g, mt, tmp, ref, r, n, what):
    """Entry e goes to rank (e // size) % n, at local entry (e // (size n)) size + e % size."""
    parts = _parts(ROWS, n, None)
    least = min(c for _, c in parts)
    size = 2 if n <= 2 else least
    total = n * least if n > 1 else ROWS
    path = os.path.join(tmp, f"rr-{mt}-{n}")
    if r == 0:
        _write(path, ref[:total])
    g.barrier()
    t = wgth.create_wholememory_tensor(g, mt, "cpu", [ROWS, ref.shape[1]], torch.float32, None)
    t.from_filelist(path, round_robin_size=size)
    want = torch.zeros_like(ref)
    for e in range(total):
        owner = (e // size) % n
        want[parts[owner][0] + (e // (size * n)) * size + e % size] = ref[e]
    rep.check(torch.equal(t.gather(torch.arange(ROWS)), want), f"{what}: round robin of {size}")
    _expect(rep, f"{what}: a round robin too large", lambda: t.from_filelist(path, round_robin_size=total + 1),
            ValueError, f"(rank {r})", "illegal round_robin_size")


def _file_errors(rep, wgth, g, mt, tmp, pieces, t, r, n, what):
    last = n - 1
    missing = os.path.join(tmp, "missing")
    _expect(rep, f"{what}: a missing file", lambda: t.from_filelist([missing]), ValueError, f"(rank {r})", missing)
    _expect(rep, f"{what}: too many entries", lambda: t.from_filelist(pieces + pieces), ValueError, f"(rank {r})",
            f"{2 * ROWS} entries")
    _expect(rep, f"{what}: a file of part entries", lambda: t.from_filelist(os.path.join(tmp, "ragged")), ValueError,
            f"(rank {r})", "28 bytes")
    _expect(rep, f"{what}: from_file_prefix of no files", lambda: t.from_file_prefix(missing), ValueError, missing)
    if n > 1:
        _on_one_rank(rep, f"{what}: a file only rank {last} lacks",
                     lambda: t.from_filelist([missing] if r == last else pieces), last, ValueError, [missing], True)
        _on_one_rank(rep, f"{what}: create from a file only rank {last} lacks",
                     lambda: wgth.create_wholememory_tensor_from_filelist(
                         g, mt, "cpu", [missing] if r == last else pieces, torch.float32, 5), last, ValueError,
                     [missing], True)
        _on_one_rank(rep, f"{what}: local_to_file into a directory that rank {last} lacks",
                     lambda: t.local_to_file(os.path.join(tmp, "no-such-dir" if r == last else "", f"x{r}")), last,
                     OSError, ["no-such-dir"], True)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_files(run, size):
    with tempfile.TemporaryDirectory() as tmp:
        assert_reports(run(size, body_files, tmp, timeout=150))
