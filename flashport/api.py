"""Public entry points: validate -> spec -> dispatch -> backend.  See ../DESIGN.md for the contract."""
from __future__ import annotations

import torch

from . import monitor, ops, plan_cache, serve
from .merge import MergeStates, merge_states_torch, validate_states
from .programmable import builtin_documents, builtin_prefix, builtin_sinks
from .spec import dense_spec, kvcache_inputs, kvcache_spec, varlen_spec

# Under torch.compile each entry point is one custom op (flashport/ops.py): Dynamo never traces this module's
# Python, and backend selection runs when the compiled graph runs, not at trace time.
_compiling = torch.compiler.is_compiling


def _finish(out, lse, return_lse):
    return (out, lse) if return_lse else out


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False, backend=None,
              score_mod=None, mask_mod=None, block_mask=None, attn_bias=None):
    """Exact softmax attention.  q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv].

    Equivalent PyTorch math (per batch b and query head h, kv head g = h // (Hq // Hkv)):
        s = softmax_scale * q[b, :, h] @ k[b, :, g].T   (then softcap, ALiBi, visibility mask)
        out[b, :, h] = softmax(s, -1) @ v[b, :, g]
    Returns out [B, Sq, Hq, Dv] in q's dtype, and with return_lse also lse [B, Hq, Sq] float32.

    Programmable attention (FlexAttention's signatures; flashport/programmable.py has the pipeline):
        score_mod(score, b, h, q_idx, kv_idx) -> score   applied after softcap and ALiBi
        attn_bias: floating, broadcastable to [B, Hq, Sq, Sk], added after score_mod
        mask_mod(b, h, q_idx, kv_idx) -> bool            ANDed with the built-in visibility rule
        block_mask: from flashport.create_block_mask (or torch's); brings its mask_mod
    Gradients reach attn_bias and tensors score_mod captures when they require grad.
    """
    mods = score_mod is not None or mask_mod is not None or block_mask is not None or attn_bias is not None
    if _compiling() and mods:
        raise NotImplementedError("flashport.attention with score_mod / mask_mod / block_mask / attn_bias does not "
                                  "trace under torch.compile yet; call it outside the compiled region, or pass a "
                                  "built-in rule as its keyword (causal=, window_size=, alibi_slopes=, softcap=), "
                                  "which traces")
    if _compiling():
        return ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             deterministic=deterministic, return_lse=return_lse, backend=backend)
    key = None if mods else plan_cache.dense_key(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes,
                                                 dropout_p, deterministic, return_lse, backend)
    hit = plan_cache.get(key)
    if hit is not None:   # this description was validated and planned before
        return _finish(*serve.run_launch(hit, plan_cache.inputs(q, k, v)), return_lse)
    spec, inputs = dense_spec(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                              deterministic=deterministic, return_lse=return_lse, score_mod=score_mod,
                              mask_mod=mask_mod, block_mask=block_mask, attn_bias=attn_bias,
                              builtin_rules=backend is None)
    for rule in inputs.extra.get("rewritten", ()):
        monitor.count_rewrite(rule)
    if backend is None and inputs.prog is not None and not spec.dropout_p:
        docs = builtin_documents(inputs.prog, spec.batch, spec.heads_q, spec.seqlen_q, spec.seqlen_k, spec.device)
        if docs is not None:
            monitor.count_rewrite("documents")
            return _documents_as_varlen(q, k, v, docs, spec, inputs.alibi_slopes, deterministic, return_lse)
        prefix = (builtin_prefix(inputs.prog, spec.batch, spec.heads_q, spec.seqlen_q, spec.seqlen_k)
                  if spec.window_left == spec.window_right == -1 else None)
        if prefix is not None:
            monitor.count_rewrite("prefix")
            return _prefix_as_two_calls(q, k, v, prefix, spec, inputs.alibi_slopes, deterministic, return_lse)
        sinks = (builtin_sinks(inputs.prog, spec.seqlen_q, spec.seqlen_k) if spec.window_left == -1
                 and spec.window_right in (-1, 0) and spec.alibi is None and spec.dtype != torch.float64 else None)
        if sinks is not None:
            monitor.count_rewrite("sinks")
            return _sinks_as_two_calls(q, k, v, *sinks, spec, deterministic, return_lse)
    return _finish(*serve.call(spec, inputs, backend, key), return_lse)


def _sinks_as_two_calls(q, k, v, w, n, spec, deterministic, return_lse):
    """A sliding window of w keys with n attention sinks (mods.sliding_window(w, n): row i sees keys i - w .. i and
    the first n keys up to i) as two built-in calls merged by their lse: the window, and the sink keys the window
    does not reach (keys j < m = min(n, S - w - 1) with j <= i - w - 1: bottom-right, a right bound of
    S - m - w - 1).  The key sets are disjoint, so the merge is exact (merge_attention_states, in float32 with the
    float32 lse: float64 calls keep the mods).  No ALiBi: the sinks' call would measure distances from its own
    diagonal."""
    s = q.shape[1]
    kw = dict(softmax_scale=spec.softmax_scale, softcap=spec.softcap, deterministic=deterministic, return_lse=True)
    out, lse = attention(q, k, v, window_size=(w, 0), **kw)
    m = min(n, s - w - 1)
    if m > 0:
        out_s, lse_s = attention(q, k[:, :m], v[:, :m], window_size=(-1, s - m - w - 1), **kw)
        out, lse = merge_attention_states([out, out_s], [lse, lse_s])
    return (out, lse) if return_lse else out


def _prefix_as_two_calls(q, k, v, p, spec, alibi_slopes, deterministic, return_lse):
    """A dense call whose block mask shows prefix-LM (BlockMask.prefix: row i sees keys 0 to max(i, P - 1)) as the
    two built-in calls it is made of: the first P rows see the first P keys (no mask), and the rows after them see
    every key up to their own (causal, bottom-right: row i of the S - P sees keys up to P + i).  Every visible pair
    is computed once, no score is masked or merged, and the built-in ALiBi's distance |i + Sk - Sq - j| is |i - j| in
    both.  k and v gather their gradients from the two calls through autograd."""
    kw = dict(softmax_scale=spec.softmax_scale, softcap=spec.softcap, alibi_slopes=alibi_slopes,
              deterministic=deterministic, return_lse=True)
    out_p, lse_p = attention(q[:, :p], k[:, :p], v[:, :p], **kw)
    out_c, lse_c = attention(q[:, p:], k, v, causal=True, **kw)
    out = torch.cat([out_p, out_c], 1)
    return (out, torch.cat([lse_p, lse_c], -1)) if return_lse else out


def _documents_as_varlen(q, k, v, docs, spec, alibi_slopes, deterministic, return_lse):
    """A dense call whose block mask shows packed documents (BlockMask.documents), run as the varlen call it
    equals: the [B * S] rows as one packed batch, each document a sequence (so every backend's varlen kernels
    serve it, skipping the other documents' keys without evaluating a mod).  Same scale, window, softcap and
    ALiBi per row (positions within a document differ from the row's only by the document's start, which the
    window's and ALiBi's distances do not see).  Dropout keeps the dense path: its random mask is drawn per
    dense position."""
    cu, max_len, per_entry, causal = docs
    b, s = q.shape[:2]
    right = 0 if causal else spec.window_right     # a causal document mask with the call's window: the tighter
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        alibi_slopes = alibi_slopes.repeat_interleave(per_entry, 0)
    out, lse = attention_varlen(q.reshape(b * s, *q.shape[2:]), k.reshape(b * s, *k.shape[2:]),
                                v.reshape(b * s, *v.shape[2:]), cu, cu, max_len, max_len,
                                softmax_scale=spec.softmax_scale, window_size=(spec.window_left, right),
                                softcap=spec.softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                return_lse=True)
    out = out.view(b, s, *out.shape[1:])
    return (out, lse.view(lse.shape[0], b, s).transpose(0, 1)) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     deterministic=False, return_lse=False, backend=None, score_mod=None, mask_mod=None):
    """Packed variable-length attention.  q [total_q, Hq, D], k/v [total_k, Hkv, D|Dv],
    cu_seqlens_* int32 [B + 1].  Sequence b uses rows cu_seqlens[b]:cu_seqlens[b+1]; rows past
    cu_seqlens_q[-1] come back as zeros.  Returns out [total_q, Hq, Dv] (and lse [Hq, total_q]).
    score_mod / mask_mod as in `attention`, with b the sequence's index and q_idx / kv_idx positions within it."""
    if _compiling() and (score_mod is not None or mask_mod is not None):
        raise NotImplementedError("flashport.attention_varlen with score_mod / mask_mod does not trace under "
                                  "torch.compile yet; call it outside the compiled region")
    if _compiling():
        return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                    deterministic=deterministic, return_lse=return_lse, backend=backend)
    spec, inputs = varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                               return_lse=return_lse, score_mod=score_mod, mask_mod=mask_mod)
    return _finish(*serve.call(spec, inputs, backend), return_lse)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, return_lse=False, backend=None):
    """Inference attention over a KV cache, appending new tokens k/v [B, S_new, Hkv, D] in place at
    cache_seqlens first.  Dense cache [B, S_cache, Hkv, D]; paged cache [num_blocks, block_size, Hkv, D]
    with block_table int32 [B, max_blocks].  Batch entry b attends to its first cache_seqlens[b] + S_new
    positions with bottom-right alignment.  Returns out [B, Sq, Hq, Dv] (and lse [B, Hq, Sq])."""
    kw = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=causal, softmax_scale=softmax_scale,
              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse)
    if _compiling():
        return ops.attention_with_kvcache(q, k_cache, v_cache, k, v, backend=backend, **kw)
    key = plan_cache.kvcache_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal, softmax_scale,
                                 window_size, softcap, alibi_slopes, return_lse, backend)
    hit = plan_cache.get(key)
    if hit is not None:   # described before: only the checks of memory and contents run again
        inputs, append = kvcache_inputs(hit.spec, q, k_cache, v_cache, k, v, cache_seqlens, block_table)
        return _finish(*serve.kvcache_call(hit.spec, inputs, append, k_cache, v_cache, backend, launched=hit),
                       return_lse)
    spec, inputs, append = kvcache_spec(q, k_cache, v_cache, k, v, **kw)
    return _finish(*serve.kvcache_call(spec, inputs, append, k_cache, v_cache, backend, key=key), return_lse)


def merge_attention_states(outs, lses):
    """Exact merge of partial results over disjoint key sets: outs [B, Sq, Hq, Dv], lses [B, Hq, Sq]
    float32 -> (out in outs' dtype, lse float32).  Parts with lse = -inf contribute nothing."""
    validate_states(outs, lses)
    fused = merge_states_torch
    if outs[0].is_cuda:
        try:
            from .kernels.merge import merge_states_triton as fused
        except ImportError:  # no Triton in this process: the PyTorch merge is exact too
            pass
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*outs, *lses)):
        return MergeStates.apply(fused, len(outs), *outs, *lses)   # the fused merge forward, its own backward
    return fused(outs, lses)
