"""Public entry points: validate -> spec -> dispatch -> backend.  See ../DESIGN.md for the contract."""
from __future__ import annotations

import dataclasses

import torch

from . import dispatch, monitor, rollout
from .contents import guard as guard_contents
from .dropout import draw_rng_state
from .kvcache import append_kv, restore_kv
from .merge import merge_states_torch, validate_states
from .spec import dense_spec, kvcache_spec, varlen_spec


def _finish(out, lse, return_lse):
    return (out, lse) if return_lse else out


def _with_rng(spec, inputs):
    if spec.dropout_p > 0:
        inputs.rng_state = draw_rng_state(spec.device)
    return inputs


def _serve(spec, inputs, plan, fallback):
    """Run the plan inside its profiler range, count it, and let the guard sample it."""
    name = plan.fwd.name
    monitor.add(name, calls=1, forward=1, fallbacks=int(fallback), flops=monitor.flops(spec),
                bytes_read=monitor.bytes_read(inputs))
    monitor.peak(name, plan.fwd.extra_bytes(spec, "fwd"))
    if spec.needs_grad:
        monitor.peak(plan.bwd.name, plan.bwd.extra_bytes(spec, "bwd"))
    own = spec.needs_grad and plan.fwd.caps.saved_state == "own"
    if own:   # its backward runs in its own autograd: bracket it to give it a range and a count
        rng, q, k, v = monitor.bracket_inputs(spec, name, inputs.q, inputs.k, inputs.v)
        inputs = dataclasses.replace(inputs, q=q, k=k, v=v)
    try:
        with monitor.ranged(spec, name):
            out, lse = plan.run(spec, inputs)
    except Exception:
        monitor.add(name, errors=1)
        raise
    if own:
        out = monitor.bracket_output(rng, out)
    check, tolerance = rollout.sampled()
    if check:
        rollout.check(spec, inputs, out, name, tolerance)
    return out, lse


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False, backend=None):
    """Exact softmax attention.  q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv].

    Equivalent PyTorch math (per batch b and query head h, kv head g = h // (Hq // Hkv)):
        s = softmax_scale * q[b, :, h] @ k[b, :, g].T   (then softcap, ALiBi, visibility mask)
        out[b, :, h] = softmax(s, -1) @ v[b, :, g]
    Returns out [B, Sq, Hq, Dv] in q's dtype, and with return_lse also lse [B, Hq, Sq] float32.
    """
    spec, inputs = dense_spec(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                              deterministic=deterministic, return_lse=return_lse)
    plan, fallback = dispatch.select_counted(spec, backend)
    out, lse = _serve(spec, _with_rng(spec, inputs), plan, fallback)
    return _finish(out, lse, return_lse)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     deterministic=False, return_lse=False, backend=None):
    """Packed variable-length attention.  q [total_q, Hq, D], k/v [total_k, Hkv, D|Dv],
    cu_seqlens_* int32 [B + 1].  Sequence b uses rows cu_seqlens[b]:cu_seqlens[b+1]; rows past
    cu_seqlens_q[-1] come back as zeros.  Returns out [total_q, Hq, Dv] (and lse [Hq, total_q])."""
    spec, inputs = varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                               return_lse=return_lse)
    plan, fallback = dispatch.select_counted(spec, backend)
    out, lse = _serve(spec, _with_rng(spec, guard_contents(spec, inputs)), plan, fallback)
    return _finish(out, lse, return_lse)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, return_lse=False, backend=None):
    """Inference attention over a KV cache, appending new tokens k/v [B, S_new, Hkv, D] in place at
    cache_seqlens first.  Dense cache [B, S_cache, Hkv, D]; paged cache [num_blocks, block_size, Hkv, D]
    with block_table int32 [B, max_blocks].  Batch entry b attends to its first cache_seqlens[b] + S_new
    positions with bottom-right alignment.  Returns out [B, Sq, Hq, Dv] (and lse [B, Hq, Sq])."""
    spec, inputs, (k_new, v_new, cache_seqlens) = kvcache_spec(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        return_lse=return_lse)
    plan, fallback = dispatch.select_counted(spec, backend)  # a rejected call writes nothing into the cache
    table = inputs.block_table   # as given (the append skips out-of-range entries itself), before guard clamps it
    inputs = guard_contents(spec, inputs, cache_seqlens)
    with torch.no_grad():
        # The slots the append overwrites come back, so a call that fails after it leaves the cache as it was.
        saved = append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, table, save=True)
        try:
            out, lse = _serve(spec, inputs, plan, fallback)
        except BaseException:
            restore_kv(k_cache, v_cache, saved, cache_seqlens, table)
            raise
    return _finish(out, lse, return_lse)


def merge_attention_states(outs, lses):
    """Exact merge of partial results over disjoint key sets: outs [B, Sq, Hq, Dv], lses [B, Hq, Sq]
    float32 -> (out in outs' dtype, lse float32).  Parts with lse = -inf contribute nothing."""
    validate_states(outs, lses)
    # The Triton merge has no backward: a differentiable call takes the PyTorch merge, exact as well.
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*outs, *lses))
    if outs[0].is_cuda and not needs_grad:
        try:
            from .kernels.merge import merge_states_triton
        except ImportError:  # no Triton in this process: the PyTorch merge is exact too
            merge_states_triton = None
        if merge_states_triton is not None:
            return merge_states_triton(outs, lses)
    return merge_states_torch(outs, lses)
