"""Host-side launch planning of the KV-cache kernel: tile sizes and the flash-decoding split count.

Decoding reads the whole KV cache to produce a handful of query rows, so it is bound by memory
bandwidth, and `batch * kv_heads` programs (one per GQA group) rarely fill a GPU.  Flash-decoding
splits each sequence's keys into `num_splits` chunks processed by separate programs, then merges the
partial results exactly (flashport.kernels.merge).  Everything here is decided from static facts
(shapes, capacity, SM count): sequence lengths live on the device and are never read by the host,
so a decode step stays free of host synchronisation and capturable in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from .. import env

MAX_SPLITS = 128
INTERPRETER_SMS = 2          # a tiny "GPU" so the interpreter tests exercise splitting
# Waves of programs we aim for, by cache layout: a paged program waits on a block-table load before each K/V
# tile, so several must be in flight per SM; a dense one keeps enough loads in flight by itself, and extra
# programs only add merge work and tail (graph-replay sweep, PERFLOG rows 4 and 9).
WAVES = 4           # paged caches
WAVES_DENSE = 1
MIN_TILES_PER_SPLIT = 2      # on a GPU each split streams at least this many BLOCK_N tiles
# A split of a paged cache streams at most this many keys of the capacity.  The lengths live on the device, so the
# host cannot tell ragged batches from uniform ones: bounding every program's keys bounds the longest one, which a
# ragged batch waits for (H200, 64 sequences of 1-16k tokens, pages of 16: 1 split 62% of the copy rate, 8 splits
# 89%; 64 x 4096 uniform: 1 split 94%, 2 splits 92%; PERFLOG row 57).  Dense caches were not measured: the heuristic.
MAX_KEYS_PER_SPLIT = 2048


def waves_for(paged: bool) -> int:
    return WAVES if paged else WAVES_DENSE


def interpreting() -> bool:
    return env.interpreting()


@dataclass(frozen=True)
class DecodeConfig:
    BLOCK_M: int      # packed query rows (G * Sq of one KV head) per program, >= 16 for tl.dot
    BLOCK_N: int      # keys per tile
    BLOCK_D: int      # head dim padded to a power of two
    BLOCK_DV: int
    num_warps: int
    num_stages: int

    def smem_bytes(self, elem_size: int) -> int:
        """Rough shared-memory need: pipelined K and V tiles plus the Q tile."""
        kv = self.num_stages * self.BLOCK_N * (self.BLOCK_D + self.BLOCK_DV) * elem_size
        return kv + self.BLOCK_M * self.BLOCK_D * elem_size


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1, x)))))


@functools.lru_cache(maxsize=64)
def _device_facts(index: int) -> tuple[int, int, tuple[int, int]]:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return props.multi_processor_count, smem, (props.major, props.minor)


def device_facts(device: torch.device) -> tuple[int, int, tuple[int, int]]:
    """(SM count, opt-in shared memory per block in bytes, compute capability) of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_facts(index)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return device_facts(device)[0]


def smem_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30
    return device_facts(device)[1]


@functools.lru_cache(maxsize=1024)
def choose_config(rows: int, head_dim: int, head_dim_v: int, elem_size: int, smem: int,
                  interpreter: bool, block_m: int | None = None, block_n: int | None = None,
                  num_stages: int | None = None, num_warps: int | None = None) -> DecodeConfig | None:
    """Tile sizes for `rows` = G * Sq packed query rows per KV head; None if nothing fits in `smem`.

    Decode is bandwidth-bound: BLOCK_N 64..128 with 2-3 pipeline stages keeps enough loads in flight,
    and BLOCK_M stays small (16 for plain decode) because the packed rows are few.  block_m, block_n
    num_stages and num_warps override the choice (block_n and num_stages are then never lowered to fit)."""
    bd, bdv = _pow2(head_dim), _pow2(head_dim_v)
    bm = block_m or min(64, _pow2(rows))
    if interpreter:  # small tiles: tiny test shapes still span several tiles and splits
        return DecodeConfig(bm, block_n or 16, bd, bdv, num_warps or 4, num_stages or 1)
    bn = block_n or (128 if max(bd, bdv) <= 64 else 64)
    stages = num_stages or (3 if max(bd, bdv) <= 128 else 2)
    warps = num_warps or (8 if bm >= 64 and max(bd, bdv) >= 128 else 4)
    while True:
        cfg = DecodeConfig(bm, bn, bd, bdv, warps, stages)
        if cfg.smem_bytes(elem_size) <= smem:
            return cfg
        if stages > 1 and num_stages is None:
            stages -= 1
        elif bn > 16 and block_n is None:
            bn //= 2
        else:
            return None


def choose_num_splits(programs: int, n_tiles: int, sms: int, min_tiles: int | None = None,
                      max_splits: int = MAX_SPLITS, waves: int | None = None) -> int:
    """How many key chunks per (batch, kv head, row block) program (FlashAttention's heuristic).

    programs: batch * kv_heads * row blocks without splitting; n_tiles: BLOCK_N tiles of the cache
    capacity.  With >= 80% of the WAVES * sms slots already busy, splitting only adds the merge.
    Otherwise pick the smallest split count whose wave efficiency (waves / ceil(waves)) is within
    95% of the best, skipping counts that do not change the tiles per split.  (FlashAttention uses
    85%, which picked a slower count at 1 x 32768: PERFLOG row 12.)  waves / min_tiles = None read
    WAVES / MIN_TILES_PER_SPLIT at call time (so a retune takes effect at once)."""
    return _num_splits(programs, n_tiles, sms, MIN_TILES_PER_SPLIT if min_tiles is None else min_tiles,
                       max_splits, WAVES if waves is None else waves)


@functools.lru_cache(maxsize=1024)
def _num_splits(programs: int, n_tiles: int, sms: int, min_tiles: int, max_splits: int, waves: int) -> int:
    # memoised: a pure function of its arguments, ~30 us of Python per decode call otherwise
    slots = waves * sms
    if programs <= 0 or n_tiles <= 1 or programs >= 0.8 * slots:
        return 1
    limit = max(1, min(max_splits, slots, n_tiles // max(1, min_tiles)))

    def useful(s: int) -> bool:  # s splits do something s - 1 splits did not
        return s == 1 or -(-n_tiles // s) != -(-n_tiles // (s - 1))

    def efficiency(s: int) -> float:
        filled = programs * s / slots
        return filled / math.ceil(filled)

    candidates = [s for s in range(1, limit + 1) if useful(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.95 * best)
