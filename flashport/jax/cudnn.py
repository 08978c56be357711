"""Backend `cudnn`: jax.nn.dot_product_attention(implementation="cudnn"), cuDNN's fused flash attention
(forward and backward kernels, no materialised scores), on NVIDIA GPUs.

What JAX's cuDNN path cannot take, and so this backend refuses:
- fp32 / fp64 (cuDNN's flash attention is fp16 / bf16);
- head dims that are not a multiple of 8 or above 256 (128 before Hopper), Dv != D (the API needs v like k);
- bottom-right alignment: cuDNN's causal mask is top-left, so causal and windows need Sq == Sk;
- a right window bound other than 0 (cuDNN's sliding window is left-only, with the causal mask);
- odd Sq or Sk (jax 0.11's cuDNN check raises "Unsupported sequence length" for them when differentiating);
- softcap; segment ids (jax.nn exposes them only as a dense [B, 1, Sq, Sk] mask);
- return_lse: jax's cuDNN residual is rounded to the output dtype and its VJP drops the lse cotangent.
Where Sq == Sk every row sees its own key, so no row is empty.
"""
from __future__ import annotations

import jax

from .registry import JaxBackend, JaxCapabilities


def _gpu():
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


def compute_capability() -> tuple:
    d = _gpu()
    cc = getattr(d, "compute_capability", None) if d is not None else None
    return tuple(int(x) for x in cc.split(".")) if cc else (0, 0)


class CudnnBackend(JaxBackend):
    """cuDNN fused attention via jax.nn.dot_product_attention; NVIDIA GPU, sm_80+, fp16/bf16."""

    name = "cudnn"
    caps = JaxCapabilities(devices=("gpu",), dtypes=("float16", "bfloat16"), max_head_dim=256, dv_ne_d=False,
                           softcap=False, lse=False, segment_ids=False, pair_segment_ids=False,
                           min_capability=(8, 0),
                           notes=("causal / window need Sq == Sk (top-left masks)", "window: right bound 0 only",
                                  "head dim a multiple of 8, <= 128 before sm_90"))
    auto_platforms = ("gpu",)

    def availability(self):
        d = _gpu()
        if d is None:
            return ["no GPU (jax has no 'gpu' backend here)"]
        if "NVIDIA" not in getattr(d, "device_kind", "NVIDIA") and "cuda" not in str(d.client.platform_version):
            return [f"not an NVIDIA GPU ({d.device_kind})"]
        try:
            from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
            check_cudnn_version()
        except Exception as e:  # noqa: BLE001 - any failure here means no usable cuDNN
            return [f"cuDNN not usable: {e}"]
        return []

    def own_reasons(self, spec):
        r = []
        cc = compute_capability()
        if spec.device.type == "gpu" and cc < (8, 0):
            r.append(f"compute capability {cc[0]}.{cc[1]} < 8.0")
        top = 256 if cc >= (9, 0) else 128
        d = spec.head_dim
        if d % 8 or d > top:
            r.append(f"head dim {d} (cuDNN needs a multiple of 8, <= {top})")
        if spec.seqlen_q % 2 or spec.seqlen_k % 2:
            r.append(f"odd Sq / Sk ({spec.seqlen_q}, {spec.seqlen_k}): jax's cuDNN path refuses them for training")
        vis = spec.visibility
        if vis.kind != "none" and spec.seqlen_q != spec.seqlen_k:
            r.append(f"{vis.kind} mask with Sq != Sk ({spec.seqlen_q} vs {spec.seqlen_k}): cuDNN aligns top-left")
        if vis.right > 0 or (vis.left >= 0 and vis.right < 0):
            r.append(f"window {vis.left, vis.right} (cuDNN's sliding window is left-only, right bound 0)")
        return r

    def forward(self, spec, opts, q, k, v, q_seg, kv_seg):
        left, right = spec.window_left, spec.window_right
        out = jax.nn.dot_product_attention(
            q, k, v, scale=spec.softmax_scale, is_causal=right == 0,
            local_window_size=None if left < 0 else (left, 0), implementation="cudnn")
        return out, None
