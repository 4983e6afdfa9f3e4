"""The one shim over torch.distributed names that changed between PyTorch 2.11 and 2.13.

2.13 renamed `all_gather_into_tensor` -> `all_gather_single` and `reduce_scatter_tensor` ->
`reduce_scatter_single` (the old names remain, deprecated). Everything in autopar calls these.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_to_all_single = dist.all_to_all_single
all_reduce = dist.all_reduce

__all__ = ["all_gather_single", "all_reduce", "all_to_all_single", "reduce_scatter_single"]
