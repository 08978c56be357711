"""Hugging Face transformers integration: ``attn_implementation="flashport"``.

    from flashport.integrations.transformers import register
    register()                                   # once per process, before loading the model
    model = AutoModel.from_pretrained(path, attn_implementation="flashport")

`register(name)` adds two functions under `name`:
- the attention (transformers' AttentionInterface): it receives the model's q, k, v [B, H, S, D]
  and keywords (scaling, dropout, is_causal, sliding_window, softcap) and returns
  (out [B, S, H, D], None);
- the mask (AttentionMaskInterface): like transformers' `flash_attention_mask`, the model is handed
  the compact 2-D padding mask [B, Sk] (True = a real token), or None when no key is padding, never
  an S x S mask.  A padded batch is unpadded into `flashport.attention_varlen` and padded back.

Visibility follows transformers' flash-attention path: `sliding_window` counts the token itself (query
i sees keys i - sliding_window < j <= i), so it maps to window_size=(sliding_window - 1, 0), or
(sliding_window - 1, sliding_window - 1) without causality.  flashport aligns a causal query with the
newest key (bottom-right), so decoding from a KV cache (Sq = 1, growing Sk) needs no offset.

transformers is imported only inside `register()`: importing flashport never imports it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import flashport

# Keywords some models pass that flashport cannot honour: failing beats a silently different model.
_UNSUPPORTED = {
    "s_aux": "attention sinks",
    "position_bias": "an additive position bias",
    "block_table": "a paged KV cache (continuous batching)",
}


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """transformers' attention contract: query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D|Dv] (GQA:
    Hkv divides Hq, never repeated here), attention_mask from `padding_mask` below.
    Returns (out [B, Sq, Hq, Dv], None): flashport never materialises attention weights."""
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"flashport's transformers integration does not support `{name}` ({what}); "
                             "load this model with attn_implementation='sdpa' or 'eager'")
    # The call's own is_causal wins over the module's (encoders reuse decoder layers); sdpa's default.
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    left = -1 if sliding_window is None else int(sliding_window) - 1
    options = dict(causal=causal, softmax_scale=scaling, window_size=(left, 0 if causal else left),
                   softcap=float(softcap or 0.0),
                   # Models pass their configured rate; only a module in training mode drops.
                   dropout_p=float(dropout or 0.0) if module.training else 0.0)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D] views, no copy
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, positional=causal or left >= 0, options=options)
    elif (packed := _packed(q, k, kwargs)) is not None:
        out = flashport.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), *packed, **options)
        out = out.view(*q.shape[:2], *out.shape[1:])
    else:
        out = flashport.attention(q, k, v, **options)
    return out, None


def _cu_seqlens(mask):
    """[B, S] bool -> int32 [B + 1] offsets of each row's True entries once packed."""
    return F.pad(mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def _padded(q, k, v, mask, positional, options):
    """Unpad, run varlen, pad back.  q [B, Sq, H, D]; mask [B, n] bool over the newest n tokens."""
    if mask.dim() != 2:
        raise ValueError(f"flashport's transformers integration takes a 2-D padding mask, got shape "
                         f"{tuple(mask.shape)}; for an arbitrary mask use attn_implementation='sdpa'")
    batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    mask = mask.to(device=q.device, dtype=torch.bool)
    # A static cache has more slots than tokens so far: the slots past the mask are empty.
    k_mask = mask[:, -sk:] if mask.shape[1] >= sk else F.pad(mask, (0, sk - mask.shape[1]))
    if positional:
        # Causal or windowed self-attention: the queries are the newest tokens the mask describes, and
        # bottom-right alignment needs them unpadded too (with right padding a pad query would shift it).
        q_mask = mask[:, -sq:]
    else:
        # Nothing depends on a query's position, so every row stays: right for cross-attention too,
        # whose mask says nothing about the queries, and pad rows see the real keys as in eager.
        q_mask = mask.new_ones(batch, sq)
    # max_seqlen: the padded lengths bound every sequence, and need no host sync.
    out = flashport.attention_varlen(q[q_mask], k[k_mask], v[k_mask], _cu_seqlens(q_mask),
                                     _cu_seqlens(k_mask), sq, sk, **options)
    full = out.new_zeros(batch, sq, *out.shape[1:])
    full[q_mask] = out
    return full


def _packed(q, k, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) for sequences packed along the sequence axis
    (padding-free training), or None.  Models name them as for flash-attention: explicit
    `cu_seq_lens_*` (e.g. Qwen2-VL's vision tower), or `position_ids` that restart."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        return (cu_q.to(torch.int32), cu_k.to(torch.int32),
                q.shape[0] * q.shape[1] if max_q is None else int(max_q),
                k.shape[0] * k.shape[1] if max_k is None else int(max_k))
    pos = kwargs.get("position_ids")
    seq = q.shape[1]
    if pos is None or q.shape[0] != 1 or seq == 1 or k.shape[1] != seq or pos.numel() != seq:
        return None
    pos = pos.reshape(-1).to(q.device)
    # A sequence starts wherever the position does not advance by one: masking_utils' rule for sdpa.
    # Reading it syncs with the host once per layer of a one-row prefill, as transformers' flash path.
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    first = starts.nonzero().flatten().to(torch.int32)
    if first.numel() == 1:
        return None
    cu = torch.cat([first, first.new_tensor([seq])])
    return cu, cu, seq, seq


def padding_mask(batch_size, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, cache_position=None, **kwargs):
    """transformers' mask contract (see masking_utils.flash_attention_mask): returns the [B, kv_length]
    bool padding mask of the keys the layer attends to, or None when every one is a real token.
    Causality and sliding windows are not in it: the attention applies them from its keywords."""
    from transformers.masking_utils import bidirectional_mask_function

    if q_length is None:  # early 5.x releases describe the queries by cache_position instead
        q_length, q_offset = cache_position.shape[0], cache_position[0]

    if kwargs.get("use_vmap"):  # set exactly when a model adds or_mask_function / and_mask_function
        raise ValueError("this model overlays its own mask pattern (e.g. bidirectional image tokens), "
                         "which a padding mask cannot express; use attn_implementation='sdpa'")
    if attention_mask is not None:
        # A sliding-window cache keeps only the newest kv_length keys: the mask's tail describes them.
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
        return attention_mask
    if mask_function is bidirectional_mask_function:
        return None  # an encoder or cross-attention: keys are real tokens, however many queries there are
    # No padding, but a static cache may hold more slots than tokens so far.  Describe the tokens, as
    # generate does for flash-named implementations, so the mask's tail stays the queries (a static
    # cache's q_offset is a tensor: one host sync per mask, not per layer).
    tokens = int(q_offset + q_length - kv_offset)
    if tokens >= kv_length:
        return None
    return torch.ones(batch_size, tokens, dtype=torch.bool, device=kwargs.get("device"))


def _keep_out_of_kernel_loading(name):
    """transformers treats an implementation whose name contains "flash" as a flash-attention kernel:
    model init calls `lazy_import_flash_attention(name)`, which would fetch a hub kernel of that name
    and fail.  A registered flashport name needs no loading, so that call is skipped for it alone.
    (Being seen as flash is otherwise what we want: e.g. generate keeps the 2-D mask with a static
    cache, and vision towers pass cu_seq_lens_*.)"""
    import transformers.modeling_utils as modeling_utils

    load = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if load is None:
        return
    names = getattr(load, "flashport_names", None)
    if names is None:
        def lazy_import_flash_attention(implementation, *args, **kwargs):
            if implementation in names:
                return None  # the call sites in modeling_utils ignore the result
            return load(implementation, *args, **kwargs)

        names = lazy_import_flash_attention.flashport_names = set()
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention
    names.add(name)


def register(name: str = "flashport") -> str:
    """Make `attn_implementation=name` run flashport in transformers models; returns `name`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    if "flash" in name:
        _keep_out_of_kernel_loading(name)
    return name
