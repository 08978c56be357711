"""The call, described once: validation of every public entry point and the frozen `AttnSpec`.

Every backend sees the same `AttnSpec` (static facts: shapes, dtype, visibility rule, features) and
the same `AttnInputs` (the tensors).  Validation lives here and nowhere else, so a malformed call is
rejected before any backend or kernel is chosen, with a ValueError/TypeError naming the argument.

Checks of tensor *contents* (cu_seqlens order, block_table range, cache_seqlens against capacity)
need the values on the host.  They always run for CPU tensors; on GPU they would synchronise with
the host, so they run only when the environment variable FLASHPORT_CHECKS=1 is set.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Optional

import torch

from . import env
from .masks import Visibility
from .overlap import overlaps
from .programmable import Programmable, build as build_programmable, builtin_alibi, builtin_window

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class AttnSpec:
    """Static description of one attention call (hashable; no tensors).

    kind: "dense" (q [B,Sq,Hq,D]), "varlen" (q [total_q,Hq,D] + cu_seqlens) or "kvcache".
    seqlen_q / seqlen_k: Sq / Sk for dense; max_seqlen_q / max_seqlen_k for varlen (clamped to the packed
    tensors' first dimensions); for kvcache, Sq and the cache capacity (positions one sequence can hold).
    window_left / window_right: -1 means unbounded (also for a bound that reaches every key anyway);
    causal is folded into window_right = 0.
    """

    kind: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    window_left: int
    window_right: int
    softmax_scale: float
    softcap: float
    alibi: Optional[str]  # None, "head" ([Hq] slopes) or "batch_head" ([B, Hq] slopes)
    dropout_p: float
    needs_grad: bool
    deterministic: bool
    return_lse: bool
    paged: bool = False
    page_block_size: int = 0
    new_kv: int = 0  # S_new tokens appended to the cache before attending
    # programmable features present (flashport.programmable.FEATURES): "score_mod", "mask_mod", ...
    mods: tuple = ()

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def is_local(self) -> bool:
        """True when the window bounds keys on the left or on the right (causal included)."""
        return self.window_left >= 0 or self.window_right >= 0

    @functools.cached_property
    def visibility(self) -> Visibility:
        """The call's visibility rule (flashport.masks.Visibility: its kind, bounds and tile ranges), built
        once per spec: the host paths that branch on it run on every call."""
        return Visibility.from_spec(self)


@dataclass
class AttnInputs:
    """The tensors of a call.  Layouts follow FlashAttention (see flashport.attention)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    alibi_slopes: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    # kvcache: k/v above are the caches; seqlens_k [B] int32 are the valid lengths after the append.
    seqlens_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    # dropout: int64 [2] (seed, offset) on q's device, drawn from q's device generator.
    rng_state: Optional[torch.Tensor] = None
    dropout_mask: Optional[torch.Tensor] = None  # explicit keep-mask (reference only, for tests)
    prog: Optional[Programmable] = None          # score_mod / mask_mod / block_mask / attn_bias
    extra: dict = field(default_factory=dict)


def content_checks_enabled(device: torch.device) -> bool:
    return device.type == "cpu" or env.flag("FLASHPORT_CHECKS")


# ----------------------------------------------------------------------------- small checks
def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _rank(x: torch.Tensor, name: str, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(x.shape)}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # Kernels need unit stride only in the head dimension; anything else is a stride argument.
    return x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous()


def _is_int(x) -> bool:
    # Python and NumPy integers (a `max_seqlen` computed with NumPy is still an int); bool is not one.
    # The exact-type test first: the ABC check costs microseconds on every call of a hot loop.
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    # float / int / NumPy reals; bool is not one (exact types first, as in _is_int).
    return type(x) in (float, int) or (isinstance(x, Real) and not isinstance(x, bool))


def _index(x: torch.Tensor) -> torch.Tensor:
    # cu_seqlens, cache_seqlens and block_table are read by kernels with unit stride along their rows
    # (a view such as cu[::2] would be read wrongly); a no-op for the usual contiguous tensor.
    return x.contiguous()


def _bool(x, name: str) -> bool:
    if not isinstance(x, bool):   # the qualified name: NumPy's bool_ is called "bool" too
        t = type(x)
        raise TypeError(f"{name} must be a Python bool, got "
                        f"{t.__qualname__ if t.__module__ == 'builtins' else t.__module__ + '.' + t.__qualname__}")
    return x


def _check_qkv(q, k, v, names=("q", "k", "v")) -> None:
    qn, kn, vn = names
    for t, n in ((q, qn), (k, kn), (v, vn)):
        if not t.is_floating_point() or t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{n} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{qn}, {kn}, {vn} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{kn} head dim {k.shape[-1]} must equal {qn} head dim {q.shape[-1]}")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be positive, got {qn} {q.shape[-1]} and {vn} {v.shape[-1]}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv:
        raise ValueError(f"{vn} has {v.shape[-2]} heads but {kn} has {hkv}")
    if hkv == 0 or hq == 0:
        raise ValueError(f"head counts must be positive, got {qn} {hq}, {kn} {hkv}")
    if hq % hkv != 0:
        raise ValueError(f"{qn} heads ({hq}) must be a multiple of {kn}/{vn} heads ({hkv}) for GQA/MQA")


# Scale and softcap bounds.  The kernels fold them into float32 constants (scale * log2(e), scale / softcap,
# softcap * log2(e)) and multiply raw scores by them: with both in [2**-60, 2**60] every constant is a
# finite normal float32 (|scale / softcap| in [2**-120, 2**120], float32's normal range is [2**-126, 2**128))
# and a raw score |q.k| < 2**60 scaled by them stays below 2**121, finite.  Outside it a constant
# underflows to 0 or overflows to inf in float32 and the softmax returns NaN.
SCALE_MIN, SCALE_MAX = 2.0 ** -60, 2.0 ** 60
_RANGE = "[2**-60, 2**60]"


def _in_range(x: float) -> bool:
    return SCALE_MIN <= abs(x) <= SCALE_MAX


def _scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not _is_real(softmax_scale):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if scale != 0.0 and not _in_range(scale):
        raise ValueError(f"softmax_scale must be 0 or have |softmax_scale| in {_RANGE} (the kernels' float32 "
                         f"constants stay finite there), got {softmax_scale}")
    return scale


def _unbounded_if_far(w: int, span: int) -> int:
    """-1 for a window bound that reaches every key anyway.  No query/key pair of a call is more than
    `span` positions apart, so a bound >= span hides nothing; folding it to -1 keeps huge values (up to
    2**63 - 1) out of index arithmetic, where `diag - left` would wrap around in int64."""
    return -1 if w >= max(span, 1) else w


def _window(window_size, causal: bool, span: int) -> tuple[int, int]:
    """(left, right) with causal folded into right = 0; span = Sq + Sk bounds every distance (see above)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = window_size
    for w in (left, right):
        if not _is_int(w):
            raise TypeError(f"window_size entries must be ints, got {window_size!r}")
        if w < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    if causal:  # on the raw value: causal with a huge right bound still contradicts
        if right not in (-1, 0):
            raise ValueError(f"causal=True contradicts window_size[1]={right}: causal means right = 0")
        right = 0
    return _unbounded_if_far(int(left), span), _unbounded_if_far(int(right), span)


def _is_causal(left: int, right: int) -> bool:
    """The window (-1, 0) is the causal rule, however it was asked for (causal=True, window_size=(-1, 0), or a mask
    backend=None found to be causal): one spec, so one plan-cache entry and one selection."""
    return left == -1 and right == 0


def _softcap(softcap) -> float:
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be finite and >= 0, got {softcap}")
    if cap != 0.0 and not _in_range(cap):
        raise ValueError(f"softcap must be 0 (off) or in {_RANGE} (the kernels' float32 constants stay finite "
                         f"there), got {softcap}")
    return cap


def _dropout(dropout_p) -> float:
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p must be a real number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def _alibi(alibi_slopes, batch: int, heads_q: int, device) -> Optional[str]:
    if alibi_slopes is None:
        return None
    _tensor(alibi_slopes, "alibi_slopes")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {alibi_slopes.device}")
    if content_checks_enabled(device) and not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError("alibi_slopes must be finite (a NaN or inf slope makes every score of its head NaN)")
    if tuple(alibi_slopes.shape) == (heads_q,):
        return "head"
    if tuple(alibi_slopes.shape) == (batch, heads_q):
        return "batch_head"
    raise ValueError(f"alibi_slopes must have shape [Hq]=({heads_q},) or [B, Hq]=({batch}, {heads_q}), "
                     f"got {tuple(alibi_slopes.shape)}")


def _int_arg(x, name: str) -> int:
    if not _is_int(x):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def _common(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic,
            return_lse, batch, heads_q, span):
    """The keyword options every entry point shares; span = longest query/key distance (see _window)."""
    causal = _bool(causal, "causal")
    _bool(deterministic, "deterministic")
    _bool(return_lse, "return_lse")
    left, right = _window(window_size, causal, span)
    return dict(
        causal=causal or _is_causal(left, right), window_left=left, window_right=right,
        softmax_scale=_scale(softmax_scale, q.shape[-1]), softcap=_softcap(softcap),
        alibi=_alibi(alibi_slopes, batch, heads_q, q.device), dropout_p=_dropout(dropout_p),
        deterministic=deterministic, return_lse=return_lse,
    )


# ----------------------------------------------------------------------------- entry points
def dense_spec(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
               deterministic, return_lse, score_mod=None, mask_mod=None, block_mask=None,
               attn_bias=None, builtin_rules=False) -> tuple[AttnSpec, AttnInputs]:
    """builtin_rules: a score_mod that declares it is ALiBi becomes alibi_slopes (programmable.builtin_alibi), and
    then a mask-only call that is a window (its block mask shows one, or its mask_mod declares one:
    programmable.builtin_window) becomes that built-in window, which every backend runs without evaluating a mod
    (backend=None's calls; a named backend keeps the mods it was asked to run)."""
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _tensor(t, n)
    _rank(q, "q", 4, "[B, Sq, Hq, D]")
    _rank(k, "k", 4, "[B, Sk, Hkv, D]")
    _rank(v, "v", 4, "[B, Sk, Hkv, Dv]")
    _check_qkv(q, k, v)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"k and v must have the same sequence length, got {k.shape[1]} and {v.shape[1]}")
    b, sq, hq, d = q.shape
    opts = _common(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                   deterministic, return_lse, b, hq, sq + k.shape[1])
    prog = build_programmable(score_mod, mask_mod, block_mask, attn_bias, batch=b, heads_q=hq, sq=sq,
                              sk=k.shape[1], device=q.device)
    rewritten = []   # the rules folded in, for monitor.rewrites (counted by the entry point that runs the call)
    if builtin_rules:
        slopes, prog = builtin_alibi(prog, opts["alibi"], hq, sq, k.shape[1], q.device)
        if slopes is not None:
            alibi_slopes, opts["alibi"] = slopes, "head"
            rewritten.append("alibi")
        window = builtin_window(prog, (opts["window_left"], opts["window_right"]), b, hq, sq, k.shape[1])
        if window is not None:
            opts.update(window_left=window[0], window_right=window[1], causal=opts["causal"] or _is_causal(*window))
            prog = None
            rewritten.append("window")
    extra = () if prog is None else prog.differentiable
    spec = AttnSpec(kind="dense", batch=b, seqlen_q=sq, seqlen_k=k.shape[1], heads_q=hq,
                    heads_kv=k.shape[2], head_dim=d, head_dim_v=v.shape[-1], dtype=q.dtype,
                    device=q.device, needs_grad=_needs_grad(q, k, v, *extra),
                    mods=() if prog is None else prog.features, **opts)
    return spec, AttnInputs(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
                            alibi_slopes=alibi_slopes, prog=prog, extra={"rewritten": rewritten} if rewritten else {})


def _cu_seqlens(cu, name: str, batch: Optional[int], total: int, max_seqlen: int, max_name: str, device):
    _tensor(cu, name)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(cu.shape)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} has {cu.shape[0]} entries but the batch implies {batch + 1}")
    if cu.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {cu.device}")
    if content_checks_enabled(cu.device):
        c = cu.detach().cpu().long()
        if c[0].item() != 0:
            raise ValueError(f"{name}[0] must be 0, got {c[0].item()}")
        lens = c[1:] - c[:-1]
        if (lens < 0).any():
            raise ValueError(f"{name} must be non-decreasing, got {c.tolist()}")
        if c[-1].item() > total:
            raise ValueError(f"{name}[-1]={c[-1].item()} exceeds the tensor's first dimension {total}")
        if lens.numel() and lens.max().item() > max_seqlen:
            raise ValueError(f"{max_name}={max_seqlen} is smaller than a sequence length {lens.max().item()}")


def varlen_spec(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal,
                softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic,
                return_lse, score_mod=None, mask_mod=None) -> tuple[AttnSpec, AttnInputs]:
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _tensor(t, n)
    _rank(q, "q", 3, "[total_q, Hq, D]")
    _rank(k, "k", 3, "[total_k, Hkv, D]")
    _rank(v, "v", 3, "[total_k, Hkv, Dv]")
    _check_qkv(q, k, v)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"k and v must have the same total length, got {k.shape[0]} and {v.shape[0]}")
    max_seqlen_q = _int_arg(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _int_arg(max_seqlen_k, "max_seqlen_k")
    _tensor(cu_seqlens_q, "cu_seqlens_q")
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q.dim() == 1 else None
    _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None, q.shape[0], max_seqlen_q, "max_seqlen_q", q.device)
    _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch, k.shape[0], max_seqlen_k, "max_seqlen_k", q.device)
    hq = q.shape[1]
    # No sequence is longer than its packed tensor, so clamping is exact; it keeps a huge max_seqlen
    # (2**40) out of launch grids and tile loops.
    seqlen_q, seqlen_k = min(max_seqlen_q, q.shape[0]), min(max_seqlen_k, k.shape[0])
    opts = _common(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
                   deterministic, return_lse, batch, hq, seqlen_q + seqlen_k)
    # mods see b = the sequence's index and positions within the sequence (block masks and attn_bias have no
    # per-sequence shape, so a packed call takes neither)
    prog = build_programmable(score_mod, mask_mod, None, None, batch=batch, heads_q=hq, sq=seqlen_q,
                              sk=seqlen_k, device=q.device)
    extra = () if prog is None else prog.differentiable
    spec = AttnSpec(kind="varlen", batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                    heads_q=hq, heads_kv=k.shape[1], head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                    dtype=q.dtype, device=q.device, needs_grad=_needs_grad(q, k, v, *extra),
                    mods=() if prog is None else prog.features, **opts)
    inputs = AttnInputs(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
                        alibi_slopes=alibi_slopes, cu_seqlens_q=_index(cu_seqlens_q),
                        cu_seqlens_k=_index(cu_seqlens_k), prog=prog)
    return spec, inputs


def kvcache_spec(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, causal, softmax_scale,
                 window_size, softcap, alibi_slopes, return_lse) -> tuple[AttnSpec, AttnInputs, tuple]:
    """Returns (spec, inputs, append) where append = (k, v, cache_seqlens) still to be written."""
    spec = kvcache_description(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                               causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, return_lse=return_lse)
    return (spec, *kvcache_inputs(spec, q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes))


def kvcache_description(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table, causal, softmax_scale,
                        window_size, softcap, alibi_slopes, return_lse) -> AttnSpec:
    """The checks a KV-cache call's description decides (types, ranks, shapes, dtypes, devices, options) -> its
    spec.  What the tensors' memory and contents decide is kvcache_inputs' (run on every call, cached or not)."""
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _tensor(t, n)
    _rank(q, "q", 4, "[B, Sq, Hq, D]")
    _rank(k_cache, "k_cache", 4, "[B, S_cache, Hkv, D] or [num_blocks, block_size, Hkv, D]")
    _rank(v_cache, "v_cache", 4, "[B, S_cache, Hkv, Dv] or [num_blocks, block_size, Hkv, Dv]")
    _check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
    if k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree")
    for t, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"), (v, "v")):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"attention_with_kvcache is inference-only; {n} requires grad")
    b, sq, hq, d = q.shape
    paged = block_table is not None
    if paged:
        _tensor(block_table, "block_table")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must be [B={b}, max_blocks], got {tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on q's device {q.device}, got {block_table.device}")
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page
    else:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache batch {k_cache.shape[0]} must equal q batch {b}")
        page, capacity = 0, k_cache.shape[1]

    if (k is None) != (v is None):
        raise ValueError("k and v (new tokens) must be given together")
    s_new = 0
    if k is not None:
        _tensor(k, "k")
        _tensor(v, "v")
        _rank(k, "k", 4, "[B, S_new, Hkv, D]")
        _rank(v, "v", 4, "[B, S_new, Hkv, Dv]")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"k and v must have q's dtype {q.dtype}, got {k.dtype}, {v.dtype}")
        if k.device != q.device or v.device != q.device:
            raise ValueError(f"k and v must be on q's device {q.device}")
        if k.shape[0] != b or k.shape[2:] != k_cache.shape[2:] or v.shape[:3] != k.shape[:3] \
                or v.shape[3] != v_cache.shape[3]:
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [B={b}, S_new, Hkv, D|Dv] "
                             f"matching the cache")
        s_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when appending k/v (where would they go?)")
        if s_new > capacity:
            raise ValueError(f"cache too small for the append: S_new={s_new} > capacity {capacity}")

    if cache_seqlens is not None and not _is_int(cache_seqlens):
        _tensor(cache_seqlens, "cache_seqlens")
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (b,):
            raise ValueError(f"cache_seqlens must be [B={b}], got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on q's device {q.device}")

    opts = _common(q, causal, softmax_scale, window_size, softcap, alibi_slopes, 0.0, False,
                   return_lse, b, hq, sq + capacity)
    spec = AttnSpec(kind="kvcache", batch=b, seqlen_q=sq, seqlen_k=capacity, heads_q=hq,
                    heads_kv=k_cache.shape[2], head_dim=d, head_dim_v=v_cache.shape[-1],
                    dtype=q.dtype, device=q.device, needs_grad=False, paged=paged,
                    page_block_size=page, new_kv=s_new, **opts)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need unit stride in the last dimension (written in place)")
    return spec


def kvcache_inputs(spec: AttnSpec, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                   alibi_slopes=None) -> tuple[AttnInputs, tuple]:
    """A described KV-cache call's per-call part: the append's aliasing (memory) and, where content checks are on,
    the index tensors' values -> (inputs, append = (k, v, cache_seqlens) still to be written)."""
    b, capacity, s_new = spec.batch, spec.seqlen_k, spec.new_kv
    if block_table is not None:
        block_table = _index(block_table)
        if content_checks_enabled(q.device) and block_table.numel():
            bt = block_table.detach().cpu()
            if bt.min().item() < 0 or bt.max().item() >= k_cache.shape[0]:
                raise ValueError(f"block_table entries must be in [0, {k_cache.shape[0]}), got "
                                 f"[{bt.min().item()}, {bt.max().item()}]")
    if k is not None:
        _check_append_aliasing(k_cache, v_cache, k, v)
    if cache_seqlens is None:
        seqlens = None
    else:
        if _is_int(cache_seqlens):
            cache_seqlens = torch.full((b,), int(cache_seqlens), dtype=torch.int32, device=q.device)
        cache_seqlens = _index(cache_seqlens)
        if content_checks_enabled(q.device):
            cs = cache_seqlens.detach().cpu()
            if cs.numel() and cs.min().item() < 0:
                raise ValueError(f"cache_seqlens must be non-negative, got min {cs.min().item()}")
            if cs.numel() and cs.max().item() + s_new > capacity:
                raise ValueError(f"cache_seqlens + S_new must be in [0, {capacity}] (cache too small for "
                                 f"the append), got max {cs.max().item()} + {s_new}")
        seqlens = cache_seqlens + s_new if s_new else cache_seqlens
    if seqlens is None and spec.paged:
        seqlens = torch.full((b,), capacity, dtype=torch.int32, device=q.device)
    inputs = AttnInputs(_last_dim_contiguous(q), k_cache, v_cache, alibi_slopes=alibi_slopes,
                        seqlens_k=seqlens, block_table=block_table)
    return inputs, (k, v, cache_seqlens)


def _check_append_aliasing(k_cache, v_cache, k, v) -> None:
    """The append writes k into k_cache and v into v_cache in place: through shared memory one write would
    overwrite the other cache, or the new tokens while they are read.  Only a write can corrupt, so a call
    without an append may pass one tensor as both caches.  The test is exact for strided tensors (see
    flashport.overlap): the interleaved layout kv[:, :, 0] / kv[:, :, 1] shares a storage, not an element."""
    if overlaps(k_cache, v_cache):
        raise ValueError("k_cache and v_cache overlap in memory; appending k/v would write one into the other")
    for cache, cache_name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        shared = [d for d in range(cache.dim()) if cache.stride(d) == 0 and cache.shape[d] > 1]
        if shared:   # an expanded cache: every index along dimension d is one element
            raise ValueError(f"{cache_name} is expanded (stride 0 in dimension {shared[0]}), so its entries share "
                             f"memory; appending k/v would write them over each other (pass a real cache)")
    for new, new_name in ((k, "k"), (v, "v")):
        for cache, cache_name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if overlaps(new, cache):
                raise ValueError(f"{new_name} (new tokens) overlaps {cache_name} in memory; the append would "
                                 f"overwrite it while it is read")


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


# ----------------------------------------------------------------------------- what backends read from inputs
def varlen_segments(inputs: AttnInputs) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) of each sequence of a varlen call: its rows of q and of k / v (one host read of cu_seqlens)."""
    cq, ck = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def alibi_per_batch(spec: AttnSpec, slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """ALiBi slopes as [B, Hq] (a [Hq] vector expanded, no copy), or None."""
    if slopes is None:
        return None
    return slopes.expand(spec.batch, spec.heads_q) if slopes.dim() == 1 else slopes
