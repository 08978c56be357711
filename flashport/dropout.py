"""The dropout keep-mask shared by every flashport backend: a pure function of (seed, offset, b, h, i, j).

Philox-4x32-10 (the generator of Triton's `tl.philox` and of cuRAND) with key = the 64-bit seed and
counter = (j, i, b * Hq + h, offset); the element is kept iff the top 24 bits of the first output
word are >= round(p * 2**24).  The comparison is integer-exact, so the Triton kernels and this
PyTorch version produce the same mask bit for bit, and `reference` can check dropout exactly.
"""
from __future__ import annotations

from typing import Optional

import torch

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
MASK32 = 0xFFFFFFFF
N_ROUNDS = 10


def threshold24(p: float) -> int:
    """Keep iff (philox_word >> 8) >= threshold24(p): P(keep) = 1 - p up to 2**-24."""
    return min(int(round(p * (1 << 24))), (1 << 24))


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) & MASK32 for a < 2**32 constant, b uint32 held in int64 (no overflow)."""
    x = b & 0xFFFF
    y = b >> 16
    ax, ay = a * x, a * y  # each < 2**48
    hi = (ay + (ax >> 16)) >> 16
    lo = (((ay & 0xFFFF) << 16) + ax) & MASK32
    return hi, lo


def philox_word0(seed: torch.Tensor, c0, c1, c2, c3) -> torch.Tensor:
    """First output word of Philox-4x32-10 (as int64 in [0, 2**32)); counters broadcast."""
    seed = seed.to(torch.int64)
    k0 = seed & MASK32
    k1 = (seed >> 32) & MASK32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=seed.device)
                                               & MASK32 for c in (c0, c1, c2, c3)))
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0


def keep_mask(rng_state: torch.Tensor, p: float, b, h, i, j, heads_q: int) -> torch.Tensor:
    """Bool keep-mask broadcast over index tensors b, h, i, j (positions within each sequence)."""
    seed, offset = rng_state[0], rng_state[1]
    bh = torch.as_tensor(b, device=rng_state.device) * heads_q + torch.as_tensor(h, device=rng_state.device)
    word = philox_word0(seed, j, i, bh, offset)
    return (word >> 8) >= threshold24(p)


def dense_keep_mask(rng_state: torch.Tensor, p: float, batch: int, heads_q: int, sq: int, sk: int,
                    batch_index: Optional[int] = None) -> torch.Tensor:
    """The full [B, Hq, Sq, Sk] keep-mask (small shapes only; for tests and the reference)."""
    dev = rng_state.device
    bs = torch.arange(batch, device=dev) if batch_index is None else torch.tensor([batch_index], device=dev)
    return keep_mask(rng_state, p, bs[:, None, None, None], torch.arange(heads_q, device=dev)[None, :, None, None],
                     torch.arange(sq, device=dev)[None, None, :, None], torch.arange(sk, device=dev)[None, None, None, :],
                     heads_q)


def draw_rng_state(device: torch.device) -> torch.Tensor:
    """(seed, offset) as int64 [2] on `device`, drawn from that device's default generator, so
    torch.manual_seed reproduces a run and nothing synchronises with the host."""
    seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
    offset = torch.randint(0, 2**31, (1,), device=device, dtype=torch.int64)
    return torch.cat([seed, offset])
