"""Backends `pallas-tpu` (splash attention) and `pallas-tpu-flash` (the older flash attention): the Pallas
TPU kernels JAX ships in jax.experimental.pallas.ops.tpu.  On a TPU they compile with Mosaic; on any other
platform they run in Pallas' TPU interpret mode (CPU, slow: for tests on small shapes), so they are
auto-selected on TPUs only and serve a CPU call only when named.

`pallas-tpu` maps the contract onto splash attention (make_splash_mha, per batch entry under vmap):
- the visibility rule onto splash's lazy masks with offset Sk - Sq (bottom-right alignment):
  FullMask (none), CausalMask(offset) (causal), LocalMask((left, right), offset) (windows);
- GQA natively (splash's MHA kernel reads query head h from KV head h // G: K/V are not expanded);
- softcap onto attn_logits_soft_cap; softmax_scale by scaling q (splash has no scale argument);
- segment ids shared by queries and keys onto splash's SegmentIds;
- rows that see no key (bottom-right windows with Sq > Sk): splash leaves them the mean of V or NaN (its
  mask value is finite and fully masked blocks are skipped), so they are found from the rule in O(Sq)
  and set to zero outside the kernel; their cotangent is then zero and the kernel's backward adds nothing.
It refuses: return_lse (splash's logsumexp comes only from its save_residuals forward, which has no VJP);
separate query / key segment ids (rows may then see no key and splash cannot say which, cheaply);
Sq or Sk not a multiple of 128 (splash's blocks: key blocks are multiples of 128 lanes, and segment ids
need 128-row query blocks); fp16 and fp64 (TPUs compute in bf16 / fp32).

`pallas-tpu-flash` (jax.experimental.pallas.ops.tpu.flash_attention) is narrower: one KV head per query
head (no GQA without expanding K/V, which the contract forbids), D = Dv, head dim <= 128 or a multiple of
128, causal only top-left (so Sq == Sk), no windows, no softcap, no lse, Sq and Sk multiples of 128.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .mask import rows_with_keys
from .registry import JaxBackend, JaxCapabilities

BLOCK = 128          # NUM_LANES: the smallest block both kernels take
BLOCK_PREFS = (512, 256, 128)


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def _block(n: int) -> int:
    return next(b for b in BLOCK_PREFS if n % b == 0)


def _import_error(module: str) -> list[str]:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - an import failure of any kind means the kernel is not there
        return [f"{module} not importable ({type(e).__name__}: {e})"]
    return []


def _zero_empty_rows(spec, out):
    vis = spec.visibility
    if vis.kind == "none" or (vis.kind == "causal" and spec.seqlen_q <= spec.seqlen_k):
        return out          # every row sees a key (bottom-right causal with Sq <= Sk: its diagonal key)
    return jnp.where(rows_with_keys(spec)[None, :, None, None], out, jnp.zeros((), out.dtype))


def _scaled(spec, q):
    return (q.astype(jnp.float32) * spec.softmax_scale).astype(q.dtype)


class SplashBackend(JaxBackend):
    """Pallas TPU splash attention: masks none / causal / window (bottom-right), GQA, softcap, shared
    segment ids; bf16 / fp32; Sq, Sk multiples of 128; no return_lse.  Interpret mode off TPU."""

    name = "pallas-tpu"
    caps = JaxCapabilities(devices=("tpu", "cpu"), dtypes=("bfloat16", "float32"), max_head_dim=None,
                           lse=False, pair_segment_ids=False,
                           notes=("Sq and Sk multiples of 128", "off TPU: Pallas TPU interpret mode (slow)"))
    auto_platforms = ("tpu",)
    module = "jax.experimental.pallas.ops.tpu.splash_attention"

    def availability(self):
        return _import_error(self.module)

    def own_reasons(self, spec):
        r = []
        if spec.return_lse:
            r.append("return_lse (splash's logsumexp output has no VJP)")
        for name, n in (("Sq", spec.seqlen_q), ("Sk", spec.seqlen_k)):
            if n % BLOCK:
                r.append(f"{name} = {n} not a multiple of {BLOCK} (splash's blocks)")
        return r

    def forward(self, spec, opts, q, k, v, q_seg, kv_seg):
        kernel = _splash_kernel(spec.heads_q, spec.seqlen_q, spec.seqlen_k, spec.window_left, spec.window_right,
                                spec.softcap, not _on_tpu())
        qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (_scaled(spec, q), k, v))   # [B, H, S, D]
        if q_seg is None:
            out = jax.vmap(kernel)(qt, kt, vt)
        else:
            from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
            out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=SegmentIds(s, s)))(qt, kt, vt, q_seg)
        return _zero_empty_rows(spec, jnp.swapaxes(out, 1, 2).astype(q.dtype)), None


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads, sq, sk, left, right, softcap, interpret):
    # Built at compile time even when first asked for inside a jit trace: the kernel holds its mask's arrays, and
    # arrays made under a trace would be that trace's tracers, kept by the cache and escaping into every later
    # trace with the same key (another batch, dtype or head dim: UnexpectedTracerError)
    with jax.ensure_compile_time_eval():
        return _build_splash_kernel(heads, sq, sk, left, right, softcap, interpret)


def _build_splash_kernel(heads, sq, sk, left, right, softcap, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (BlockSizes, CausalMask, FullMask, LocalMask,
                                                                  MultiHeadMask, make_splash_mha)
    offset = sk - sq      # bottom-right: row i's diagonal key is i + Sk - Sq
    if left < 0 and right < 0:
        mask = FullMask((sq, sk))
    elif left < 0 and right == 0:
        mask = CausalMask((sq, sk), offset=offset)
    else:
        mask = LocalMask((sq, sk), (None if left < 0 else left, None if right < 0 else right), offset=offset)
    bq, bkv = _block(sq), _block(sk)
    sizes = BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                       block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    return make_splash_mha(MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                           attn_logits_soft_cap=softcap if softcap > 0 else None, interpret=interpret)


class FlashBackend(JaxBackend):
    """Pallas TPU flash attention (the older kernel): MHA only, D = Dv, masks none / causal with Sq == Sk,
    shared segment ids; bf16 / fp32; Sq, Sk multiples of 128; no softcap, windows or return_lse."""

    name = "pallas-tpu-flash"
    caps = JaxCapabilities(devices=("tpu", "cpu"), dtypes=("bfloat16", "float32"), max_head_dim=None,
                           dv_ne_d=False, mask_kinds=("none", "causal"), softcap=False, lse=False, gqa=False,
                           pair_segment_ids=False,
                           notes=("GQA would need expanded K/V", "causal is top-left: needs Sq == Sk",
                                  "Sq and Sk multiples of 128"))
    auto_platforms = ("tpu",)
    module = "jax.experimental.pallas.ops.tpu.flash_attention"

    def availability(self):
        return _import_error(self.module)

    def own_reasons(self, spec):
        r = []
        if spec.return_lse:
            r.append("return_lse (the kernel's l, m residuals have no VJP)")
        d = spec.head_dim
        if d > 128 and d % 128:
            r.append(f"head dim {d} (<= 128 or a multiple of 128)")
        if spec.visibility.kind == "causal" and spec.seqlen_q != spec.seqlen_k:
            r.append(f"causal with Sq != Sk ({spec.seqlen_q} vs {spec.seqlen_k}): the kernel aligns top-left")
        for name, n in (("Sq", spec.seqlen_q), ("Sk", spec.seqlen_k)):
            if n % BLOCK:
                r.append(f"{name} = {n} not a multiple of {BLOCK} (the kernel's blocks)")
        return r

    def forward(self, spec, opts, q, k, v, q_seg, kv_seg):
        from jax.experimental.pallas.ops.tpu import flash_attention as fa
        bq, bk = _block(spec.seqlen_q), _block(spec.seqlen_k)
        sizes = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1, block_q_major_dkv=bq,
                              block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bk,
                              block_k_dq=bk, block_q_dq=bq)
        causal = spec.visibility.kind == "causal"

        def call(q, k, v, seg):
            seg_ids = None if seg is None else fa.SegmentIds(seg, seg)
            return fa.flash_attention(q, k, v, segment_ids=seg_ids, causal=causal, sm_scale=spec.softmax_scale,
                                      block_sizes=sizes)

        qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        fn = call if _on_tpu() else _interpreted(call)
        return jnp.swapaxes(fn(qt, kt, vt, q_seg), 1, 2).astype(q.dtype), None


def _interpreted(fn):
    """fn run in Pallas' TPU interpret mode, forward and backward: the mode applies to pallas_calls traced
    under its context, and a kernel's own VJP is traced after the forward's context has closed, so the
    backward is traced here, inside the context, as jax.vjp's residual closure."""
    from jax.experimental.pallas import tpu as pltpu

    @jax.custom_vjp
    def run(q, k, v, seg):
        with pltpu.force_tpu_interpret_mode():
            return fn(q, k, v, seg)

    def fwd(q, k, v, seg):
        with pltpu.force_tpu_interpret_mode():
            out, pullback = jax.vjp(lambda a, b, c: fn(a, b, c, seg), q, k, v)
        return out, pullback

    def bwd(pullback, dout):
        with pltpu.force_tpu_interpret_mode():
            dq, dk, dv = pullback(dout)
        return dq, dk, dv, None

    run.defvjp(fwd, bwd)
    return run
