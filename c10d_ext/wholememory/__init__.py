"""Whole-memory tensors on myccl, with the WholeMemory PyTorch API's names: one tensor spread over
a process group's memory, read and written by every rank (docs/WHOLEMEMORY.md).

    import c10d_ext.wholememory as wm
    emb = wm.create_wm_tensor(None, [rows, dim], [], torch.float32, wm.WmTensorType.DISTRIBUTED)
    rows = wm.gather(emb, idx)          # collective for DISTRIBUTED, local for HOST / CHUNKED
    wm.scatter(emb, rows * 0.5, idx)

Without torch.distributed's default group, tensors go on a communicator (comm.py): init_lib(),
get_unique_id() on one rank, the id passed on by the script, create_communicator(size, id, rank).
"""

from .access import gather, scatter
from .comm import (Communicator, barrier, broadcast_unique_id_array, broadcast_unique_id_array_by_continuous_group,
                   create_communicator, create_global_communicator, create_intra_node_communicator,
                   destroy_communicator, finalize_lib, get_rank, get_size, get_unique_id, init_lib)
from .files import create_wm_tensor_from_file, load_from_files, part_file_name, save_to_files
from .tensor import (ChunkedTensor, DistributedTensor, NCCLTensor, WmTensorType, create_wm_tensor,
                     get_local_tensor, get_partition_plan, get_tensor_view, get_wm_communicator,
                     get_wm_tensor_type, is_wm_tensor, local_partition)

__all__ = ["WmTensorType", "ChunkedTensor", "DistributedTensor", "NCCLTensor", "create_wm_tensor",
           "get_tensor_view", "local_partition", "get_partition_plan", "get_wm_tensor_type", "is_wm_tensor",
           "get_wm_communicator", "get_local_tensor", "init_lib", "finalize_lib", "gather", "scatter",
           "load_from_files", "save_to_files", "part_file_name", "create_wm_tensor_from_file",
           "Communicator", "get_unique_id", "create_communicator", "destroy_communicator", "get_rank", "get_size",
           "barrier", "broadcast_unique_id_array", "broadcast_unique_id_array_by_continuous_group",
           "create_global_communicator", "create_intra_node_communicator"]

# pylibwholegraph.torch's names (a script changes `import pylibwholegraph.torch as wgth` to
# `import c10d_ext.wholememory as wgth`): communicators, WholeMemoryTensor, embeddings, optimizers, caches.
from . import wg_comm as _wg_comm, wg_tensor as _wg_tensor, embedding as _embedding  # noqa: E402
from .wg_comm import *  # noqa: E402,F401,F403
from .wg_tensor import *  # noqa: E402,F401,F403
from .embedding import *  # noqa: E402,F401,F403

# (destroy_communicator is in both generations: wg_comm's takes either kind of communicator)
__all__ += [n for n in _wg_comm.__all__ + _wg_tensor.__all__ + _embedding.__all__ if n not in __all__]
