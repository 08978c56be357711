"""Index contents on the device: the error flags, `check_errors()`, and `guard()` that makes a call safe.

Index tensors (cu_seqlens, cache_seqlens, block_table) are checked on the host only for CPU tensors or
with FLASHPORT_CHECKS=1: on a GPU that check would synchronise every call.  Without it, the kernels of
flashport.kernels.contents clamp every index into range before any kernel reads or writes through it
(so no access leaves the tensors and the CUDA context survives) and set a flag here, one int32 slot per
argument.  Reading the flags synchronises, so it happens only when asked: `check_errors()`.
"""
from __future__ import annotations

import torch

# Slot -> (argument, what was wrong).  The slot numbers are the kernels' constexpr FLAG_* values.
FLAGS = (
    ("cu_seqlens_q", "entries outside [0, q.shape[0]] or decreasing"),
    ("cu_seqlens_k", "entries outside [0, k.shape[0]] or decreasing"),
    ("max_seqlen_q", "smaller than a sequence length in cu_seqlens_q (rows past it were not computed)"),
    ("max_seqlen_k", "smaller than a sequence length in cu_seqlens_k"),
    ("cache_seqlens", "negative, or cache_seqlens + S_new past the cache's capacity (tokens past it dropped)"),
    ("block_table", "an entry in use outside [0, num_blocks)"),
)
CU_Q, CU_K, MAX_Q, MAX_K, CACHE_SEQLENS, BLOCK_TABLE = range(len(FLAGS))


class DeviceError(ValueError):
    """A kernel saw bad index contents (see `check_errors`); the message names the arguments."""


_flags: dict = {}   # torch.device -> int32 [len(FLAGS)] on that device, zero while nothing was flagged


def flags(device: torch.device) -> torch.Tensor:
    """The flag slots of `device` (allocated on first use; kernels store 1 into a slot, never 0)."""
    t = _flags.get(device)
    if t is None:
        t = _flags[device] = torch.zeros(len(FLAGS), dtype=torch.int32, device=device)
    return t


def check_errors() -> None:
    """Raise DeviceError if any kernel flagged bad contents since the last check, and clear the flags.
    Synchronises with every device that has flags."""
    bad = []
    for device, t in _flags.items():
        seen = t.tolist()
        if any(seen):
            t.zero_()
            bad += [f"{FLAGS[i][0]} ({FLAGS[i][1]}) on {device}" for i, v in enumerate(seen) if v]
    if bad:
        raise DeviceError("bad index contents reached the device; the kernels clamped them (no memory outside "
                          "the tensors was touched) but the results of those calls are not meaningful: "
                          + "; ".join(bad) + ". FLASHPORT_CHECKS=1 checks them before the launch instead.")


def guard(spec, inputs, cache_seqlens=None):
    """The call's index tensors made safe for the kernels (see flashport.kernels.contents): on a GPU without
    FLASHPORT_CHECKS=1, cu_seqlens, the valid key counts and block_table are replaced by clamped copies and
    bad entries flagged.  Elsewhere the host checks of flashport.spec already ran: inputs come back as given.
    cache_seqlens: the lengths before the append (kvcache)."""
    from . import spec as spec_module
    if spec_module.content_checks_enabled(spec.device):   # always true for CPU tensors
        return inputs
    from .kernels import contents as kc
    if spec.kind == "varlen":
        inputs.cu_seqlens_q, inputs.cu_seqlens_k = kc.clamp_varlen(
            inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.q.shape[0], inputs.k.shape[0], spec.seqlen_q,
            spec.seqlen_k)
    elif spec.kind == "kvcache" and (cache_seqlens is not None or spec.paged):
        seqlens, table = kc.clamp_kvcache(cache_seqlens, spec.new_kv, spec.seqlen_k, inputs.block_table,
                                          inputs.k.shape[0], spec.page_block_size)
        if seqlens is not None:
            inputs.seqlens_k = seqlens
        if table is not None:
            inputs.block_table = table
    return inputs
