"""c10d_ext.horovod's SyncBatchNorm: its refusal of CPU input (as Horovod's), its synchronization
with CPU stand-ins for torch's CUDA-only kernels against torch's BatchNorm on the whole batch,
and the real thing on a GPU. Shares the rank-body helpers of tests/horovod/test_horovod_training.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import c10d_ext.horovod as hvd
from harness import assert_reports
from hvd_helpers import close, expect_raise, hvd_body


# ---- SyncBatchNorm -------------------------------------------------------------------------------

def test_sync_batch_norm_refuses_cpu_input():
    from torch.nn.modules.batchnorm import _BatchNorm

    bn = hvd.SyncBatchNorm(3)
    assert isinstance(bn, _BatchNorm)
    assert (bn.eps, bn.momentum, bn.affine, bn.track_running_stats) == (1e-5, 0.1, True, True)
    assert bn.state_dict().keys() == nn.BatchNorm1d(3).state_dict().keys()
    for training in (True, False):
        bn.train(training)
        with pytest.raises(ValueError) as e:
            bn(torch.randn(4, 3))
        assert str(e.value) == "SyncBatchNorm expected input tensor to be on GPU"
        with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
            bn(torch.randn(3))  # the device check comes before the dimension check
    assert bn.num_batches_tracked.item() == 0


def cpu_bn_kernels():
    """CPU formulas for the five CUDA-only kernels SyncBatchNorm calls (same arguments and
    results), so that its synchronization can be checked without a GPU."""
    def v(t, x):
        return t.view([1, -1] + [1] * (x.dim() - 2))

    def dims(x):
        return [0] + list(range(2, x.dim()))

    def stats(x, eps):
        return x.mean(dims(x)), 1 / torch.sqrt(x.var(dims(x), unbiased=False) + eps)

    def gather(x, mean_all, invstd_all, rm, rv, momentum, eps, counts):
        c, n = counts.view(-1, 1), counts.sum()
        mean = (c * mean_all).sum(0) / n
        var = (c * (1 / invstd_all ** 2 - eps + (mean_all - mean) ** 2)).sum(0) / n
        rm.mul_(1 - momentum).add_(momentum * mean)
        rv.mul_(1 - momentum).add_(momentum * var * n / (n - 1))
        return mean, 1 / torch.sqrt(var + eps)

    def elemt(x, w, b, mean, invstd, eps):
        return (x - v(mean, x)) * v(invstd, x) * v(w, x) + v(b, x)

    def backward_reduce(dy, x, mean, invstd, w, need_input, need_weight, need_bias):
        xmu = x - v(mean, x)
        return dy.sum(dims(x)), (dy * xmu).sum(dims(x)), (dy * xmu * v(invstd, x)).sum(dims(x)), dy.sum(dims(x))

    def backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count):
        n = count.sum()
        return (dy - v(sum_dy / n, x) - (x - v(mean, x)) * v(invstd ** 2 * sum_dy_xmu / n, x)) * v(invstd * w, x)

    return {"batch_norm_stats": stats, "batch_norm_gather_stats_with_counts": gather, "batch_norm_elemt": elemt,
            "batch_norm_backward_reduce": backward_reduce, "batch_norm_backward_elemt": backward_elemt}


def sync_bn_case(ctx, rep, dev, what):
    """Uneven local batches through SyncBatchNorm on `dev` (on the CPU: its synchronized function,
    since the module refuses CPU input) against torch's BatchNorm on the whole batch; returns the
    module, the reference and the local batches."""
    from c10d_ext.horovod.sync_batch_norm import _SyncBatchNorm

    counts = [4 + 3 * q for q in range(ctx.size)]
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, 3, 5, generator=g, dtype=torch.float64) for n in counts]
    gys = [torch.randn(n, 3, 5, generator=g, dtype=torch.float64) for n in counts]
    bn = hvd.SyncBatchNorm(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    ref = nn.BatchNorm1d(3, momentum=0.3).double()
    ref.load_state_dict(bn.state_dict())
    bn.to(dev)
    x = xs[ctx.rank].to(dev, copy=True).requires_grad_()
    if dev.type == "cuda":
        out = bn(x)
    else:
        out = _SyncBatchNorm.apply(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps, bn.momentum)
    out.backward(gys[ctx.rank].to(dev))
    xr = torch.cat(xs).requires_grad_()
    out_ref = ref(xr)
    out_ref.backward(torch.cat(gys))
    lo, n = sum(counts[:ctx.rank]), counts[ctx.rank]
    close(rep, [out.detach().cpu(), x.grad.cpu()], [out_ref[lo:lo + n].detach(), xr.grad[lo:lo + n]],
          f"{what}: output and input gradient", 1e-7, 1e-9)
    close(rep, [bn.running_mean.cpu(), bn.running_var.cpu()], [ref.running_mean, ref.running_var],
          f"{what}: running statistics", 1e-7, 1e-9)
    # weight and bias gradients stay local (the optimizer reduces them): their sum is the whole batch's
    summed = hvd.allreduce(torch.stack([bn.weight.grad, bn.bias.grad]).cpu(), op=hvd.Sum, name=f"{what}.wb")
    close(rep, [summed], [torch.stack([ref.weight.grad, ref.bias.grad])], f"{what}: weight/bias gradients",
          1e-7, 1e-9)
    return bn, ref, xs


@hvd_body
def _body_sync_batch_norm_cpu_kernels(ctx, rep):
    saved = {name: getattr(torch, name) for name in cpu_bn_kernels()}
    for name, fn in cpu_bn_kernels().items():
        setattr(torch, name, fn)
    try:
        sync_bn_case(ctx, rep, torch.device("cpu"), "cpu kernels")
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


def test_sync_batch_norm_synchronization_with_cpu_kernels(run):
    """The synchronized function (what is gathered and reduced, how it is combined) with CPU
    formulas standing in for torch's CUDA-only kernels, against torch's BatchNorm on the whole
    batch. The real kernels and the module's forward are checked by the cuda test below."""
    assert_reports(run(3, _body_sync_batch_norm_cpu_kernels, timeout=120))


@hvd_body
def _body_sync_batch_norm_cuda(ctx, rep):
    dev = torch.device("cuda", 0)
    bn, ref, xs = sync_bn_case(ctx, rep, dev, "cuda")
    rep.check(bn.num_batches_tracked.item() == 1, "num_batches_tracked")
    bn.eval()
    ref.eval()
    close(rep, [bn(xs[0].to(dev)).detach().cpu()], [ref(xs[0]).detach()], "eval mode", 1e-7, 1e-9)
    expect_raise(rep, ValueError, "expected at least 2D input (got 1D input)",
                 lambda: bn(torch.randn(3, device=dev)), "1-D input")


@pytest.mark.cuda
def test_sync_batch_norm_matches_batch_norm_on_the_whole_batch(run):
    assert_reports(run(2, _body_sync_batch_norm_cuda, timeout=180))
