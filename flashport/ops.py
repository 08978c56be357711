"""The entry points as torch.library custom ops, for torch.compile.

`torch.compile(fn, fullgraph=True)` of code that calls flashport.attention (or attention_varlen,
attention_with_kvcache) records one opaque op per call: Dynamo never traces flashport's Python, the fake
implementations below give shapes (symbolic ones under dynamic=True, so a new sequence length does not
recompile), and the registered autograd gives the backward as a second op.  Validation and backend
selection run inside the ops, when the compiled graph runs, exactly as in eager mode.

Eager calls do not come through here: a custom op's Python dispatch would only add host time.

The backward op receives the contract's saved state (q, k, v, out, lse) and the dropout seed, so auto
selection prefers plans whose backward runs from it (every flashport kernel); a backend that keeps its own
forward state (PyTorch SDPA's kernels), named or the only one serving a call, recomputes its forward in the
backward.  The outputs are contiguous, as the fake implementations say.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import serve
from .spec import dense_spec, kvcache_spec, varlen_spec

_STATE = "prefer_lse"


def _window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
        return int(left), int(right)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints, got {window_size!r}") from None


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _empty_rng(q: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=q.device)


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The ops' lse output: float64 for float64 inputs, so their backward keeps every digit (the wrappers
    hand the contract's float32 to the caller)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _contiguous(*ts):
    return tuple(t.contiguous() for t in ts)


# ----------------------------------------------------------------------------- dense and varlen
def _spec(kind, q, k, v, cu_q, cu_k, max_q, max_k, opts, needs_grad):
    if kind == "dense":
        spec, inputs = dense_spec(q, k, v, **opts)
    else:
        spec, inputs = varlen_spec(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
    return dataclasses.replace(spec, needs_grad=needs_grad), inputs


def _opts(causal, softmax_scale, left, right, softcap, alibi_slopes, dropout_p, deterministic, return_lse):
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=(left, right), softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic, return_lse=return_lse)


def _forward_impl(kind, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, left, right, softcap,
                  alibi_slopes, dropout_p, deterministic, return_lse, needs_grad, backend):
    opts = _opts(causal, softmax_scale, left, right, softcap, alibi_slopes, dropout_p, deterministic, return_lse)
    spec, inputs = _spec(kind, q, k, v, cu_q, cu_k, max_q, max_k, opts, needs_grad)
    out, _, saved_lse, rng = serve.forward_only(spec, inputs, backend, _STATE)
    return (*_contiguous(out, saved_lse.to(_lse_dtype(q))), _empty_rng(q) if rng is None else rng)


def _backward_impl(kind, dout, dlse, q, k, v, out, lse, rng, cu_q, cu_k, max_q, max_k, causal, softmax_scale, left,
                   right, softcap, alibi_slopes, dropout_p, deterministic, return_lse, backend):
    opts = _opts(causal, softmax_scale, left, right, softcap, alibi_slopes, dropout_p, deterministic, return_lse)
    spec, inputs = _spec(kind, q, k, v, cu_q, cu_k, max_q, max_k, opts, True)
    if dropout_p > 0:
        inputs.rng_state = rng
    grads = serve.backward_only(spec, inputs, backend, _STATE, out, lse, dout, dlse)
    return _contiguous(*grads)


@torch.library.custom_op("flashport::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float], window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
               deterministic: bool, return_lse: bool, needs_grad: bool,
               backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    return _forward_impl("dense", q, k, v, None, None, 0, 0, causal, softmax_scale, window_left, window_right,
                         softcap, alibi_slopes, dropout_p, deterministic, return_lse, needs_grad, backend)


@_attention.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, deterministic,
      return_lse, needs_grad, backend):
    b, sq, hq, _ = q.shape
    out = q.new_empty(b, sq, hq, v.shape[-1])
    lse = q.new_empty(b, hq, sq, dtype=_lse_dtype(q))
    return out, lse, q.new_empty(2 if dropout_p > 0 else 0, dtype=torch.int64)


@torch.library.custom_op("flashport::attention_backward", mutates_args=())
def _attention_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, rng: Tensor, causal: bool, softmax_scale: Optional[float], window_left: int,
                        window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
                        deterministic: bool, return_lse: bool,
                        backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl("dense", dout, dlse, q, k, v, out, lse, rng, None, None, 0, 0, causal, softmax_scale,
                          window_left, window_right, softcap, alibi_slopes, dropout_p, deterministic, return_lse,
                          backend)


@torch.library.custom_op("flashport::attention_varlen", mutates_args=())
def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, causal: bool, softmax_scale: Optional[float], window_left: int,
                      window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
                      deterministic: bool, return_lse: bool, needs_grad: bool,
                      backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    return _forward_impl("varlen", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, deterministic,
                         return_lse, needs_grad, backend)


@_attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, alibi_slopes, dropout_p, deterministic, return_lse, needs_grad, backend):
    total, hq, _ = q.shape
    out = q.new_empty(total, hq, v.shape[-1])
    lse = q.new_empty(hq, total, dtype=_lse_dtype(q))
    return out, lse, q.new_empty(2 if dropout_p > 0 else 0, dtype=torch.int64)


@torch.library.custom_op("flashport::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, rng: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                               window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                               dropout_p: float, deterministic: bool, return_lse: bool,
                               backend: Optional[str]) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl("varlen", dout, dlse, q, k, v, out, lse, rng, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                          dropout_p, deterministic, return_lse, backend)


def _grads_fake(dout, dlse, q, k, v, *rest):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_attention_backward.register_fake(_grads_fake)
_attention_varlen_backward.register_fake(_grads_fake)


_ALIBI = 5   # position of alibi_slopes among the keyword options (causal ... backend)


def _setup(varlen: bool):
    def setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        cu = inputs[3:5] if varlen else ()
        ctx.lengths = tuple(inputs[5:7]) if varlen else ()     # max_seqlen_q, max_seqlen_k
        opts = list(inputs[7 if varlen else 3:])
        del opts[-2]                                           # needs_grad: the backward runs only where it was True
        alibi, opts[_ALIBI] = opts[_ALIBI], None
        ctx.opts = opts
        ctx.n_inputs = len(inputs)
        ctx.set_materialize_grads(False)                       # an unused lse brings no zeros into the backward
        ctx.save_for_backward(q, k, v, *output, alibi, *cu)
    return setup_context


def _backward(op):
    def backward(ctx, dout, dlse, _drng):
        q, k, v, out, lse, rng, alibi, *cu = ctx.saved_tensors
        opts = list(ctx.opts)
        opts[_ALIBI] = alibi
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = op(dout, dlse, q, k, v, out, lse, rng, *cu, *ctx.lengths, *opts)
        return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)
    return backward


_attention.register_autograd(_backward(_attention_backward), setup_context=_setup(varlen=False))
_attention_varlen.register_autograd(_backward(_attention_varlen_backward), setup_context=_setup(varlen=True))


def attention(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic,
              return_lse, backend):
    left, right = _window(window_size)
    out, lse, _ = _attention(q, k, v, bool(causal), softmax_scale, left, right, float(softcap), alibi_slopes,
                             float(dropout_p), bool(deterministic), bool(return_lse), _needs_grad(q, k, v), backend)
    return (out, lse.float()) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, softmax_scale,
                     window_size, softcap, alibi_slopes, dropout_p, deterministic, return_lse, backend):
    left, right = _window(window_size)
    out, lse, _ = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
                                    softmax_scale, left, right, float(softcap), alibi_slopes, float(dropout_p),
                                    bool(deterministic), bool(return_lse), _needs_grad(q, k, v), backend)
    return (out, lse.float()) if return_lse else out


# ----------------------------------------------------------------------------- KV cache (inference)
@torch.library.custom_op("flashport::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                            cache_seqlens: Optional[Tensor], block_table: Optional[Tensor], causal: bool,
                            softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                            alibi_slopes: Optional[Tensor], return_lse: bool,
                            backend: Optional[str]) -> tuple[Tensor, Tensor]:
    spec, inputs, append = kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                        block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                        window_size=(window_left, window_right), softcap=softcap,
                                        alibi_slopes=alibi_slopes, return_lse=return_lse)
    out, lse = serve.kvcache_call(spec, inputs, append, k_cache, v_cache, backend)
    return _contiguous(out, lse)


@_attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale, window_left, window_right,
      softcap, alibi_slopes, return_lse, backend):
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v_cache.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table, causal,
                           softmax_scale, window_size, softcap, alibi_slopes, return_lse, backend):
    if _needs_grad(q, k_cache, v_cache, k, v):
        raise ValueError("attention_with_kvcache is inference-only: q, k_cache, v_cache, k, v must not require grad")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = _window(window_size)
    out, lse = _attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, bool(causal),
                                       softmax_scale, left, right, float(softcap), alibi_slopes, bool(return_lse),
                                       backend)
    return (out, lse) if return_lse else out
