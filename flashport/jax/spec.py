"""Validation of a `flashport.jax.attention` call, once, into a frozen, hashable `JaxSpec`.

The spec duck-types the torch side's `AttnSpec` where `flashport.capabilities.reasons` reads it (device
type, dtype name, head dims, kind, visibility, softcap, lse, GQA), so both frontends refuse calls with the
same words.  It is also the static key of the jitted backend calls: equal specs never retrace.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from ..masks import Visibility

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Device:
    type: str            # JAX platform: "cpu", "gpu" or "tpu" (what capabilities.reasons reads)


@dataclass(frozen=True)
class JaxSpec:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str                   # "bfloat16", ...
    device: Device
    softmax_scale: float
    window_left: int             # -1: unbounded
    window_right: int            # -1: unbounded; causal is 0
    softcap: float
    segments: str                # "none", "shared" ([B, S] for queries and keys) or "pair" ((q_ids, kv_ids))
    return_lse: bool
    # what the torch side's capability check reads and a JAX call never has
    kind: ClassVar[str] = "dense"
    paged: ClassVar[bool] = False
    alibi: ClassVar[None] = None
    dropout_p: ClassVar[float] = 0.0
    deterministic: ClassVar[bool] = False
    needs_grad: ClassVar[bool] = True    # JAX differentiates after the call: every backend serves both

    @property
    def visibility(self) -> Visibility:
        return Visibility(self.seqlen_q, self.seqlen_k, self.window_left, self.window_right)

    @property
    def groups(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def score_count(self) -> int:
        """Scores one (batch, head) materialises: Sq * Sk."""
        return self.seqlen_q * self.seqlen_k


def platform_of(x) -> str:
    """The platform an array lives on; a tracer has none, so the default backend's."""
    try:
        devices = x.devices()
    except Exception:  # a tracer under jit / grad
        devices = None
    if devices:
        return next(iter(devices)).platform
    return jax.default_backend()


def _array(x, name: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def _segment(x, name: str, batch: int, length: int, what: str):
    x = _array(x, name)
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name} must be int32, got {_dtype_name(x)}")
    if tuple(x.shape) != (batch, length):
        raise ValueError(f"{name} must be [B, {what}] = [{batch}, {length}], got {list(x.shape)}")
    return x


def validate(q, k, v, *, causal, softmax_scale, window_size, softcap, segment_ids, return_lse):
    """-> (spec, q, k, v, q_segment_ids or None, kv_segment_ids or None).  Raises ValueError / TypeError
    naming the argument for malformed input."""
    q, k, v = _array(q, "q"), _array(k, "k"), _array(v, "v")
    for name, t, want in (("q", q, "[B, Sq, Hq, D]"), ("k", k, "[B, Sk, Hkv, D]"), ("v", v, "[B, Sk, Hkv, Dv]")):
        if t.ndim != 4:
            raise ValueError(f"{name} must be {want} (rank 4), got shape {list(t.shape)}")
        if _dtype_name(t) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be floating ({', '.join(FLOAT_DTYPES)}), got {_dtype_name(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {_dtype_name(q)}, {_dtype_name(k)}, {_dtype_name(v)}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k and v must have q's batch size {b}, got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"v must match k's [B, Sk, Hkv], got {list(v.shape[:3])} vs {list(k.shape[:3])}")
    if k.shape[3] != d:
        raise ValueError(f"k's head dim must equal q's ({d}), got {k.shape[3]}")
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's heads ({hkv}) (GQA / MQA)")
    if d == 0 or dv == 0:
        raise ValueError("head dims of q, k and v must be >= 1")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    left, right = _window(window_size)
    if causal:
        if right not in (-1, 0):
            raise ValueError(f"causal=True contradicts window_size[1] = {right} (use -1 or 0)")
        right = 0
    scale = _real(softmax_scale, "softmax_scale") if softmax_scale is not None else 1.0 / math.sqrt(d)
    cap = _real(softcap, "softcap")
    if cap < 0:
        raise ValueError(f"softcap must be >= 0, got {cap}")
    q_seg = kv_seg = None
    segments = "none"
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError("segment_ids must be one [B, S] array or a pair (q_ids [B, Sq], kv_ids [B, Sk])")
            q_seg = _segment(segment_ids[0], "segment_ids[0]", b, sq, "Sq")
            kv_seg = _segment(segment_ids[1], "segment_ids[1]", b, sk, "Sk")
            segments = "pair"
        else:
            if sq != sk:
                raise ValueError(f"segment_ids as one array needs Sq == Sk (got {sq} and {sk}); "
                                 "pass (q_ids, kv_ids) for different lengths")
            q_seg = kv_seg = _segment(segment_ids, "segment_ids", b, sq, "S")
            segments = "shared"
    spec = JaxSpec(batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv,
                   dtype=_dtype_name(q), device=Device(platform_of(q)), softmax_scale=scale,
                   window_left=left, window_right=right, softcap=cap, segments=segments,
                   return_lse=bool(return_lse))
    return spec, q, k, v, q_seg, kv_seg


def _window(window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size {side} must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {w}")
        out.append(int(w))
    return out[0], out[1]


def _real(x, name: str) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python number (a static value, not an array), got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def empty_result(spec: JaxSpec, q, v) -> tuple:
    """A call with no keys (or no rows): zeros and lse = -inf, without a kernel."""
    out = jnp.zeros((spec.batch, spec.seqlen_q, spec.heads_q, spec.head_dim_v), q.dtype)
    lse = jnp.full((spec.batch, spec.heads_q, spec.seqlen_q), -jnp.inf, jnp.float32)
    return out, lse

