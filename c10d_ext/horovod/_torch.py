"""torch.distributed's single-tensor collectives under the names this torch prefers: newer
releases call `all_gather_into_tensor` / `reduce_scatter_tensor` deprecated in favour of the
`_single` forms, so the layer's own calls never make torch warn in a user's job."""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
