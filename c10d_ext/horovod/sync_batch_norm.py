"""SyncBatchNorm (Horovod's ``horovod.torch.sync_batch_norm``): batch normalization whose batch
statistics are those of the whole global batch, gathered from every rank of the global process
set. GPU input only, as in Horovod (the statistics kernels it uses are CUDA kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import Function
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import Sum, allgather_async, allreduce_async, size, synchronize


class SyncBatchNorm(_BatchNorm):
    """N-dimensional batch normalization with statistics synchronized across the ranks during
    the forward pass (useful when each GPU holds only a few examples). Arguments as in
    ``torch.nn.BatchNorm2d``. Training mode takes CUDA input only; eval mode with running
    statistics is a plain local batch norm (also on CUDA input only).

    The weight and bias gradients are local; a gradient reduction (DistributedOptimizer)
    combines them.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError('expected at least 2D input (got {}D input)'.format(input.dim()))

    def _run_bn(self, input):
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training or not self.track_running_stats, self.momentum, self.eps)

    @torch.jit.unused
    def _maybe_run_sync_bn(self, input):
        if size() == 1:
            return self._run_bn(input)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                    self.eps, self.momentum)

    def forward(self, input):
        if not input.is_cuda:
            raise ValueError('SyncBatchNorm expected input tensor to be on GPU')
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked = self.num_batches_tracked + 1
        if not self.training and self.track_running_stats:
            return self._run_bn(input)
        return self._maybe_run_sync_bn(input)


class _SyncBatchNorm(Function):
    """The synchronized function: every rank's (count, mean, invstd) per channel are
    allgathered and combined into the global ones (which also update the running statistics);
    in the backward the two per-channel sums the input gradient needs are allreduced."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        input = input.contiguous()
        count = torch.tensor([input.numel() // input.size(1)])
        mean, invstd = torch.batch_norm_stats(input, eps)

        handles = [allgather_async(count.unsqueeze(0), name='sync_batch_norm.count'),
                   allgather_async(mean.unsqueeze(0), name='sync_batch_norm.mean'),
                   allgather_async(invstd.unsqueeze(0), name='sync_batch_norm.invstd')]
        count_all, mean_all, invstd_all = (synchronize(h) for h in handles)

        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            input, mean_all, invstd_all, running_mean, running_var, momentum, eps,
            count_all.view(-1).float().to(input.device))

        ctx.save_for_backward(input, weight, mean, invstd, count_all)
        return torch.batch_norm_elemt(input, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous()
        saved_input, weight, mean, invstd, count_all = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[0:3]

        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            grad_output, saved_input, mean, invstd, weight, need_input, need_weight, need_bias)

        grad_input = None
        if need_input:
            h_dy = allreduce_async(sum_dy, op=Sum, name='sync_batch_norm.sum_dy')
            h_dy_xmu = allreduce_async(sum_dy_xmu, op=Sum, name='sync_batch_norm.sum_dy_xmu')
            sum_dy = synchronize(h_dy)
            sum_dy_xmu = synchronize(h_dy_xmu)
            counts = count_all.to(dtype=torch.int, device=grad_output.device)
            grad_input = torch.batch_norm_backward_elemt(grad_output, saved_input, mean, invstd, weight,
                                                         sum_dy, sum_dy_xmu, counts)

        if weight is None or not need_weight:
            grad_weight = None
        if weight is None or not need_bias:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None
