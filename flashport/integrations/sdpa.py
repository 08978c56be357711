"""PyTorch SDPA hook: `torch.nn.attention.activate_flash_attention_impl("flashport")`.

    import flashport                      # registers "flashport" where torch has the registry
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("flashport")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # a call on SDPA's flash path runs flashport
    restore_flash_attention_impl()        # PyTorch's own kernels again

Modelled on torch/nn/attention/_fa4.py: registering only stores `_activate`; activation overrides aten's
flash ops in the dispatcher (a `torch.library.Library`), and the handle's `remove()` destroys that library,
which puts PyTorch's kernels back.  Whatever reaches those ops comes here: SDPA's flash choice,
`torch.nn.attention.bias.causal_lower_right`, PyTorch's context parallelism (which calls them itself).

Ops and their semantics (q, k, v [B, H, S, D] for SDPA's ops, seen as flashport's [B, S, H, D] by a transpose):
- CPU: `_scaled_dot_product_flash_attention_for_cpu` and its backward.  `is_causal` is top-left aligned there
  (query i sees keys 0..i), flashport's is bottom-right: for Sq < Sk only the first Sq keys are visible, so
  flashport gets k[:Sq], v[:Sq] with causal=True (the other keys' gradients are zero); for Sq > Sk it is
  window_size=(-1, Sq - Sk).  lse is float32 (float64 for float64 inputs) [B, H, Sq] over [B, Sq, H] memory,
  the gradients [B, H, S, D] over [B, S, H, D] memory, as aten's own kernel and its meta function give them.
- CUDA: `_scaled_dot_product_flash_attention`, `_flash_attention_forward` (dense and varlen),
  `_flash_attention_forward_no_dropout_inplace` and the backwards.  These are FlashAttention-2's kernels, whose
  `is_causal` and window are bottom-right aligned like flashport's.  Dropout runs flashport's Philox keep-mask
  (the same distribution, not PyTorch's bits): flashport's (seed, offset) travels to the backward in aten's
  uint64 rng_state tensor.
- Refused with UnsupportedError (an exact answer or none): attn_mask (the CPU op; flashport has no additive
  bias), dropout on the CPU ops (they carry no RNG state to the backward), return_debug_mask, seqused_k,
  block_table and alibi_slopes (aten's backward does not receive them).

Recursion: flashport's own `sdpa*` backends call F.scaled_dot_product_attention, which may land on these very
ops.  Every call here selects with state "sdpa_hook", under which dispatch refuses each backend whose
`Capabilities.sdpa_flash_devices` names the call's device, named or auto; the calls also ask for lse
(return_lse), which no SDPA backend exposes.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import serve
from ..dispatch import UnsupportedError
from ..spec import dense_spec, varlen_spec

NAME = "flashport"
STATE = "sdpa_hook"    # dispatch.select_counted's state: no backend whose kernel is an op overridden here
_RESTORE = "torch.nn.attention.restore_flash_attention_impl() puts PyTorch's kernel back"


_failed: list = []     # why register() could not register, where torch has the registry


def _registry():
    import torch.nn.attention as attention
    return attention if hasattr(attention, "register_flash_attention_impl") else None


def reason() -> Optional[str]:
    """Why "flashport" is not in torch's flash-attention registry, or None."""
    attention = _registry()
    if attention is None:
        return f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl"
    if NAME not in attention.list_flash_attention_impls():
        return _failed[-1] if _failed else "not registered (flashport.integrations.sdpa.register())"
    return None


def available() -> bool:
    return reason() is None


def register() -> bool:
    """Register "flashport" with torch's flash-attention registry -> whether it is there.  Only stores a
    function (nothing is overridden until activate_flash_attention_impl) and never raises: flashport's import
    calls it."""
    attention = _registry()
    if attention is None:
        return False
    try:
        attention.register_flash_attention_impl(NAME, register_fn=_activate)
    except Exception as e:  # a registry whose signature changed: say so in `flashport info`, import anyway
        _failed.append(f"registration failed: {e!r}")
        return False
    return True


def status() -> dict:
    """For `flashport info`: the hook "active", "registered" or "missing", with the reason where missing."""
    why = reason()
    if why is not None:
        return {"hook": "missing", "reason": why}
    active = _registry().current_flash_attention_impl() == NAME
    return {"hook": "active" if active else "registered", "reason": None}


class _Handle:
    """What activation returns: remove() takes flashport's kernels out of the dispatcher."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()   # now, not whenever the object is collected
            self.library = None


def _activate() -> _Handle:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # Replacing aten's kernel is the point; torch warns about every override.
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        for key, impls in (("CPU", CPU_IMPLS), ("CUDA", CUDA_IMPLS)):
            for op, fn in impls.items():
                lib.impl(op, fn, key)
    return _Handle(lib)


# ----------------------------------------------------------------------------- running flashport
def _refuse(**why: bool) -> None:
    bad = [name for name, yes in why.items() if yes]
    if bad:
        raise UnsupportedError(f"flashport's SDPA hook cannot serve {', '.join(bad)}; {_RESTORE}")


def _spec(q, k, v, cu, max_q, max_k, dropout_p, causal, window, scale, backward=False):
    """The spec flashport serves; a backward's (the engine runs it without grad mode) needs its gradients."""
    opts = dict(causal=causal, softmax_scale=scale, window_size=window, softcap=0.0, alibi_slopes=None,
                dropout_p=dropout_p, deterministic=torch.are_deterministic_algorithms_enabled(), return_lse=True)
    if cu is None:
        spec, inputs = dense_spec(q, k, v, **opts)
    else:
        spec, inputs = varlen_spec(q, k, v, cu[0], cu[1], max_q, max_k, **opts)
    return (dataclasses.replace(spec, needs_grad=True) if backward else spec), inputs


def _forward(q, k, v, dropout_p, causal, window, scale, cu=None, max_q=0, max_k=0):
    """q, k, v in flashport's layout -> (out, lse for the backward, rng_state or None)."""
    spec, inputs = _spec(q, k, v, cu, max_q, max_k, dropout_p, causal, window, scale)
    out, _, lse, rng = serve.forward_only(spec, inputs, None, STATE)
    return out, lse, rng


def _backward(dout, q, k, v, out, lse, dropout_p, causal, window, scale, rng=None, cu=None, max_q=0, max_k=0):
    spec, inputs = _spec(q, k, v, cu, max_q, max_k, dropout_p, causal, window, scale, backward=True)
    if dropout_p > 0:
        inputs.rng_state = rng
    return serve.backward_only(spec, inputs, None, STATE, out, lse.contiguous(), dout, None)


def _bshd(*ts):
    return tuple(t.transpose(1, 2) for t in ts)


def _laid_out_like(x: Tensor, like: Tensor) -> Tensor:
    """x in `like`'s memory layout (torch.empty_like's, which aten's kernels and meta functions use): x itself
    when it already is, else one copy."""
    out = torch.empty_like(like, dtype=x.dtype)
    return x if out.stride() == x.stride() else out.copy_(x)


# ----------------------------------------------------------------------------- CPU
def _top_left(is_causal: bool, sq: int, sk: int) -> tuple[bool, tuple[int, int], int]:
    """SDPA's top-left causal rule in flashport's terms -> (causal, window_size, keys used)."""
    if not is_causal:
        return False, (-1, -1), sk
    if sq <= sk:
        return True, (-1, -1), sq      # keys past Sq are seen by no query
    return False, (-1, sq - sk), sk


def _cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _refuse(attn_mask=attn_mask is not None, dropout=dropout_p > 0)
    b, h, sq, _ = query.shape
    causal, window, keys = _top_left(is_causal, sq, key.shape[2])
    q, k, v = _bshd(query, key[:, :, :keys], value[:, :, :keys])
    out, lse, _ = _forward(q, k, v, 0.0, causal, window, scale)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    logsumexp = lse.new_empty(b, sq, h, dtype=lse_dtype).transpose(1, 2).copy_(lse)
    return _laid_out_like(out.transpose(1, 2), query), logsumexp


def _cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                  scale=None):
    _refuse(attn_mask=attn_mask is not None, dropout=dropout_p > 0)
    sk = key.shape[2]
    causal, window, keys = _top_left(is_causal, query.shape[2], sk)
    q, k, v, o, do = _bshd(query, key[:, :, :keys], value[:, :, :keys], out, grad_out)
    dq, dk, dv = _backward(do, q, k, v, o, logsumexp, 0.0, causal, window, scale)
    if keys < sk:
        dk, dv = (torch.cat([g, g.new_zeros(g.shape[0], sk - keys, *g.shape[2:])], 1) for g in (dk, dv))
    return tuple(g.contiguous().transpose(1, 2) for g in (dq, dk, dv))   # aten's [B, S, H, D] memory


CPU_IMPLS = {"_scaled_dot_product_flash_attention_for_cpu": _cpu_forward,
             "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_backward}


# ----------------------------------------------------------------------------- CUDA (FlashAttention-2's ops)
def _rng_out(rng, device):
    """flashport's int64 (seed, offset) in aten's uint64 [2] rng_state (zeros without dropout), offset 0."""
    seed = torch.zeros(2, dtype=torch.int64, device=device) if rng is None else rng
    return seed.view(torch.uint64), torch.zeros((), dtype=torch.uint64, device=device)


def _rng_in(rng_state):
    return rng_state.view(torch.int64)


def _fa2_window(is_causal, left, right):
    """FlashAttention-2's (is_causal, window) -> flashport's window_size (both bottom-right aligned)."""
    return (-1 if left is None else left, 0 if is_causal else (-1 if right is None else right))


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                   *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                   block_table=None, num_splits=None):
    # num_splits is a split-KV hint to FlashAttention's kernel; flashport's selection decides that itself.
    _refuse(return_debug_mask=return_debug_mask, seqused_k=seqused_k is not None,
            block_table=block_table is not None, alibi_slopes=alibi_slopes is not None)
    cu = None if cum_seq_q is None else (cum_seq_q, cum_seq_k)
    out, lse, rng = _forward(query, key, value, dropout_p, False, _fa2_window(is_causal, window_size_left,
                             window_size_right), scale, cu, max_q, max_k)
    seed, offset = _rng_out(rng, query.device)
    return (_laid_out_like(out, query), lse.float().contiguous(), seed, offset,
            query.new_empty(0))


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, **kw):
    result, lse, *_ = _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                     return_debug_mask, **kw)
    out.copy_(result)
    return lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    cu = None if cum_seq_q is None or cum_seq_q.numel() == 0 else (cum_seq_q, cum_seq_k)
    grads = _backward(grad_out, query, key, value, out, logsumexp, dropout_p, False,
                      _fa2_window(is_causal, window_size_left, window_size_right), scale, _rng_in(rng_state), cu,
                      max_q, max_k)
    return tuple(_laid_out_like(g, t) for g, t in zip(grads, (query, key, value)))


def _sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _refuse(return_debug_mask=return_debug_mask)
    q, k, v = _bshd(query, key, value)
    out, lse, rng = _forward(q, k, v, dropout_p, is_causal, (-1, -1), scale)
    seed, offset = _rng_out(rng, query.device)
    return (_laid_out_like(out.transpose(1, 2), query), lse.float().contiguous(), None, None, query.shape[2],
            key.shape[2], seed, offset, query.new_empty(0))


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, philox_seed, philox_offset, *, scale=None):
    q, k, v, o, do = _bshd(query, key, value, out, grad_out)
    grads = _backward(do, q, k, v, o, logsumexp, dropout_p, is_causal, (-1, -1), scale, _rng_in(philox_seed))
    return tuple(_laid_out_like(g.transpose(1, 2), t) for g, t in zip(grads, (query, key, value)))


CUDA_IMPLS = {"_scaled_dot_product_flash_attention": _sdpa_flash,
              "_scaled_dot_product_flash_attention_backward": _sdpa_flash_backward,
              "_flash_attention_forward": _flash_forward,
              "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
              "_flash_attention_backward": _flash_backward}
