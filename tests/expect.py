"""Deterministic per-rank inputs and local expectations computed with plain torch, folding in
rank order exactly as a correct backend must (float16/bfloat16 accumulated in float32 and
rounded once), so most results can be compared bit for bit."""

from __future__ import annotations

import torch

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
COMPLEX = [torch.complex64, torch.complex128]
ALL_DTYPES = FLOATS + INTS + [torch.bool] + COMPLEX
REDOPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def valid(op: str, dtype: torch.dtype) -> bool:
    """Which (op, dtype) combinations myccl defines; the rest must raise ValueError."""
    if op in ("BAND", "BOR", "BXOR"):
        return dtype in INTS or dtype == torch.bool
    if op in ("MIN", "MAX"):
        return dtype not in COMPLEX
    if op == "AVG":
        return dtype != torch.bool
    if op == "PREMUL_SUM":
        return dtype in FLOATS or dtype in COMPLEX
    return True


def exact(op: str, dtype: torch.dtype) -> bool:
    """Complex multiply/divide may round differently in torch's vectorised kernels."""
    return not (dtype in COMPLEX and op in ("PRODUCT", "AVG"))


def make(rank: int, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 17)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype in INTS:
        lo = 0 if dtype == torch.uint8 else -5
        return torch.randint(lo, 6, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype in COMPLEX:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(torch.randn(shape, generator=g, dtype=real), torch.randn(shape, generator=g, dtype=real))
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def premul_factor(rank: int) -> float:
    return 0.5 + 0.25 * rank


def redop(op: str, rank: int):
    import torch.distributed as dist

    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(premul_factor(rank))
    return getattr(dist.ReduceOp, op)


def _binop(op: str, dtype):
    if dtype == torch.bool:
        op = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}.get(op, op)
    return {
        "SUM": lambda a, b: a + b,
        "AVG": lambda a, b: a + b,
        "PREMUL_SUM": lambda a, b: a + b,
        "PRODUCT": lambda a, b: a * b,
        "MIN": torch.minimum,
        "MAX": torch.maximum,
        "BAND": lambda a, b: a & b,
        "BOR": lambda a, b: a | b,
        "BXOR": lambda a, b: a ^ b,
    }[op]


def reduce_all(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Reduction of per-rank tensors xs (index = rank)."""
    dtype = xs[0].dtype
    n = len(xs)
    if op == "PREMUL_SUM":
        xs = [x * premul_factor(r) for r, x in enumerate(xs)]
    low = dtype in (torch.float16, torch.bfloat16)
    f = _binop(op, dtype)
    acc = xs[0].float() if low else xs[0].clone()
    for x in xs[1:]:
        acc = f(acc, x.float() if low else x)
    if op == "AVG":
        if dtype in INTS:
            acc = torch.div(acc, n, rounding_mode="trunc")
        else:
            acc = acc / n
    return acc.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, exact_match: bool = True) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if exact_match:
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-5, atol=1e-6)


# The shapes every collective is tried on ("T": a transposed 6x8, i.e. non-contiguous).
SHAPES = {
    "empty": (0,),
    "scalar": (),
    "small": (7,),
    "2d": (5, 3),
    "medium": (20000,),
    "large": (150001,),
    "noncontig": "T",
}


def inputs(size, shape_name, dtype, seed):
    """Every rank's input of one case, as each rank makes its own (make() is deterministic)."""
    shape = SHAPES[shape_name]
    if shape == "T":
        return [make(r, (6, 8), dtype, seed).t() for r in range(size)]
    return [make(r, shape, dtype, seed) for r in range(size)]


def cases(dtypes, large_dtypes, shapes=SHAPES):
    """(dtype, shape name) pairs; "large" only for the dtypes in large_dtypes."""
    for dtype in dtypes:
        for shape_name in shapes:
            if shape_name == "large" and dtype not in large_dtypes:
                continue
            yield dtype, shape_name

