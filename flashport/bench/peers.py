"""What is timed on a GPU: flashport's triton backend and its peers, all in one process.

Every implementation takes the same [B, S, H, D] tensors (peers that want [B, H, S, D] get
transposed views, no copies) and returns out [B, S, H, D].  An implementation that cannot run a
shape raises; the harness records the reason and moves on.  None of them may fall back to a
materialising path silently: SDPA is pinned to one fused kernel per peer (MATH is never allowed),
and FlexAttention is compiled with `fullgraph=True` and dynamo set to raise instead of falling back
to eager (which would materialise the scores) when its recompile limit is hit.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

import flashport
from .shapes import Shape, cu_seqlens, decode_lens

DENSE = ("flashport-triton", "flashport", "fa4", "sdpa-cudnn", "sdpa-fa2", "sdpa-efficient", "flex")
DECODE = ("flashport-triton", "fa4", "sdpa-cudnn", "sdpa-fa2", "sdpa-efficient")


class NotApplicable(Exception):
    """The implementation has no form of this problem (e.g. SDPA and a paged cache)."""


class NotInstalled(NotApplicable):
    """The peer's package is absent from this environment (the entry says which and why)."""


# ----------------------------------------------------------------------------- FlashAttention-4
def _fa4():
    """flash_attn.cute (pip flash-attn-4: CuTe DSL kernels compiled at the first call of each shape)."""
    try:
        from flash_attn import cute
    except Exception as e:   # ImportError, or the DSL failing to load its libraries
        raise NotInstalled(f"flash-attn-4 not installed ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    return cute


def versions() -> dict:
    """Versions of the optional peers, None where absent (recorded in every GPU bench JSON)."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _fa4_window(shape: Shape):
    left, right = shape.window_size
    return (None if left < 0 else left, None if right < 0 else right)


def _fa4_dense(shape: Shape, q, k, v):
    fa4 = _fa4()
    return lambda: fa4.flash_attn_func(q, k, v, causal=shape.causal, window_size=_fa4_window(shape))[0]


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-fa2": SDPBackend.FLASH_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def context(impl: str):
    """Held around preparing and timing `impl` (global SDPA kernel flags), not inside the timed call."""
    if impl.startswith("sdpa-"):
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel([_sdpa_backend(impl)])
    return contextlib.nullcontext()


def _sdpa(q, k, v, causal: bool, shape: Shape):
    if shape.window >= 0:
        raise NotApplicable("SDPA has no sliding window")
    kw = {"enable_gqa": True} if shape.hq != shape.hkv else {}
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal, **kw).transpose(1, 2)


def _with_reasons(fn: Callable):
    """Run fn once; when SDPA refuses ("No available kernel") attach the warnings that say why."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except RuntimeError as e:
            why = " | ".join(str(w.message).strip().splitlines()[0] for w in caught)
            raise RuntimeError(f"{str(e).splitlines()[0]} {why}".strip()) from None


# ----------------------------------------------------------------------------- FlexAttention
_flex_fn = None
_block_masks: dict = {}


def _flex():
    global _flex_fn
    if _flex_fn is None:
        import torch._dynamo.config as dcfg
        from torch.nn.attention.flex_attention import flex_attention
        # Every shape is a static specialisation; a limit hit must raise, not fall back to eager.
        for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                    "accumulated_recompile_limit"):
            if hasattr(dcfg, key):
                setattr(dcfg, key, max(getattr(dcfg, key), 4096))
        if hasattr(dcfg, "fail_on_recompile_limit_hit"):
            dcfg.fail_on_recompile_limit_hit = True
        # the backward is timed with retain_graph=True, which a donated-buffer backward refuses
        torch._functorch.config.donated_buffer = False
        _flex_fn = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _flex_fn


def _mask_mod(shape: Shape, device):
    """FlexAttention's mask_mod for the shape, bottom-right aligned like flashport's rule; None = dense."""
    if shape.kind == "varlen":
        doc = torch.repeat_interleave(torch.arange(len(shape.docs), device=device),
                                      torch.tensor(shape.docs, device=device))

        def mod(b, h, q_idx, kv_idx):   # documents start together in q and k: causal is kv <= q
            same = doc[q_idx] == doc[kv_idx]
            return same & (kv_idx <= q_idx) if shape.causal else same
        return mod
    if not shape.causal and shape.window < 0:
        return None
    diag = shape.sk - shape.sq
    left, right = shape.window_size if shape.window >= 0 else (-1, 0)   # right >= 0 here

    def mod(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx + diag + right
        return seen & (kv_idx >= q_idx + diag - left) if left >= 0 else seen
    return mod


def _block_mask(shape: Shape, device):
    """Created once per mask configuration and reused; None = no mask (dense)."""
    key = (shape.kind, shape.sq, shape.sk, shape.causal, shape.window, shape.docs, str(device))
    if key not in _block_masks:
        mod = _mask_mod(shape, device)
        if mod is None:
            return None
        from torch.nn.attention.flex_attention import create_block_mask
        # Uncompiled, create_block_mask evaluates the mask on all Sq x Sk pairs at once (128 GiB at 131k);
        # compiled, it works block by block.
        big = shape.sq * shape.sk > 2**30
        _block_masks[key] = create_block_mask(mod, None, None, shape.sq, shape.sk, device=device, _compile=big)
    return _block_masks[key]


# ----------------------------------------------------------------------------- builders
def own_kernels(q, k, v, causal: bool, window_size=(-1, -1)) -> str:
    """The plan name ("gluon", "gluon/triton", "triton") of flashport's own kernels for this call."""
    from flashport import dispatch
    from flashport.spec import dense_spec
    spec = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=window_size, softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    ours = [p for p in dispatch.options(spec) if {p.fwd.name, p.bwd.name} <= {"gluon", "triton"}]
    return ours[0].name if ours else "triton"


def dense_fn(impl: str, shape: Shape, q, k, v) -> Callable[[], torch.Tensor]:
    """fn() -> out [B, Sq, Hq, Dv] for a dense, varlen (packed into B = 1) or chunked-prefill problem."""
    if shape.kind == "varlen":
        return _varlen_fn(impl, shape, q, k, v)
    if shape.kind == "chunked":
        return _chunked_fn(impl, shape, q, k, v)
    if impl == "flashport-triton":   # our kernels (Gluon where it serves, else Triton), as the static priority picks
        name = own_kernels(q, k, v, shape.causal, shape.window_size)
        return lambda: flashport.attention(q, k, v, causal=shape.causal, window_size=shape.window_size, backend=name)
    if impl == "flashport":           # backend=None: what a user gets (the selection table, else static priority)
        return lambda: flashport.attention(q, k, v, causal=shape.causal, window_size=shape.window_size)
    if impl.startswith("sdpa-"):
        return lambda: _sdpa(q, k, v, shape.causal, shape)
    if impl == "flex":
        return _flex_call(shape, q, k, v)
    if impl == "fa4":   # FA4 aligns causal bottom-right, like flashport
        return _fa4_dense(shape, q, k, v)
    raise ValueError(f"unknown implementation {impl!r}")


def _flex_call(shape: Shape, q, k, v):
    fn, mask = _flex(), _block_mask(shape, q.device)
    kw = {"enable_gqa": True} if shape.hq != shape.hkv else {}
    return lambda: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                      **kw).transpose(1, 2)


def _varlen_fn(impl: str, shape: Shape, q, k, v):
    """Packed documents: flashport's attention_varlen on q[0] etc.; FlexAttention with a document mask."""
    if impl.startswith("sdpa-"):
        raise NotApplicable("SDPA has no packed (varlen) form")
    if impl == "flex":
        return _flex_call(shape, q, k, v)
    cu = cu_seqlens(shape, q.device)
    longest = max(shape.docs)
    if impl == "fa4":
        fa4 = _fa4()
        return lambda: fa4.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=longest, max_seqlen_k=longest, causal=shape.causal,
                                                  window_size=_fa4_window(shape))[0][None]
    backend = "triton" if impl == "flashport-triton" else None
    if impl not in ("flashport", "flashport-triton"):
        raise ValueError(f"unknown implementation {impl!r}")
    return lambda: flashport.attention_varlen(q[0], k[0], v[0], cu, cu, longest, longest, causal=shape.causal,
                                              window_size=shape.window_size, backend=backend)[None]


def _chunked_fn(impl: str, shape: Shape, q, k, v):
    """Sq new queries after Sk - Sq cached tokens (the cache already holds the chunk's K/V): flashport's
    attention_with_kvcache (paged when shape.page); SDPA with a bottom-right causal bias; FlexAttention."""
    if impl == "fa4" and not shape.page:
        return _fa4_dense(shape, q, k, v)
    if impl.startswith("sdpa-") or impl == "flex":
        if shape.page:
            raise NotApplicable(f"{impl} has no paged KV cache")
        if impl == "flex":
            return _flex_call(shape, q, k, v)
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(shape.sq, shape.sk) if shape.causal else None
        kw = {"enable_gqa": True} if shape.hq != shape.hkv else {}
        return lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      attn_mask=bias, **kw).transpose(1, 2)
    if impl not in ("flashport", "flashport-triton", "fa4"):
        raise ValueError(f"unknown implementation {impl!r}")
    kc, vc, table = k, v, None
    if shape.page:
        nblk = shape.sk // shape.page
        g = torch.Generator(device=q.device).manual_seed(1)
        perm = torch.randperm(shape.b * nblk, device=q.device, generator=g)
        table = perm.view(shape.b, nblk).to(torch.int32)
        kc, vc = (torch.empty_like(t.reshape(shape.b * nblk, shape.page, *t.shape[2:])) for t in (k, v))
        kc[perm], vc[perm] = (t.reshape(shape.b * nblk, shape.page, *t.shape[2:]) for t in (k, v))
    lens = torch.full((shape.b,), shape.sk, dtype=torch.int32, device=q.device)
    if impl == "fa4":   # paged: FA4's page_table with seqused_k
        return _fa4_paged(q, kc, vc, lens, table, shape.causal)
    backend = "triton" if impl == "flashport-triton" else None
    return lambda: flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                    causal=shape.causal, backend=backend)


def decode_fn(impl: str, shape: Shape, q, k_cache, v_cache, lens, block_table) -> Callable[[], torch.Tensor]:
    """fn() -> out [B, 1, Hq, D] reading a full cache of shape.sk tokens per sequence."""
    if impl == "flashport-triton":
        return lambda: flashport.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                        block_table=block_table, backend="triton")
    if impl == "fa4":
        if block_table is None and not shape.ragged:
            return _fa4_dense(shape, q, k_cache, v_cache)
        if block_table is None:   # ragged over a dense cache: batch-shaped q with seqused_k
            fa4 = _fa4()
            return lambda: fa4.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=lens)[0]
        return _fa4_paged(q, k_cache, v_cache, lens, block_table, False)
    if impl.startswith("sdpa-"):
        if block_table is not None:
            raise NotApplicable("SDPA has no paged KV cache")
        if shape.ragged:
            raise NotApplicable("SDPA over a dense cache reads every slot: ragged lengths need a mask")
        return lambda: _sdpa(q, k_cache, v_cache, False, shape)
    raise ValueError(f"unknown implementation {impl!r}")


def _fa4_paged(q, k_pages, v_pages, lens, table, causal: bool):
    fa4 = _fa4()
    return lambda: fa4.flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=lens, page_table=table,
                                              causal=causal)[0]


def make_inputs(shape: Shape, device, requires_grad: bool, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    dt = shape.torch_dtype

    def rnd(*s):
        return torch.randn(*s, device=device, dtype=dt, generator=g).requires_grad_(requires_grad)

    return rnd(shape.b, shape.sq, shape.hq, shape.d), rnd(shape.b, shape.sk, shape.hkv, shape.d), \
        rnd(shape.b, shape.sk, shape.hkv, shape.head_dim_v)


def make_cache(shape: Shape, device, seed: int = 0):
    """q [B, 1, Hq, D], caches (dense [B, Sk, Hkv, D] or paged [B*Sk/page, page, Hkv, D] with a
    shuffled block_table), cache_seqlens = Sk for every sequence."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt, b, s = shape.torch_dtype, shape.b, shape.sk
    q = torch.randn(b, 1, shape.hq, shape.d, device=device, dtype=dt, generator=g)
    if shape.page:
        nblk = s // shape.page
        kc = torch.randn(b * nblk, shape.page, shape.hkv, shape.d, device=device, dtype=dt, generator=g)
        vc = torch.randn_like(kc)
        table = torch.randperm(b * nblk, device=device, generator=g).view(b, nblk).to(torch.int32)
    else:
        kc = torch.randn(b, s, shape.hkv, shape.d, device=device, dtype=dt, generator=g)
        vc, table = torch.randn_like(kc), None
    lens = decode_lens(shape).to(device)
    return q, kc, vc, lens, table


run_once = _with_reasons
