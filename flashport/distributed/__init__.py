"""flashport.distributed: long context beyond one GPU (context parallelism over torch.distributed).

    out = ring_attention(q, k, v, group=None, causal=True, layout="zigzag")   # this rank's shard
    shard = shard_sequence(x, rank, world_size, layout="zigzag", dim=1)
    full = unshard_sequence([shard_0, ..., shard_W-1], layout="zigzag", dim=1)

See ring.py for the algorithm and layout.py for the layouts.
"""
from __future__ import annotations

from .layout import LAYOUTS, global_positions, shard_sequence, unshard_sequence
from .ring import ring_attention

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "global_positions", "LAYOUTS"]
