"""Point-to-point rotation of tensors around the ring of a process group (NCCL on GPU, gloo on CPU).

`Ring.shift(tensors)` posts, for each tensor, an isend to the next rank and an irecv from the previous one
(torch.distributed.batch_isend_irecv) and returns at once, so the caller computes while the block travels;
`.wait()` gives the received tensors.  Every rank of the group must call shift in the same order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Pending:
    def __init__(self, works, buffers):
        self._works, self._buffers = works, buffers

    def wait(self) -> list:
        for w in self._works:
            w.wait()
        return self._buffers


class Ring:
    """rank r sends to r + 1 and receives from r - 1 (mod world size), in the group's own ranks."""

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def shift(self, tensors, tag: int = 0) -> Pending:
        """Send each tensor to the next rank, receive the previous rank's (same shapes and dtypes)."""
        ops, buffers = [], []
        for n, t in enumerate(tensors):
            t = t.contiguous()
            buf = torch.empty_like(t)
            # distinct tags: gloo matches messages by tag; NCCL ignores them and keeps posting order
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + n))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group, tag + n))
            buffers.append(buf)
        return Pending(dist.batch_isend_irecv(ops), buffers)
