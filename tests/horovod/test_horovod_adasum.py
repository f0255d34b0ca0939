"""c10d_ext.horovod.adasum: the local reference against hand-computed values and Adasum's known
properties, then the VHDD reduction (adasum_allreduce_) on myccl groups of 1, 2 and 4 ranks
against the reference (fp16/32/64, fused tensors of uneven sizes, 0-length and zero tensors,
subgroups, chunked exchanges), and at 2 ranks on the CUDA test double.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch
import torch.distributed as dist

from c10d_ext.horovod.adasum import SQRT_DBL_MIN, adasum_allreduce_, adasum_reference
from cuda_helpers import DOUBLE, SHARED_GPU
from harness import Report, assert_reports


# ---- an independent two-vector formula (plain Python floats) -------------------------------

def _pair(a: list[float], b: list[float]) -> list[float]:
    dot = sum(x * y for x, y in zip(a, b))
    na = sum(x * x for x in a)
    nb = sum(y * y for y in b)
    ca = 1.0 - dot / (2 * na) if na >= SQRT_DBL_MIN else 1.0
    cb = 1.0 - dot / (2 * nb) if nb >= SQRT_DBL_MIN else 1.0
    return [ca * x + cb * y for x, y in zip(a, b)]


def _pair_fused(a: torch.Tensor, b: torch.Tensor, sizes) -> torch.Tensor:
    out, off = [], 0
    for s in sizes:
        out += _pair(a[off:off + s].tolist(), b[off:off + s].tolist())
        off += s
    return torch.tensor(out, dtype=torch.float64)


# ---- the reference, locally ----------------------------------------------------------------

def test_reference_hand_computed_pair():
    # a.b = 2, |a|^2 = 4, |b|^2 = 2: 0.75 * a + 0.5 * b
    got = adasum_reference([torch.tensor([2.0, 0.0], dtype=torch.float64),
                            torch.tensor([1.0, 1.0], dtype=torch.float64)], [2])
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.tensor([2.0, 0.5], dtype=torch.float64))
    # symmetric case: a.b = 24, |a|^2 = |b|^2 = 25: 0.52 * (a + b)
    got = adasum_reference([torch.tensor([3.0, 4.0], dtype=torch.float64),
                            torch.tensor([4.0, 3.0], dtype=torch.float64)], [2])
    assert torch.allclose(got, torch.tensor([3.64, 3.64], dtype=torch.float64), rtol=0, atol=1e-15)


def test_reference_matches_independent_formula():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64)
    sizes = [10, 0, 25, 5]
    got = adasum_reference([a, b], sizes)
    assert torch.allclose(got, _pair_fused(a, b, sizes), rtol=1e-13, atol=1e-14)


def test_reference_orthogonal_vectors_add():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, generator=g, dtype=torch.float64)
    b = torch.randn(64, generator=g, dtype=torch.float64)
    b -= (a @ b) / (a @ a) * a  # Gram-Schmidt: a.b == 0 up to rounding
    assert torch.allclose(adasum_reference([a, b], [64]), a + b, rtol=1e-12, atol=1e-12)
    # disjoint supports: exactly orthogonal, exactly the sum (four vectors, every level)
    vs = [torch.zeros(16, dtype=torch.float64) for _ in range(4)]
    for i, v in enumerate(vs):
        v[4 * i:4 * i + 4] = torch.randn(4, generator=g, dtype=torch.float64)
    assert torch.equal(adasum_reference(vs, [16]), sum(vs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_reference_identical_vectors_give_the_vector(dtype, n):
    v = torch.randn(37, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert torch.equal(adasum_reference([v.clone() for _ in range(n)], [30, 7]), v)


def test_reference_parallel_vectors_average_like():
    # b = c a with c > 0: Adasum = (1 - c/2) a + (1 - 1/(2c)) c a = (1 + c)/2 a, the average
    a = torch.randn(20, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = adasum_reference([a, 3 * a], [20])
    assert torch.allclose(got, 2 * a, rtol=1e-14, atol=1e-14)


def test_reference_zero_vectors():
    a = torch.randn(9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    z = torch.zeros(9, dtype=torch.float64)
    assert torch.equal(adasum_reference([a, z], [9]), a)
    assert torch.equal(adasum_reference([z, a], [9]), a)
    assert torch.equal(adasum_reference([z, z], [9]), z)


def test_reference_sqrt_dbl_min_rule():
    # |a|^2 = 1e-156 < sqrt(DBL_MIN) (~1.49e-154): a's coefficient is 1, so the result is a + b'
    one = torch.tensor([1.0], dtype=torch.float64)
    tiny = torch.tensor([1e-78], dtype=torch.float64)
    assert torch.allclose(adasum_reference([tiny, one], [1]), torch.tensor([1.0], dtype=torch.float64), rtol=1e-15)
    # |a|^2 = 1e-152 is above it: the formula applies, (1 - 0.5e76) * 1e-76 + (1 - 0.5e-76) = 0.5
    small = torch.tensor([1e-76], dtype=torch.float64)
    assert torch.allclose(adasum_reference([small, one], [1]), torch.tensor([0.5], dtype=torch.float64), rtol=1e-12)


def test_reference_coefficients_are_per_tensor():
    g = torch.Generator().manual_seed(6)
    sizes = [5, 0, 12, 1, 30]
    vs = [torch.randn(sum(sizes), generator=g, dtype=torch.float64) for _ in range(4)]
    vs[1][5:17] = 0  # one tensor zero on one rank
    fused = adasum_reference(vs, sizes)
    off, parts = 0, []
    for s in sizes:
        parts.append(adasum_reference([v[off:off + s] for v in vs], [s]))
        off += s
    assert torch.allclose(fused, torch.cat(parts), rtol=1e-13, atol=1e-14)
    assert not torch.allclose(fused, adasum_reference(vs, [sum(sizes)]))  # one coefficient would differ


def test_reference_tree_order():
    g = torch.Generator().manual_seed(7)
    sizes = [3, 8]
    vs = [torch.randn(11, generator=g, dtype=torch.float64) for _ in range(4)]
    want = _pair_fused(_pair_fused(vs[0], vs[1], sizes), _pair_fused(vs[2], vs[3], sizes), sizes)
    assert torch.allclose(adasum_reference(vs, sizes), want, rtol=1e-13, atol=1e-14)
    other = _pair_fused(_pair_fused(vs[0], vs[2], sizes), _pair_fused(vs[1], vs[3], sizes), sizes)
    assert not torch.allclose(other, want)  # the pairing matters, so the test above means something


def test_reference_fp16_and_fp32_follow_fp64():
    g = torch.Generator().manual_seed(8)
    sizes = [100, 28]
    vs = [torch.randn(128, generator=g, dtype=torch.float64) for _ in range(4)]
    want = adasum_reference(vs, sizes)
    got32 = adasum_reference([v.float() for v in vs], sizes)
    got16 = adasum_reference([v.half() for v in vs], sizes)
    assert got32.dtype == torch.float32 and got16.dtype == torch.float16
    assert torch.allclose(got32.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got16.double(), want, rtol=1e-2, atol=1e-2)


def test_blocks_cover_every_tensor_in_order():
    from c10d_ext.horovod.adasum import _blocks

    g = torch.Generator().manual_seed(9)
    for trial in range(200):
        counts = torch.randint(0, 12, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        if trial % 3 == 0:
            counts[0] = 0
        block = int(torch.randint(1, 20, (1,), generator=g))
        covered = [0] * len(counts)
        expect_off = 0
        for off, n, i0, lens in _blocks(counts, block):
            assert off == expect_off and 0 < n <= block and sum(lens) == n and lens[0] > 0
            for j, c in enumerate(lens):
                covered[i0 + j] += c
            # the block's elements are the next ones in tensor order
            assert sum(counts[:i0]) <= off < sum(counts[:i0 + 1])
            expect_off += n
        assert covered == counts and expect_off == sum(counts)


def test_reference_with_tensors_across_blocks(monkeypatch):
    import c10d_ext.horovod.adasum as adasum

    g = torch.Generator().manual_seed(10)
    sizes = [1, 13, 0, 2, 30, 5]
    vs = [torch.randn(sum(sizes), generator=g, dtype=torch.float64) for _ in range(2)]
    whole = adasum.adasum_reference(vs, sizes)
    monkeypatch.setattr(adasum, "_block_elems", lambda device: 4)  # blocks cut through tensors
    assert torch.allclose(adasum.adasum_reference(vs, sizes), whole, rtol=1e-13, atol=1e-14)
    assert torch.allclose(whole, _pair_fused(vs[0], vs[1], sizes), rtol=1e-13, atol=1e-14)


def test_reference_and_allreduce_argument_errors():
    v = torch.ones(4)
    with pytest.raises(ValueError):
        adasum_reference([v, v], [3])
    with pytest.raises(NotImplementedError, match="non-power of 2"):
        adasum_reference([v, v, v], [4])
    with pytest.raises(RuntimeError, match="Unsupported data type"):
        adasum_reference([v.bfloat16(), v.bfloat16()], [4])
    # adasum_allreduce_ checks before it communicates (no group needed for these)
    for bad in (torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="Unsupported data type"):
            adasum_allreduce_(bad, [4], None, [0])
    with pytest.raises(ValueError):
        adasum_allreduce_(torch.ones(2, 2), [4], None, [0])
    with pytest.raises(ValueError):
        adasum_allreduce_(torch.ones(4), [2, 1], None, [0])


# ---- the distributed reduction ---------------------------------------------------------------

SIZES = [7, 0, 33, 1, 0, 129, 2, 5, 64]  # 241 elements: odd halves at every level
TOL = {torch.float64: 1e-11, torch.float32: 2e-6, torch.float16: 4e-3}


def _vectors(n: int, sizes, dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input, as each rank makes it: tensors of different scales, tensor 2 zero on
    rank 0, tensor 5 zero everywhere, tensor 7 the same on every rank."""
    scales = [1.0, 1.0, 1e-3, 5.0, 1.0, 1.0, 0.2, 30.0, 1.0]
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(seed * 1009 + r)
        parts = []
        for i, s in enumerate(sizes):
            scale = scales[i % len(scales)]
            x = torch.randn(s, generator=g, dtype=torch.float64) * scale
            if i == 7:
                x = torch.randn(s, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
            if (i == 2 and r == 0) or i == 5:
                x = torch.zeros(s, dtype=torch.float64)
            parts.append(x)
        out.append(torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, sizes) -> bool:
    """Per tensor: |got - want| <= tol * max|want| (the coefficients' sums run in another
    order than the reference's, so the last bits may differ)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    tol = TOL[got.dtype]
    off = 0
    for s in sizes:
        g, w = got[off:off + s].double(), want[off:off + s].double()
        off += s
        if s and (g - w).abs().max() > tol * max(w.abs().max().item(), 1e-30):
            return False
    return True


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


CASES = [  # (what, dtype, sizes)
    ("fused fp32", torch.float32, SIZES),
    ("fused fp64", torch.float64, SIZES),
    ("fused fp16", torch.float16, SIZES),
    ("one element", torch.float32, [1]),
    ("three elements", torch.float64, [0, 3]),
    ("only empty tensors", torch.float32, [0, 0]),
    ("one larger tensor", torch.float32, [3001]),
]


def _run_cases(ctx, rep, group, members, device, cases=CASES, seed0=0):
    """adasum_allreduce_ on `group` (this rank is members.index(global rank)) for every case;
    returns the digests of the results, for the cross-rank comparison."""
    me = members.index(dist.get_rank())
    digests = []
    for i, (what, dtype, sizes) in enumerate(cases):
        vs = _vectors(len(members), sizes, dtype, seed0 + i)
        buf = vs[me].clone().to(device)
        ptr = buf.data_ptr()
        adasum_allreduce_(buf, sizes, group, members)
        want = adasum_reference(vs, sizes)
        rep.check(buf.data_ptr() == ptr and buf.device == torch.device(device), f"{what}: in place")
        rep.check(_close(buf.cpu(), want, sizes), f"{what}: differs from the reference:\n{buf.cpu()}\n{want}")
        if len(members) == 2 and dtype == torch.float64:
            rep.check(_close(buf.cpu(), _pair_fused(vs[0], vs[1], sizes), sizes), f"{what}: differs from the formula")
        digests.append(_digest(buf))
    # properties that hold exactly: identical inputs give the input, disjoint supports the sum
    n = len(members)
    v = torch.randn(50, generator=torch.Generator().manual_seed(11), dtype=torch.float32)
    buf = v.clone().to(device)
    adasum_allreduce_(buf, [20, 30], group, members)
    rep.check(torch.equal(buf.cpu(), v), "identical inputs: the result is the input, exactly")
    parts = torch.zeros(n, 8 * n, dtype=torch.float64)
    for r in range(n):
        parts[r, 8 * r:8 * r + 8] = torch.randn(8, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64)
    buf = parts[me].clone().to(device)
    adasum_allreduce_(buf, [8 * n], group, members)
    rep.check(torch.equal(buf.cpu(), parts.sum(0)), "orthogonal inputs: the result is the sum, exactly")
    digests.append(_digest(buf))
    return digests


def body_world(ctx, device="cpu"):
    ctx.init(timeout=60)
    rep = Report(ctx)
    members = list(range(ctx.size))
    digests = _run_cases(ctx, rep, dist.group.WORLD, members, device)
    if ctx.size > 1:  # the group still works for ordinary collectives
        t = torch.ones(3, device=device)
        dist.all_reduce(t)
        rep.check(torch.equal(t.cpu(), torch.full((3,), float(ctx.size))), "all_reduce afterwards")
    return rep.result(), digests


def _assert_same_everywhere(results):
    assert_reports([r for r, _ in results])
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), "ranks ended with different bits"


@pytest.mark.parametrize("size", [1, 2, 4])
def test_allreduce_matches_reference(run, size):
    _assert_same_everywhere(run(size, body_world, timeout=120))


def body_chunked(ctx):
    """HOROVOD_ADASUM_MPI_CHUNK_SIZE = 4 KiB: every exchange goes in many chunks; the last case
    also spans several of the local arithmetic's blocks (64 Ki elements) per tensor."""
    ctx.init(timeout=60)
    rep = Report(ctx)
    cases = [("chunked fp32", torch.float32, [20000, 3, 0, 4099]), ("chunked fp16", torch.float16, [9001, 17]),
             ("several blocks fp32", torch.float32, [70000, 5, 0, 140001, 66000])]
    digests = _run_cases(ctx, rep, dist.group.WORLD, list(range(ctx.size)), "cpu", cases, seed0=40)
    return rep.result(), digests


def test_chunked_exchanges(run):
    _assert_same_everywhere(run(4, body_chunked, timeout=120, env={"HOROVOD_ADASUM_MPI_CHUNK_SIZE": "4096"}))


def body_subgroups(ctx):
    """Groups [0, 2] and [1, 3] at once (group ranks differ from global ranks), then a group of
    3 that Adasum refuses before it communicates."""
    ctx.init(timeout=60)
    rep = Report(ctx)
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    three = dist.new_group([0, 1, 2])
    members = [0, 2] if ctx.rank % 2 == 0 else [1, 3]
    digests = _run_cases(ctx, rep, evens if ctx.rank % 2 == 0 else odds, members, "cpu",
                         CASES[:3], seed0=60 + 10 * (ctx.rank % 2))
    if ctx.rank in (0, 1, 2):
        try:
            adasum_allreduce_(torch.ones(4), [4], three, [0, 1, 2])
            rep.fail("a group of 3: nothing raised")
        except NotImplementedError as e:
            rep.check("non-power of 2" in str(e), f"a group of 3: {e}")
        try:
            adasum_allreduce_(torch.ones(4), [4], three, [0, 1])
            rep.fail("ranks that do not match the group: nothing raised")
        except ValueError:
            rep.check(True, "")
    dist.barrier()
    for g in (evens, odds, three):
        dist.destroy_process_group(g)
    return rep.result(), digests


def test_subgroups(run):
    results = run(4, body_subgroups, timeout=120)
    assert_reports([r for r, _ in results])
    assert results[0][1] == results[2][1], "ranks 0 and 2 ended with different bits"
    assert results[1][1] == results[3][1], "ranks 1 and 3 ended with different bits"
    assert results[0][1] != results[1][1]  # the two groups reduced different inputs


# ---- CUDA: the strict test double (always) and a real GPU (when there is one) ---------------

def _double_world():
    import cuda_double  # noqa: F401

    if not cuda_double.available():
        pytest.skip("the CUDA test double is not built (MYCCL_BUILD_TESTS=1)")
    return DOUBLE


def body_double(ctx):
    """Under the double CPU tensors stand for CUDA tensors: p2p and all_gather go through the
    CUDA engine on simulated devices, and anything real CUDA/NCCL would hang on is recorded."""
    import cuda_double

    cuda_double.set_device(ctx.rank % 2)
    cuda_double.clear_violations()
    result, digests = body_world(ctx, "cpu")
    checks, failures = result
    cuda_double.synchronize()
    failures = failures + [f"rank {ctx.rank}: strict double: {v}" for v in cuda_double.violations()]
    return (checks + 1, failures), digests


def test_allreduce_on_cuda_double(run):
    _assert_same_everywhere(run(2, body_double, timeout=180, world_env=_double_world()))


def body_gpu(ctx):
    torch.cuda.set_device(ctx.rank % torch.cuda.device_count())
    return body_world(ctx, f"cuda:{ctx.rank % torch.cuda.device_count()}")


@pytest.mark.cuda
@pytest.mark.parametrize("size", [1, 2])
def test_allreduce_on_gpu(run, size):
    _assert_same_everywhere(run(size, body_gpu, timeout=180, world_env=SHARED_GPU))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
