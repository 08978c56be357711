"""The Hopper kernels' window arithmetic, transcribed here line for line because Gluon kernels do not run on a
CPU -- the backward's `_q_tiles` with WINDOW and the edge test in `_step` (kernels/attn_bwd_hopper.py), the
forward's `_key_tiles` and `_band_edge` (kernels/attn_fwd_hopper.py), each returning what the kernel's returns: for random bands and lengths, every visible
(query, key) pair lies in a tile pair the kernel visits, and a tile visited without the mask holds only visible
pairs.  The GPU tier (test_window_calls_conform in tests/gpu/test_hopper_{fwd,bwd}_gpu.py) checks the kernels."""
from __future__ import annotations

import random

import pytest

from flashport.kernels import attn_fwd_hopper
from flashport.kernels.attn_bwd_hopper import BLOCK_M, BLOCK_N, WG_N
from flashport.kernels.attn_fwd_hopper import TILE, window_bounds
from flashport.spec import dense_spec


def q_tiles(n, sq, win_left, win_right, ragged):
    n_tiles = (sq + BLOCK_M - 1) // BLOCK_M if ragged else sq // BLOCK_M
    n0 = n * BLOCK_N
    j0 = max(n0 - win_right, 0) // BLOCK_M
    n_tiles = min((n0 + BLOCK_N - 1 + win_left) // BLOCK_M + 1, n_tiles)
    return j0, n_tiles - j0


def masked(j, n, wg, win_left, win_right):
    q0, kv0 = j * BLOCK_M, n * BLOCK_N + wg * WG_N
    return (kv0 + win_left < q0 + BLOCK_M - 1) or (kv0 + WG_N - 1 > q0 + win_right)


def bounds(s, window):
    import torch
    q = torch.zeros(1, s, 1, 8)
    spec, _ = dense_spec(q, q, q, causal=False, softmax_scale=None, window_size=window, softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    # a bound that reaches past the sequence is no bound: such a window is "causal" or "none" (other variants)
    return window_bounds(spec) if spec.visibility.kind == "window" else None


def draw(seed, lengths):
    rng, wb = random.Random(seed), None
    while wb is None:
        s = rng.choice(lengths)
        left, right = rng.choice([(rng.randint(0, 700), 0), (rng.randint(0, 700), rng.randint(1, 700)),
                                  (-1, rng.randint(1, 300)), (rng.randint(0, 40), -1)])
        wb = bounds(s, (left, right))
    seen = lambda i, kv: (left < 0 or kv >= i - left) and (right < 0 or kv <= i + right)   # noqa: E731
    return s, wb, seen


@pytest.mark.parametrize("seed", range(40))
def test_walked_tiles_cover_the_band_and_skip_the_mask_only_inside_it(seed):
    s, (win_left, win_right), seen = draw(seed, [128, 200, 256, 300, 512, 640, 777])
    ragged = s % BLOCK_N != 0
    for n in range((s + BLOCK_N - 1) // BLOCK_N):
        lo, count = q_tiles(n, s, win_left, win_right, ragged)
        assert count >= 1, "every K/V tile has a Q tile (its own diagonal)"
        hi = lo + count
        for kv in range(n * BLOCK_N, min((n + 1) * BLOCK_N, s)):
            for i in range(s):
                if seen(i, kv):
                    assert lo <= i // BLOCK_M < hi, (n, kv, i, lo, hi)
        for j in range(lo, hi):
            for wg in (0, 1):
                if not masked(j, n, wg, win_left, win_right):
                    rows = range(j * BLOCK_M, j * BLOCK_M + BLOCK_M)
                    keys = range(n * BLOCK_N + wg * WG_N, n * BLOCK_N + (wg + 1) * WG_N)
                    assert all(seen(i, kv) for i in rows for kv in keys), (n, j, wg)


def key_tiles(pid_m, sk, win_left, win_right, block_n):
    t0 = max(pid_m * TILE - win_left, 0) // block_n
    t_end = min((pid_m * TILE + TILE - 1 + win_right) // block_n + 1, sk // block_n)
    return t0, t_end - t0


def band_edge(row0, kt, win_left, win_right, block_n):
    return (kt * block_n + win_left < row0 + attn_fwd_hopper.BLOCK_M - 1) or (kt * block_n + block_n - 1 > row0 + win_right)


@pytest.mark.parametrize("seed", range(40))
def test_forward_rings_hold_the_band_and_skip_the_mask_only_inside_it(seed):
    s, (win_left, win_right), seen = draw(seed, [128, 256, 384, 512, 768])   # the forward: multiples of 128
    block_n = random.Random(seed).choice(sorted({t.block_n for t in attn_fwd_hopper.TILES.values()}))
    for pid_m in range(s // TILE):
        t0, n = key_tiles(pid_m, s, win_left, win_right, block_n)
        assert n >= 1
        for i in range(pid_m * TILE, (pid_m + 1) * TILE):
            for kv in range(s):
                if seen(i, kv):
                    assert t0 <= kv // block_n < t0 + n, (pid_m, i, kv, t0, n)
        for wg in (0, 1):
            row0 = pid_m * TILE + wg * attn_fwd_hopper.BLOCK_M
            for kt in range(t0, t0 + n):
                if not band_edge(row0, kt, win_left, win_right, block_n):
                    assert all(seen(i, kv) for i in range(row0, row0 + attn_fwd_hopper.BLOCK_M)
                               for kv in range(kt * block_n, (kt + 1) * block_n)), (pid_m, wg, kt)
