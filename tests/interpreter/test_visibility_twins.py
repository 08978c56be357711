"""The jit twins of flashport.masks.Visibility in kernels/common.py (key_range, full_key_range, query_range,
full_query_range, key_tiles, query_tiles) return what the host methods return, tile by tile, in the
interpreter.  tests/test_visibility.py holds the host methods to the rule; this holds the kernels' copies
to the host, so the two together tie the kernels' loop bounds to the rule."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flashport.kernels.common import (full_key_range, full_query_range, key_range, key_tiles,  # noqa: E402
                                      query_range, query_tiles)
from flashport.masks import Visibility  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
]


@triton.jit
def _ranges_kernel(Out, sq, sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Program t: row 2t holds query tile t's ranges and walk, row 2t + 1 key tile t's."""
    t = tl.program_id(0)
    diag = sk - sq
    start_m = t * BLOCK_M
    m_end = tl.minimum(start_m + BLOCK_M, sq)
    a, b = key_range(start_m, m_end, sk, diag, left, right, HAS_LEFT, HAS_RIGHT)
    c, d = full_key_range(start_m, m_end, sk, diag, left, right, HAS_LEFT, HAS_RIGHT)
    e, f, g, h = key_tiles(start_m, sq, sk, diag, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    row = Out + t * 16
    tl.store(row + 0, a)
    tl.store(row + 1, b)
    tl.store(row + 2, c)
    tl.store(row + 3, d)
    tl.store(row + 4, e)
    tl.store(row + 5, f)
    tl.store(row + 6, g)
    tl.store(row + 7, h)
    start_n = t * BLOCK_N
    n_end = tl.minimum(start_n + BLOCK_N, sk)
    a, b = query_range(start_n, n_end, sq, diag, left, right, HAS_LEFT, HAS_RIGHT)
    c, d = full_query_range(start_n, n_end, sq, diag, left, right, HAS_LEFT, HAS_RIGHT)
    e, f, g, h = query_tiles(start_n, sq, sk, diag, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    tl.store(row + 8, a)
    tl.store(row + 9, b)
    tl.store(row + 10, c)
    tl.store(row + 11, d)
    tl.store(row + 12, e)
    tl.store(row + 13, f)
    tl.store(row + 14, g)
    tl.store(row + 15, h)


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 64), (64, 16)])
def test_jit_twins_match_the_host(block_m, block_n):
    for sq, sk, left, right in itertools.product((1, 7, 33, 100), (1, 16, 33, 100), (-1, 0, 3, 40), (-1, 0, 5)):
        vis = Visibility(sq, sk, left, right)
        tiles = max(-(-sq // block_m), -(-sk // block_n))
        out = torch.full((tiles, 16), -12345, dtype=torch.int32)
        _ranges_kernel[(tiles,)](out, sq, sk, left, right, BLOCK_M=block_m, BLOCK_N=block_n,
                                 HAS_LEFT=vis.has_left, HAS_RIGHT=vis.has_right)
        for t in range(tiles):
            got = out[t].tolist()
            m0, n0 = t * block_m, t * block_n
            if m0 < sq:    # the kernels launch query tiles below Sq only
                m1 = min(m0 + block_m, sq)
                want = [*vis.key_range(m0, m1), *vis.full_key_range(m0, m1), *vis.key_tiles(m0, block_m, block_n)]
                assert got[:8] == want, (sq, sk, left, right, "query tile", t)
            if n0 < sk:    # and key tiles below Sk
                n1 = min(n0 + block_n, sk)
                want = [*vis.query_range(n0, n1), *vis.full_query_range(n0, n1),
                        *vis.query_tiles(n0, block_m, block_n)]
                assert got[8:] == want, (sq, sk, left, right, "key tile", t)
