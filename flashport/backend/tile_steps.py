"""The inner steps of `blockwise` on its plain tiles (no softcap, ALiBi, dropout or mods), as pure functions that
torch.compile fuses on a CPU.

Eager PyTorch runs one tile as about eight passes over a [rows, BLOCK_N] float32 tile (product, scale, row max,
subtract, exp, row sum, rescale, the second product), each a trip through memory and a dispatch to the thread
pool.  Inductor keeps the two products as BLAS calls and fuses the passes between them into one loop, which is
most of the distance to PyTorch's own C++ CPU kernel (PERFLOG row 40).  The compiled and the eager paths run
these same functions, so they agree to rounding; masked entries become -inf after the scale, so either sign of
the scale is exact.

When: on a CPU, by the switch FLASHPORT_CPU_COMPILE -- "auto" (default) compiles for calls of at least
AUTO_MIN_SCORES scores (B * Hq * Sq * Sk), where a first compile of ~2-6 s is paid back within a few calls;
"1" always, "0" never.  Compiled once per step with dynamic shapes (edge tiles, new lengths and batches reuse
it).  A compile that fails (no C++ compiler, an Inductor error) is reported once as a warning and the process
keeps the eager steps.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from .. import env

AUTO_MIN_SCORES = 1 << 25          # e.g. H=4 at S=2896: about 0.1 s of eager work per call
# Query rows per tile when compiled: with the passes fused, 256-row tiles measured faster than 128 on the 2-core
# CPU (fewer calls, each still cache-sized); the eager loop keeps blockwise.BLOCK_M.
BLOCK_M = 256
_NEG_INF = float("-inf")
_compiled: dict = {}
_failed: list = []


def forward_step(q_t, k_t, v_t, m_i, l_i, acc, scale, hidden: Optional[torch.Tensor]):
    """One key tile of the online softmax: q_t [B, Hkv, R, D], k_t / v_t [B, Hkv, N, D|Dv], running max m_i and
    sum l_i [B, Hkv, R], acc [B, Hkv, R, Dv]; hidden: bool [R, N] of hidden pairs, or None on a full tile.
    -> (m_i, l_i, acc) after the tile."""
    s = (q_t @ k_t.transpose(-1, -2)) * scale
    if hidden is not None:
        s = s.masked_fill(hidden, _NEG_INF)
    return online_softmax(s, v_t, m_i, l_i, acc)


def online_softmax(s, v_t, m_i, l_i, acc, keep: Optional[torch.Tensor] = None):
    """The online-softmax update by one tile of final scores s [B, Hkv, R, N] (hidden pairs at -inf), shared with
    blockwise's general loop: -> (m_i, l_i, acc).  keep: dropout's keep-mask already divided by (1 - p), or None;
    the normaliser l_i sums the undropped probabilities."""
    m_new = torch.maximum(m_i, s.amax(-1))
    # a row that has seen no visible key yet keeps m = -inf; subtracting 0 keeps exp(-inf) = 0, never NaN
    m_safe = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
    p = torch.exp(s - m_safe[..., None])
    alpha = torch.exp(m_i - m_safe)
    l_i = l_i * alpha + p.sum(-1)
    if keep is not None:
        p = p * keep
    return m_new, l_i, acc * alpha[..., None] + p @ v_t


def backward_step(q_t, k_t, v_t, do_t, lse_t, delta_t, scale, hidden: Optional[torch.Tensor]):
    """One tile of the backward from the saved lse (+inf on rows that see nothing, so p = 0 there):
    -> (dq, dk, dv) contributions, dq and dk without the final factor `scale` (the caller's)."""
    s = (q_t @ k_t.transpose(-1, -2)) * scale
    if hidden is not None:
        s = s.masked_fill(hidden, _NEG_INF)
    p = torch.exp(s - lse_t[..., None])
    ds = p * (do_t @ v_t.transpose(-1, -2) - delta_t[..., None])
    return ds @ k_t, ds.transpose(-1, -2) @ q_t, p.transpose(-1, -2) @ do_t


def _wanted(device: torch.device, scores: int) -> bool:
    if device.type != "cpu" or _failed or torch.compiler.is_compiling():
        return False
    mode = env.value("FLASHPORT_CPU_COMPILE")
    return mode == "1" or (mode == "auto" and scores >= AUTO_MIN_SCORES)


def _guarded(name: str, fn: Callable) -> Callable:
    compiled = _compiled.get(name)
    if compiled is None:
        compiled = _compiled[name] = torch.compile(fn, dynamic=True)

    def run(*args):
        if not _failed:
            try:
                with torch.no_grad():
                    return compiled(*args)
            except Exception as e:  # noqa: BLE001  (no compiler, an Inductor error: the eager step is the same math)
                _failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                warnings.warn(f"flashport blockwise: torch.compile of its CPU tile steps failed ({_failed[0]}); "
                              f"running them eagerly (FLASHPORT_CPU_COMPILE=0 silences this)", RuntimeWarning,
                              stacklevel=3)
        return fn(*args)
    return run


def steps(device: torch.device, scores: int) -> tuple[Callable, Callable, bool]:
    """(forward_step, backward_step, compiled) for a call of `scores` scores on `device`."""
    if not _wanted(device, scores):
        return forward_step, backward_step, False
    return _guarded("forward", forward_step), _guarded("backward", backward_step), True


def status() -> str:
    """One line for reports: the switch and whether compiling failed in this process."""
    mode = env.value("FLASHPORT_CPU_COMPILE")
    return f"FLASHPORT_CPU_COMPILE={mode}" + (f" (failed: {_failed[0]}; eager)" if _failed else "")
