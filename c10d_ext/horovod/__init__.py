"""Horovod's PyTorch API (``horovod.torch``) on myccl.

Replace ``import horovod.torch as hvd`` with ``import c10d_ext.horovod as hvd``: the rest of a
script stays as it is. CPU tensors travel over myccl's transports, CUDA tensors over its NCCL
engine; Horovod's background negotiation, tensor fusion, process sets, join, timeline and elastic
training are rebuilt on torch.distributed groups of backend "myccl". docs/HOROVOD.md lists every
function with its state and what differs.
"""

from __future__ import annotations

import c10d_ext  # noqa: F401  (registers the "myccl" backend)

from . import elastic  # noqa: F401
from .compression import Compression  # noqa: F401
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: F401
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,  # noqa: F401
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async,  # noqa: F401
                      allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
                      barrier, broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built,
                      cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                      grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, init, is_homogeneous, is_initialized, join,
                      local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                      poll, rank, reducescatter, reducescatter_async, rocm_built, shutdown, size,
                      sparse_allreduce_async, start_timeline, stop_timeline, synchronize)
from .optimizer import DistributedOptimizer  # noqa: F401
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401
from .sync_batch_norm import SyncBatchNorm  # noqa: F401
