"""Backend `sdpa-cpu`: PyTorch's CPU flash-attention kernel (ATen's tiled online softmax in C++, exact, linear
memory), called through its aten ops so that flashport keeps the contract's (out, lse):

    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, is_causal, scale=s)
    dq_, dk_, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do_, q_, k_, v_, out, lse, 0.0, is_causal, scale=s)
    # q_ = q.transpose(1, 2) etc.: [B, H, S, D] views of flashport's [B, S, H, D] tensors, no copy

The kernel takes GQA directly (fewer KV heads, never expanded), strided views, and returns lse (natural log,
float32; float64 for float64 inputs); its backward recomputes P from any (out, lse), so it mixes with the other
"lse" backends (blockwise forward, sdpa-cpu backward, and the reverse).

Causal alignment: the kernel's `is_causal` is top-left, flashport's is bottom-right.
- Sq == Sk: the two agree.
- Sq < Sk: every row sees the first Sk - Sq keys whole, and the last Sq keys top-left causally; the two parts are
  run separately and merged exactly by their lse (flashport.merge).  The backward runs the kernel's backward on
  each part with the *merged* (out, lse) -- P = exp(s - lse) and D = rowsum(dO * O) are then the full problem's,
  so the parts' gradients add up exactly (dQ summed, dK / dV concatenated).
- Sq > Sk: the first Sq - Sk rows see no key (zeros, lse = -inf, zero gradients) and the rest is a square causal
  problem; no additive mask (that would be Sq x Sk memory) is ever built.

Sliding windows and ALiBi: bands of BAND_M query rows (backend/sdpa_cpu_bands.py), each one kernel call over the keys its rows
see, with an additive attn_mask of the band ([1, 1, M, N]: -inf on hidden pairs; [B, Hq, M, N] with ALiBi's
-slope * |i + Sk - Sq - j| added).  The kernel returns out 0 and lse 0 for a row whose keys are all masked: those
rows get lse -inf here, and +inf in the backward (P = 0).  dK / dV add up over the bands.  Memory: one band's mask.

Varlen: the same per sequence (cu_seqlens are CPU tensors here: no sync).  KV cache (inference): the same per batch
entry over its valid cached keys, a paged cache's pages gathered first.

mask_mod and block masks: the same bands, the mask built from mask_mod and the block mask's tiles on the band
([B', H', M, N], B' / H' the call's where the mods read b / h, else 1) and its keys trimmed to the columns some row
sees, so a packed-document mask costs each band only its own documents.  attn_bias (calls that need no grads: the
kernel's backward returns no gradient for its mask) is added to the same masks.

Kernel dtype (_kernel_dtype): float16 inputs run on float32 copies where the CPU has no native float16 (the float16
kernel was 2-9x slower than that), and fp16 / bf16 inputs with ALiBi or attn_bias too (the kernel adds its mask in
its own dtype; the contract's bias is float32); the results are rounded back to the inputs' dtype.

Refused (each with its reason): softmax_scale <= 0, a backward with softmax_scale > 1.5 / sqrt(D) (both
measured to break the tolerance rule), softcap, dropout (its RNG is not flashport's exposed keep-mask), Dv != D (the
kernel's own check), score_mod, attn_bias with grads.  A differentiated lse is served by a padded column (see _bwd).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import dispatch, monitor
from ..capabilities import Capabilities
from ..kvcache import sequence_kv
from ..spec import AttnInputs, AttnSpec, alibi_per_batch, varlen_segments
from .sdpa_cpu_bands import Mods, additive_mask, banded, bands

_NEG_INF = float("-inf")
# The backward is served for softmax_scale * sqrt(D) up to this (see own_reasons).
BWD_MAX_SCALE_RATIO = 1.5


def _native_fp16() -> bool:
    """Whether this CPU computes float16 natively in PyTorch's kernels (AMX-FP16).  Elsewhere the float16 kernel
    converts as it goes: on a Zen 4 EPYC it ran 1.7-2x slower forward and 8.7x slower backward than the float32
    kernel on float32 copies (PERFLOG row 54)."""
    fn = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    return bool(fn and fn())


def _kernel_dtype(dtype: torch.dtype, biased: bool) -> torch.dtype:
    """The dtype the kernel runs in: float32 for float16 inputs (where float16 is not native) and for fp16 / bf16
    inputs with ALiBi or attn_bias (the kernel adds its mask in its own dtype; the contract's bias is float32);
    otherwise the inputs' own.  Computing in float32 is closer to the exact result, never further."""
    if dtype == torch.float16 and not _native_fp16():
        return torch.float32
    if biased and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _ops():
    aten = torch.ops.aten
    return (getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None),
            getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)   # [B, S, H, D] -> [B, H, S, D], a view


# The ops' Python bindings where torch exposes them: ~2.5 us less per call than torch.ops.aten's dispatch.
_FWD_BINDING = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD_BINDING = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fwd(q, k, v, causal: bool, scale: float, mask=None):
    """One kernel call on [B, S, H, D] tensors -> (out [B, Sq, Hq, D], lse [B, Hq, Sq]); mask: additive [1, 1, Sq, Sk]
    in q's dtype (the kernel's attn_mask) or None."""
    fwd = _FWD_BINDING or _ops()[0]
    out, lse = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), lse


def _bwd(do, q, k, v, out, lse, dlse, causal: bool, scale: float, mask=None):
    """The kernel's backward; dlse [B, Hq, Sq] or None (a returned lse that is differentiated).

    The kernel computes dS = P * (dP - D) with D = rowsum(dO * O) and has no lse-gradient input; the exact
    gradient needs D - dlse.  One extra zero column on q, k and v leaves the scores and dP unchanged, while a
    column of ones on dO against a column of -dlse on O adds -dlse to D; the extra gradient columns are dropped.
    (An O(S * D) copy, only for calls that differentiate lse.)"""
    bwd = _BWD_BINDING or _ops()[1]
    if dlse is None:   # the common call: the kernel's gradients as they are
        g = bwd(do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2), lse,
                0.0, causal, attn_mask=mask, scale=scale)
        return g[0].transpose(1, 2), g[1].transpose(1, 2), g[2].transpose(1, 2)
    d = q.shape[-1]
    pad = torch.nn.functional.pad
    q, k, v = (pad(x, (0, 1)) for x in (q, k, v))
    out = torch.cat([out, -dlse.transpose(1, 2)[..., None].to(out.dtype)], -1)
    do = pad(do, (0, 1), value=1.0)
    g = bwd(_bhsd(do), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, attn_mask=mask, scale=scale)
    return tuple(_bhsd(x)[..., :d] for x in g)


def _parts(sq: int, sk: int, causal: bool):
    """A (Sq, Sk) problem as kernel calls: [(q rows, key range, is_causal)], rows/keys as (start, stop)."""
    if not causal or sq == sk:
        return [((0, sq), (0, sk), causal)]
    if sq > sk:   # rows [0, Sq - Sk) see nothing; the rest is square
        return [((sq - sk, sq), (0, sk), True)]
    return [((0, sq), (0, sk - sq), False), ((0, sq), (sk - sq, sk), True)]


def _merged(res, dtype):
    """Exact merge of key parts [(out, lse)] of the same rows (flashport.merge's rule, weighed in the lse's dtype:
    float64 for float64 calls, where merge_states_torch weighs in float32): the two parts of a Sq < Sk causal call,
    or a band's masked edges and unmasked middle.  A row that sees none of a part has lse -inf there; one that sees
    nothing at all gets out 0, lse -inf.  -> (out, lse in the parts' dtype)."""
    lse = res[0][1]
    for _, l in res[1:]:
        lse = torch.logaddexp(lse, l)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = sum(o.to(lse.dtype) * torch.exp(l - ref).transpose(1, 2)[..., None] for o, l in res)
    return out.to(dtype), lse


class SdpaCpuBackend(dispatch.Backend):
    """PyTorch's CPU flash kernel (aten `_scaled_dot_product_flash_attention_for_cpu` and its backward): dense and
    varlen attention and KV caches, none, causal, windows, ALiBi, mask_mod, block masks and inference attn_bias
    (bottom-right, exact for every Sq / Sk), GQA, any scale, fwd + bwd, `lse`.
    Chosen automatically on CPU ahead of `blockwise` (measured faster there: flashport bench on a CPU)."""

    name = "sdpa-cpu"
    auto_devices = ("cpu",)
    state_family = "sdpa-cpu"   # private state: lse in the kernel's dtype (float64 for float64 inputs)
    caps = Capabilities(devices=("cpu",), dtypes=("float16", "bfloat16", "float32", "float64"),
                        max_head_dim=None, dv_ne_d=False, kinds=("dense", "varlen", "kvcache"),
                        mask_kinds=("none", "causal", "window"), softcap=False, alibi=True, dropout=False,
                        sdpa_flash_devices=("cpu",), mods=("mask_mod", "block_mask", "attn_bias"), mod_grads=False,
                        notes=("causal bottom-right: Sq < Sk as two kernel calls merged by lse, Sq > Sk by "
                               "skipping the rows that see no key",
                               "varlen: one kernel call per sequence (cu_seqlens read on the host, a CPU tensor)",
                               "KV cache (dense or paged): one kernel call per sequence over its valid keys (pages "
                               "gathered)",
                               "windows and ALiBi: bands of 256 query rows with an additive mask",
                               "float16 runs on float32 copies where the CPU has no native float16 (2-9x faster); "
                               "fp16 / bf16 with ALiBi or attn_bias too (a float32 mask)",
                               "a differentiated lse: the backward adds one padded column (see _bwd)",
                               "mask_mod / block masks: the bands' masks, keys trimmed to those a band sees; attn_bias "
                               "(inference) in the same masks; no score_mod",
                               "deterministic=True served: its backward measured bitwise reproducible, GQA included (tests/test_sdpa_cpu.py)"))

    def availability(self) -> list[str]:
        if None in _ops():
            return [f"torch {torch.__version__} lacks aten._scaled_dot_product_flash_attention_for_cpu"]
        return []

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        r = []
        if spec.softmax_scale <= 0:
            # measured (torch 2.13): with a negative scale the float16 path returns inf / garbage rows
            r.append(f"softmax_scale {spec.softmax_scale:g} <= 0 (the kernel's float16 path breaks on it)")
        if "attn_bias" in spec.mods and (spec.needs_grad or role == "bwd"):
            # forward too: the pair stays one backend's (a float64 call would lose its float64 lse across backends)
            r.append("attn_bias in a call that needs grads (the kernel's backward gives no gradient for its mask)")
        if role == "bwd" and spec.softmax_scale * math.sqrt(spec.head_dim) > BWD_MAX_SCALE_RATIO:
            # measured: on peaked softmaxes the kernel's gradients err up to ~7x the fp32 math path's (the rule
            # allows 3x); at the default scale they stay well inside it
            r.append(f"backward with softmax_scale {spec.softmax_scale:g} > {BWD_MAX_SCALE_RATIO} / sqrt(D): the "
                     f"kernel's gradients exceed the tolerance rule on peaked softmaxes")
        return r

    def run(self, spec: AttnSpec, inputs: AttnInputs):
        """This backend alone, forward and backward.  The common training call (_native_autograd) runs the aten op
        under PyTorch's own derivative formula: the same two kernel calls as forward() and backward(), without
        flashport's Python autograd node (measured: ~100 us less host time per forward + backward at small shapes,
        half of flashport's overhead there).  Its backward is counted by a hook on the output's gradient; with a
        profiler recording, the call takes the general path, which brackets the backward in its range."""
        if not _native_autograd(spec, inputs):
            return super().run(spec, inputs)
        q, k, v = inputs.q, inputs.k, inputs.v
        out, lse = _fwd(q, k, v, spec.window_right == 0, spec.softmax_scale)
        flops = monitor.flops(spec, "bwd")
        out.register_hook(lambda g: monitor.add("sdpa-cpu", backward=1, flops=flops))
        return out, lse.float()

    def forward(self, spec: AttnSpec, inputs: AttnInputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        causal, scale = (spec.window_left, spec.window_right), spec.softmax_scale
        slopes = alibi_per_batch(spec, inputs.alibi_slopes)
        if spec.kind == "dense":
            return _forward(q, k, v, causal, scale, slopes, _mods(spec, inputs))
        if spec.kind == "kvcache":
            return _kvcache(spec, inputs, causal, scale, slopes)
        # varlen: one kernel call (or two, bottom-right causal) per sequence; rows past cu_seqlens_q[-1] stay zero
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(q.shape[0], spec.heads_q, spec.head_dim_v)
        lse = torch.full((spec.heads_q, q.shape[0]), _NEG_INF, dtype=lse_dtype, device=q.device)
        for n, (q0, q1, k0, k1) in enumerate(varlen_segments(inputs)):
            o, _, l = _forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, scale,
                               None if slopes is None else slopes[n:n + 1], _mods(spec, inputs, 1, n))
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
        return out, lse.float(), lse

    def backward(self, spec: AttnSpec, inputs: AttnInputs, saved: dispatch.Saved, dout, dlse):
        q, k, v, out = saved.q, saved.k, saved.v, saved.out
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = saved.private if saved.private is not None else saved.lse.to(lse_dtype)
        causal, scale = (spec.window_left, spec.window_right), spec.softmax_scale
        dout = dout.to(q.dtype)
        slopes = alibi_per_batch(spec, inputs.alibi_slopes)
        if spec.kind == "dense":
            return _backward(dout, q, k, v, out, lse, dlse, causal, scale, slopes, _mods(spec, inputs))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for n, (q0, q1, k0, k1) in enumerate(varlen_segments(inputs)):
            g = _backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                          lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1], causal, scale,
                          None if slopes is None else slopes[n:n + 1], _mods(spec, inputs, 1, n))
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


def _native_autograd(spec: AttnSpec, inputs: AttnInputs) -> bool:
    """Whether a call is one kernel call whose gradients PyTorch's own formula for the aten op gives exactly as
    backward() would: dense, gradients needed, no band (no window but causal, no ALiBi, no mods), causal only with
    Sq == Sk, the inputs' own dtype, no empty side, lse not returned (the op's lse has no gradient), and no
    profiler recording (the general path gives the backward its range)."""
    return (spec.needs_grad and spec.kind == "dense" and not spec.return_lse and inputs.prog is None
            and inputs.alibi_slopes is None and spec.window_left < 0 and spec.window_right in (-1, 0)
            and (spec.window_right < 0 or spec.seqlen_q == spec.seqlen_k) and spec.batch > 0
            and spec.seqlen_q > 0 and spec.seqlen_k > 0 and _kernel_dtype(spec.dtype, False) == spec.dtype
            and not monitor.profiling())


def _mods(spec: AttnSpec, inputs: AttnInputs, batch: Optional[int] = None, b0: int = 0) -> Optional[Mods]:
    if inputs.prog is None:
        return None
    return Mods(inputs.prog, spec.batch if batch is None else batch, spec.heads_q, b0)


def _kvcache(spec: AttnSpec, inputs: AttnInputs, window, scale: float, slopes):
    """Inference over a dense or paged cache: batch entry b is a dense problem over its first seqlens_k[b] keys
    (host values; the whole cache when seqlens_k is None), bottom-right aligned to them like every other call."""
    q = inputs.q
    if inputs.seqlens_k is None:
        out, lse, _ = _forward(q, inputs.k, inputs.v, window, scale, slopes)
        return out, lse, None
    out = q.new_zeros(*q.shape[:3], spec.head_dim_v)
    lse = torch.full((q.shape[0], spec.heads_q, q.shape[1]), _NEG_INF, dtype=torch.float32)
    table = inputs.block_table if spec.paged else None
    for b, n in enumerate(inputs.seqlens_k.tolist()):
        kb, vb = sequence_kv(inputs.k, inputs.v, table, b, n)
        o, l, _ = _forward(q[b:b + 1], kb, vb, window, scale, None if slopes is None else slopes[b:b + 1])
        out[b], lse[b] = o[0], l[0]
    return out, lse, None


def _biased(slopes, mods: Optional[Mods]) -> bool:
    return slopes is not None or (mods is not None and mods.prog.attn_bias is not None)


def _forward(q, k, v, window, scale: float, slopes=None, mods: Optional[Mods] = None):
    """One dense problem [B, S, H, D] -> (out in q's dtype, lse float32, lse in the kernel's dtype); window: (left,
    right) with causal as (-1, 0); slopes: ALiBi [B, Hq] float32 or None."""
    kd = _kernel_dtype(q.dtype, _biased(slopes, mods))
    if kd == q.dtype:
        return _forward_as_is(q, k, v, window, scale, slopes, mods)
    out, lse, private = _forward_as_is(q.to(kd), k.to(kd), v.to(kd), window, scale, slopes, mods)
    return out.to(q.dtype), lse, private


def _forward_as_is(q, k, v, window, scale: float, slopes=None, mods: Optional[Mods] = None):
    """_forward in the inputs' own dtype."""
    b, sq, hq, _ = q.shape
    sk, dv = k.shape[1], v.shape[3]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if b == 0 or sq == 0 or sk == 0:   # nothing to attend: zeros, lse = -inf (the kernel gives NaN)
        out = q.new_zeros(b, sq, hq, dv)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=lse_dtype, device=q.device)
        return out, lse.float(), lse
    if banded(window, slopes, mods):
        out = q.new_zeros(b, sq, hq, dv)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=lse_dtype, device=q.device)
        for m0, m1, parts in bands(sq, sk, window, split=slopes is None, mods=mods):
            res = []
            for lo, hi, seen, empty in parts:
                mask = additive_mask(seen, q.dtype, slopes, (m0, m1, lo, hi, sq, sk), mods)
                o, l = _fwd(q[:, m0:m1], k[:, lo:hi], v[:, lo:hi], False, scale, mask)
                if empty is not None and empty.any():   # the kernel gives 0 and lse 0 there; the contract -inf
                    o = o.masked_fill(empty.transpose(1, 2)[..., None], 0)
                    l = l.masked_fill(empty, _NEG_INF)
                res.append((o, l))
            o, l = res[0] if len(res) == 1 else _merged(res, q.dtype)
            out[:, m0:m1], lse[:, :, m0:m1] = o, l
        return out, lse.float(), lse
    causal = window[1] == 0
    if not causal or sq == sk:   # the common call: one kernel call on the tensors as given
        o, l = _fwd(q, k, v, causal, scale)
        return o, l.float(), l
    parts = _parts(sq, sk, causal)
    if len(parts) == 1:
        (m0, m1), (n0, n1), part_causal = parts[0]
        o, l = _fwd(q[:, m0:m1], k[:, n0:n1], v[:, n0:n1], part_causal, scale)
        if m0 == 0:
            return o, l.float(), l
        out = q.new_zeros(b, sq, hq, dv)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=lse_dtype, device=q.device)
        out[:, m0:] = o
        lse[:, :, m0:] = l
        return out, lse.float(), lse
    out, lse = _merged([_fwd(q, k[:, n0:n1], v[:, n0:n1], part_causal, scale) for _, (n0, n1), part_causal in parts],
                       q.dtype)
    return out, lse.float(), lse


def _backward(dout, q, k, v, out, lse, dlse, window, scale: float, slopes=None, mods: Optional[Mods] = None):
    """Gradients of one dense problem from its (out, lse in the kernel's dtype), in the inputs' dtype."""
    kd = _kernel_dtype(q.dtype, _biased(slopes, mods))
    if kd == q.dtype:
        return _backward_as_is(dout, q, k, v, out, lse, dlse, window, scale, slopes, mods)
    grads = _backward_as_is(*(x.to(kd) for x in (dout, q, k, v, out)), lse, dlse, window, scale, slopes, mods)
    return tuple(g.to(q.dtype) for g in grads)


def _backward_as_is(dout, q, k, v, out, lse, dlse, window, scale: float, slopes=None, mods: Optional[Mods] = None):
    """_backward in the inputs' own dtype."""
    sq, sk = q.shape[1], k.shape[1]
    if q.numel() == 0 or sk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if banded(window, slopes, mods):
        # Each band's gradients from the whole problem's (out, lse): dQ of its rows, dK / dV added over the bands.
        # Rows that see nothing get lse = +inf, so P = exp(s - lse) = 0 there (the kernel would read -inf - -inf).
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
        for m0, m1, parts in bands(sq, sk, window, split=slopes is None, mods=mods):
            for lo, hi, seen, _ in parts:
                mask = additive_mask(seen, q.dtype, slopes, (m0, m1, lo, hi, sq, sk), mods)
                gq, gk, gv = _bwd(dout[:, m0:m1], q[:, m0:m1], k[:, lo:hi], v[:, lo:hi], out[:, m0:m1],
                                  lse[:, :, m0:m1].contiguous(), None if dlse is None else dlse[:, :, m0:m1], False,
                                  scale, mask)
                dq[:, m0:m1] += gq
                dk[:, lo:hi] += gk
                dv[:, lo:hi] += gv
        return dq, dk, dv
    causal = window[1] == 0
    parts = _parts(sq, sk, causal)
    if len(parts) == 1 and parts[0][0][0] == 0:   # one kernel call over every row and key: its gradients as they are
        return _bwd(dout, q, k, v, out, lse, dlse, parts[0][2], scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (m0, m1), (n0, n1), part_causal in parts:
        gq, gk, gv = _bwd(dout[:, m0:m1], q[:, m0:m1], k[:, n0:n1], v[:, n0:n1], out[:, m0:m1],
                          lse[:, :, m0:m1].contiguous(), None if dlse is None else dlse[:, :, m0:m1],
                          part_causal, scale)
        dq[:, m0:m1] += gq
        dk[:, n0:n1] = gk
        dv[:, n0:n1] = gv
    return dq, dk, dv
