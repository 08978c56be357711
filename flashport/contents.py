"""Index contents on the device: the error flags, `check_errors()`, and `guard()` that makes a call safe.

Index tensors (cu_seqlens, cache_seqlens, block_table) are checked on the host only for CPU tensors or
with FLASHPORT_CHECKS=1: on a GPU that check would synchronise every call.  Without it, the kernels of
flashport.kernels.contents clamp every index into range before any kernel reads or writes through it
(so no access leaves the tensors and the CUDA context survives) and set a flag here, one int32 slot per
argument.  Reading the flags synchronises, so it happens only when asked: `check_errors()`.
"""
from __future__ import annotations


import torch
from . import env

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


def device_kernels():
    """flashport.kernels.contents where Triton can run it (importable, a tested release or
    FLASHPORT_ALLOW_UNTESTED_TRITON=1), else None: the PyTorch versions below serve instead."""
    global _kernels
    if _kernels is None:
        _kernels = False
        try:
            import triton

            from .kernels.versions import is_tested
            if is_tested(triton.__version__) or env.flag("FLASHPORT_ALLOW_UNTESTED_TRITON"):
                from .kernels import contents as _kc
                _kernels = _kc
        except Exception:  # noqa: BLE001 - no (working) Triton in this process
            _kernels = False
    return _kernels or None


_kernels = None


def _flag(device, slot: int, bad: torch.Tensor) -> None:
    f = flags(device)
    f[slot:slot + 1].copy_(torch.maximum(f[slot:slot + 1], bad.any().to(torch.int32).reshape(1)))


def clamp_varlen_torch(cu_q, cu_k, total_q: int, total_k: int, max_q: int, max_k: int):
    """PyTorch twin of kernels.contents.clamp_varlen (no host sync; a few more launches)."""
    out = []
    for cu, total, max_len, slot, slot_max in ((cu_q, total_q, max_q, CU_Q, MAX_Q),
                                               (cu_k, total_k, max_k, CU_K, MAX_K)):
        c = cu.long()
        lens = c[1:] - c[:-1]
        _flag(cu.device, slot, (c < 0) | (c > total) | (c[:1] != 0) | torch.cat([c[:1] < 0, lens < 0]))
        _flag(cu.device, slot_max, lens > max_len)
        out.append(c.clamp(0, total).to(torch.int32))
    return tuple(out)


def clamp_kvcache_torch(cache_seqlens, s_new: int, capacity: int, block_table, num_blocks: int, page: int):
    """PyTorch twin of kernels.contents.clamp_kvcache."""
    ref = cache_seqlens if cache_seqlens is not None else block_table
    seqlens = None
    n_keys = torch.full((ref.shape[0],), capacity, dtype=torch.int64, device=ref.device)
    if cache_seqlens is not None:
        n = cache_seqlens.long() + s_new
        _flag(ref.device, CACHE_SEQLENS, (n < s_new) | (n > capacity))
        n_keys = n.clamp(0, capacity)
        seqlens = n_keys.to(torch.int32)
    table = None
    if block_table is not None:
        cols = torch.arange(block_table.shape[1], device=ref.device)
        used = cols[None, :] < (n_keys[:, None] + page - 1) // page
        _flag(ref.device, BLOCK_TABLE, used & ((block_table < 0) | (block_table >= num_blocks)))
        table = block_table.clamp(0, num_blocks - 1)
    return seqlens, table


def guard(spec, inputs, cache_seqlens=None):
    """The call's index tensors made safe for the kernels (see flashport.kernels.contents): on a GPU without
    FLASHPORT_CHECKS=1, cu_seqlens, the valid key counts and block_table are replaced by clamped copies and
    bad entries flagged.  Elsewhere the host checks of flashport.spec already ran: inputs come back as given.
    cache_seqlens: the lengths before the append (kvcache)."""
    from . import spec as spec_module
    if spec_module.content_checks_enabled(spec.device):   # always true for CPU tensors
        return inputs
    kc = device_kernels()
    clamp_varlen = kc.clamp_varlen if kc else clamp_varlen_torch
    clamp_kvcache = kc.clamp_kvcache if kc else clamp_kvcache_torch
    if spec.kind == "varlen":
        inputs.cu_seqlens_q, inputs.cu_seqlens_k = clamp_varlen(
            inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.q.shape[0], inputs.k.shape[0], spec.seqlen_q,
            spec.seqlen_k)
    elif spec.kind == "kvcache" and (cache_seqlens is not None or spec.paged):
        seqlens, table = clamp_kvcache(cache_seqlens, spec.new_kv, spec.seqlen_k, inputs.block_table,
                                       inputs.k.shape[0], spec.page_block_size)
        if seqlens is not None:
            inputs.seqlens_k = seqlens
        if table is not None:
            inputs.block_table = table
    return inputs
