"""Sequence layouts of context parallelism: which global positions each rank holds.

    contiguous: the sequence is cut into W chunks; rank r holds chunk r.
    zigzag:     the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r, concatenated.

Under a causal mask the zigzag layout gives every rank the same amount of work (an early chunk, which sees
few keys, paired with a late one, which sees many); contiguous leaves the last rank with W times the first's.

    shard = shard_sequence(x, rank, world_size, layout="zigzag", dim=1)   # x [.., S, ..] -> [.., S / W, ..]
    full = unshard_sequence([shard_0, ..., shard_{W-1}], layout="zigzag", dim=1)
"""
from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if check_layout(layout) == "zigzag" else 1


def _world(rank, world_size) -> None:
    for name, x in (("rank", rank), ("world_size", world_size)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def check_divisible(seqlen: int, world_size: int, layout: str, name: str = "sequence length") -> int:
    """-> chunk length; ValueError where `seqlen` cannot be cut as `layout` needs (zigzag: 2W equal chunks)."""
    n = chunks_per_rank(layout) * world_size
    if seqlen <= 0 or seqlen % n:
        raise ValueError(f"{name} {seqlen} cannot be sharded with layout={layout!r} over world_size={world_size}: "
                         f"it must be a positive multiple of {n}"
                         + (" (2 * world_size chunks)" if layout == "zigzag" else " (world_size chunks)"))
    return seqlen // n


def segments(rank: int, world_size: int, local_len: int, layout: str) -> list[tuple[int, int, int]]:
    """The shard of `rank` as (local offset, global start, length) runs of consecutive global positions."""
    if layout == "contiguous":
        return [(0, rank * local_len, local_len)]
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]


def global_positions(rank: int, world_size: int, local_len: int, layout: str) -> torch.Tensor:
    """int64 [local_len]: the global position of each local row (for position embeddings such as RoPE)."""
    return torch.cat([torch.arange(g, g + n) for _, g, n in segments(rank, world_size, local_len, layout)])


def _dim(x: torch.Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of {x.dim()} dimensions")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim` (a new contiguous tensor; autograd flows)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_layout(layout)
    _world(rank, world_size)
    dim = _dim(x, dim)
    c = check_divisible(x.shape[dim], world_size, layout, f"x.shape[{dim}] (the sequence length)")
    per = chunks_per_rank(layout)
    parts = [x.narrow(dim, g, n) for _, g, n in segments(rank, world_size, per * c, layout)]
    return torch.cat(parts, dim).contiguous()


def unshard_sequence(shards, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (a list in rank order), undoing shard_sequence."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError("shards must be a non-empty list of tensors, in rank order")
    for n, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{n}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(f"shards[{n}] has shape {tuple(s.shape)}, shards[0] {tuple(shards[0].shape)}")
    check_layout(layout)
    dim = _dim(shards[0], dim)
    w, local = len(shards), shards[0].shape[dim]
    if local % chunks_per_rank(layout):
        raise ValueError(f"shards have length {local} along dim {dim}: layout={layout!r} needs an even length")
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    c = local // 2
    order = [s.narrow(dim, 0, c) for s in shards] + [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(order, dim)
