"""Backend `triton`: flashport's own FlashAttention kernels (flashport/kernels), forward and backward.

Runs on CUDA devices of compute capability >= 8.0, and on CPU tensors when TRITON_INTERPRET=1
(Triton's interpreter; CI uses it).  The kernels are imported on first use, because
`triton.jit` decides at decoration time whether a kernel is compiled or interpreted: importing
flashport never fixes that choice.  kvcache calls go to flashport.kernels.decode.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .. import dispatch
from ..kernels.versions import is_tested, tested_text
from ..spec import AttnInputs, AttnSpec

MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA grid limit for the head and batch dimensions


@functools.lru_cache(maxsize=None)
def _triton_version() -> Optional[str]:
    try:
        import triton
        return str(getattr(triton, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _allow_untested() -> bool:
    return os.environ.get("FLASHPORT_ALLOW_UNTESTED_TRITON", "0") == "1"


# Triton's interpreter runs bf16 dots wrongly (silently garbage, not an error): refused, never run.
BF16_INTERPRETER_REASON = "bfloat16 under TRITON_INTERPRET=1: Triton's interpreter computes bf16 dots wrongly"


def _interpreter_dtype_reasons(spec: AttnSpec, interpreting: bool) -> list[str]:
    return [BF16_INTERPRETER_REASON] if interpreting and spec.dtype == torch.bfloat16 else []


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_reasons(device: torch.device) -> list[str]:
    if device.type == "cpu":
        return [] if _interpreting() else ["CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter)"]
    if device.type != "cuda":
        return [f"device type {device.type!r} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"]
    if _interpreting():
        return ["TRITON_INTERPRET=1 runs kernels on CPU tensors only"]
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if major < 8:
        return [f"compute capability {major}.{minor} < 8.0 (the kernels need Ampere or newer)"]
    return []


def dropout_mask(rng_state: torch.Tensor, p: float, batch: int, heads_q: int, sq: int, sk: int) -> torch.Tensor:
    """The [B, Hq, Sq, Sk] bool keep-mask the kernels apply for dropout (small shapes only, for tests).

    The kernels evaluate the shared Philox mask of flashport.dropout in registers (kernels.common.
    dropout_keep, checked bit for bit against this in the interpreter tier); here it is dense."""
    from ..dropout import dense_keep_mask
    return dense_keep_mask(rng_state, p, batch, heads_q, sq, sk)


@dataclass
class _Call:
    """Everything but q, k, v that the forward and backward launchers need (the autograd options)."""

    spec: AttnSpec
    alibi: Optional[torch.Tensor]
    cu_seqlens_q: Optional[torch.Tensor]
    cu_seqlens_k: Optional[torch.Tensor]
    rng_state: Optional[torch.Tensor]

    def tensors(self):
        return dict(alibi=self.alibi, cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=self.cu_seqlens_k,
                    rng_state=self.rng_state)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        from ..kernels import attn_fwd
        out, lse, lse2 = attn_fwd.forward(call.spec, q, k, v, **call.tensors())
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.call = call
        # An output nobody differentiates (lse, unless return_lse and used) arrives as None, not as zeros that
        # autograd would allocate and the backward would subtract: two kernel launches of host time saved.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from ..kernels import attn_bwd
        from ..kernels.common import device_guard
        q, k, v, out, lse2 = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        if dout is None:   # only lse is differentiated
            dout = torch.zeros_like(out)
        call = ctx.call
        with device_guard(q.device):
            dq, dk, dv = attn_bwd.backward(call.spec, dout, q, k, v, out, lse2, dlse=dlse, **call.tensors())
        return dq, dk, dv, None


class TritonBackend(dispatch.Backend):
    name = "triton"
    # Under TRITON_INTERPRET=1 it serves CPU tensors when named, but auto-selection never lands on
    # the interpreter (a test device, orders of magnitude slower than blockwise).
    auto_devices = ("cuda",)
    capabilities = {"materialises_scores": False, "fwd": True, "bwd": True, "varlen": True, "kvcache": True,
                    "paged_kvcache": True, "dropout": True, "alibi": True, "softcap": True, "window": True,
                    "deterministic_backward": True, "max_head_dim": MAX_HEAD_DIM,
                    "dtypes": ["float16", "bfloat16", "float32"],
                    "devices": "cuda (compute capability >= 8.0); cpu with TRITON_INTERPRET=1",
                    "hopper_forward": "sm_90: D = 64, 128 or 256 (q/k and v alike) bf16/fp16 contiguous forward, "
                                      "lengths a multiple of 128 from per-head-dim floors (attn_fwd_hopper.MIN_KEYS / "
                                      "MIN_KEYS_CAUSAL), no window/softcap/ALiBi/dropout: Gluon kernel with "
                                      "FlashAttention-3's schedule (FLASHPORT_HOPPER_FWD=0: off)",
                    "hopper_backward": "sm_90: D = 64 or 128 bf16/fp16 contiguous backward with deterministic=False, "
                                       "lengths >= 128 (ragged ones too: the last tiles masked), "
                                       "no window/softcap/ALiBi/dropout: Gluon kernel "
                                       "with FA3's 5-matmul schedule, dQ summed into float32 by TMA reduce-adds "
                                       "(FLASHPORT_HOPPER_BWD=0: off; deterministic=True keeps the bitwise "
                                       "reproducible Triton kernels)"}

    def availability(self) -> list[str]:
        return list(_availability(_triton_version(), _interpreting(), _allow_untested()))

    def supports(self, spec: AttnSpec) -> list[str]:
        if spec.kind == "kvcache":  # the KV-cache kernel states its own limits (memoised per spec there)
            reasons = _device_reasons(spec.device) + _interpreter_dtype_reasons(spec, _interpreting())
            try:
                from ..kernels.decode import kvcache_supports
            except ImportError:
                return reasons + ["kvcache kernel not available"]
            return reasons + kvcache_supports(spec)
        return list(_supports(spec, _interpreting()))

    def run(self, spec: AttnSpec, inputs: AttnInputs):
        if spec.kind == "kvcache":
            from ..kernels.decode import kvcache_attention
            return kvcache_attention(spec, inputs)
        call = _Call(spec, inputs.alibi_slopes, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.rng_state)
        from ..kernels.common import device_guard
        with device_guard(spec.device):
            if spec.needs_grad:
                return _TritonAttention.apply(inputs.q, inputs.k, inputs.v, call)
            from ..kernels import attn_fwd
            out, lse, _ = attn_fwd.forward(spec, inputs.q, inputs.k, inputs.v, **call.tensors())
            return out, lse


# Both answers depend only on the spec (a frozen, hashable dataclass), the installed Triton, the cards and
# TRITON_INTERPRET (part of the key), and they are asked on every call: memoised, since a training or
# serving loop repeats the same few shapes (each call costs microseconds of host time otherwise).
@functools.lru_cache(maxsize=None)
def _availability(version: Optional[str], interpreting: bool, allow_untested: bool) -> tuple[str, ...]:
    if version is None:
        return ("triton is not installed",)
    if not allow_untested and not is_tested(version):
        # The kernels and launchers use young / private Triton API: an older or newer release may fail to
        # compile them, or compile them differently.  Refused with the way out, not tried.
        return (f"triton {version} is untested (flashport's kernels are tested on {tested_text()}); "
                f"FLASHPORT_ALLOW_UNTESTED_TRITON=1 to try it",)
    if interpreting:
        return ()
    if not torch.cuda.is_available():
        return ("no CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU tensors)",)
    if not any(_capability(i)[0] >= 8 for i in range(torch.cuda.device_count())):
        return ("no CUDA device with compute capability >= 8.0",)
    return ()


@functools.lru_cache(maxsize=1024)
def _supports(spec: AttnSpec, interpreting: bool) -> tuple[str, ...]:
    reasons = _device_reasons(spec.device) + _interpreter_dtype_reasons(spec, interpreting)
    if spec.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {spec.dtype} is not supported (float16, bfloat16, float32)")
    if max(spec.head_dim, spec.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(f"head dim {max(spec.head_dim, spec.head_dim_v)} > {MAX_HEAD_DIM}")
    if spec.heads_q > MAX_GRID_YZ or spec.batch > MAX_GRID_YZ:
        reasons.append(f"batch {spec.batch} or heads {spec.heads_q} exceeds the grid limit {MAX_GRID_YZ}")
    if not reasons and spec.device.type == "cuda":
        from ..kernels.tuning import smem_reasons
        reasons += smem_reasons(spec, spec.device)
    return tuple(reasons)
