"""Backend `sdpa`: PyTorch's own fused attention kernels (cuDNN, FlashAttention-2, mem-efficient)
through `torch.nn.functional.scaled_dot_product_attention`, for the calls they compute exactly.

Equivalent math (layout [B, Sq, Hq, D] in, [B, Sq, Hq, Dv] out):
    q_, k_, v_ = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # views, no copy
    out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=..., scale=softmax_scale,
                                         enable_gqa=Hq != Hkv).transpose(1, 2)

What it serves, and why not more:
- dense calls with no window or a causal one.  SDPA's `is_causal` is top-left aligned; flashport's
  rule is bottom-right, so for Sq != Sk we pass `causal_lower_right(Sq, Sk)`.  With Sq > Sk the
  first rows see no key and SDPA returns NaN there (flashport returns 0), so that is refused.
- no softcap, ALiBi, sliding windows, varlen or KV cache: SDPA has no fused form of them (an
  additive mask would materialise Sq x Sk).
- no dropout: SDPA draws its own RNG mask, not flashport's shared Philox keep-mask.
- no `return_lse`: SDPA does not expose the log-sum-exp publicly.
- CUDA: only the fused kernels are allowed (cuDNN > FA2 > mem-efficient, in that priority), never
  the MATH kernel, which materialises the scores; fp64 is refused (no fused kernel takes it), and
  so is deterministic backward (fused SDPA backward uses atomics).  On CPU, PyTorch's default
  choice is used (its flash-style CPU kernel for plain calls); `sdpa` is not auto-selected there.
Gradients flow through SDPA's own autograd.
"""
from __future__ import annotations

import dataclasses
import inspect
from functools import lru_cache

import torch
import torch.nn.functional as F

from .. import dispatch, monitor
from ..capabilities import Capabilities
from ..spec import AttnInputs, AttnSpec


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


_HAS_GQA = _torch_at_least(2, 5)  # enable_gqa= first appeared in torch 2.5

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - torch too old; availability() says so
    SDPBackend = sdpa_kernel = None


def causal_lower_right(sq: int, sk: int):
    # Imported on first use: torch.nn.attention.bias pulls in torch._dynamo (seconds of import time).
    from torch.nn.attention.bias import causal_lower_right as bias
    return bias(sq, sk)

# set_priority= (honour the list's order) first appeared in torch 2.6; before, PyTorch's own order
# (flash, efficient, then cuDNN) applies among the allowed kernels.
_SET_PRIORITY = sdpa_kernel is not None and "set_priority" in inspect.signature(sdpa_kernel).parameters

# Priority order on CUDA.  MATH is deliberately absent: it materialises Sq x Sk scores.
_FUSED = ("cudnn", "flash", "efficient")


_SDP = {"cudnn": lambda: SDPBackend.CUDNN_ATTENTION, "flash": lambda: SDPBackend.FLASH_ATTENTION,
        "efficient": lambda: SDPBackend.EFFICIENT_ATTENTION}


def _fused_backends():
    return [_SDP[k]() for k in _FUSED]


# The flags sdpa_kernel() sets, by the names of torch._C's getters and setters (torch.nn.attention._backend_names).
_FLAG_OF = {"cudnn": "cudnn", "flash": "flash", "efficient": "mem_efficient"}
_FLAGS = ("cudnn", "flash", "mem_efficient", "math", "overrideable")


def _flag_functions():
    """[(name, getter, setter)] of every SDPA enable flag, or None where this torch lacks one sdpa_kernel() uses."""
    funcs = [(n, getattr(torch._C, f"_get_{n}_sdp_enabled", None), getattr(torch._C, f"_set_sdp_use_{n}", None))
             for n in _FLAGS]
    present = [f for f in funcs if f[1] is not None and f[2] is not None]
    if len(present) < 4 or not hasattr(torch._C, "_set_sdp_priority_order"):
        return None
    return present


_FLAG_FUNCTIONS = _flag_functions()


class _Allowing:
    """sdpa_kernel(kernels, set_priority=True) without its Python per call (~20-30 µs on a CPU host, a cost every
    call of an SDPA backend paid): the same enable flags set through the same torch._C setters, restored on exit;
    the priority order set only for more than one kernel (alone, one has no order to keep)."""

    __slots__ = ("want", "prio", "saved", "saved_prio")

    def __init__(self, kernels):
        on = {_FLAG_OF[k] for k in kernels}
        self.want = [(setter, name in on) for name, _, setter in _FLAG_FUNCTIONS]
        self.prio = [int(_SDP[k]()) for k in kernels] if len(kernels) > 1 and _SET_PRIORITY else None

    def __enter__(self):
        self.saved = [(setter, getter()) for _, getter, setter in _FLAG_FUNCTIONS]
        for setter, value in self.want:
            setter(value)
        if self.prio is not None:
            self.saved_prio = torch._C._get_sdp_priority_order()
            torch._C._set_sdp_priority_order(self.prio + [p for p in self.saved_prio if p not in self.prio])
        return self

    def __exit__(self, *exc):
        for setter, value in self.saved:
            setter(value)
        if self.prio is not None:
            torch._C._set_sdp_priority_order(self.saved_prio)
        return False


def allowing(kernels):
    """A context in which SDPA may use only `kernels` (names of _FUSED), tried in that order."""
    if _FLAG_FUNCTIONS is None:
        prio = {"set_priority": True} if _SET_PRIORITY else {}
        return sdpa_kernel([_SDP[k]() for k in kernels], **prio)
    return _Allowing(kernels)


def _can_use():
    c = torch.backends.cuda
    return {"cudnn": getattr(c, "can_use_cudnn_attention", None), "flash": c.can_use_flash_attention,
            "efficient": c.can_use_efficient_attention}


def _causal_kind(spec: AttnSpec) -> str:
    """'none', 'top_left' (Sq == Sk, where both alignments agree) or 'lower_right'."""
    if spec.window_right == -1:
        return "none"
    return "top_left" if spec.seqlen_q == spec.seqlen_k else "lower_right"


@lru_cache(maxsize=512)
def _probe_cuda(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int, dv: int, sq: int,
                sk: int, causal_kind: str, needs_grad: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Which fused SDPA kernels accept this call -> (usable kernel names, reasons of the others).

    Asks PyTorch's own `can_use_*` checks on small stand-in tensors with the call's head counts,
    head dims, dtype, layout (a [B, S, H, D] buffer seen as [B, H, S, D]) and grad requirement;
    sequence lengths are capped because no fused kernel's eligibility depends on their size."""
    def t(s, h, dim):
        return torch.empty(1, s, h, dim, device=device, dtype=dtype, requires_grad=needs_grad).transpose(1, 2)

    sq_, sk_ = max(1, min(sq, 16)), max(1, min(sk, 16))
    if causal_kind == "top_left":
        sk_ = sq_
    q, k, v = t(sq_, hq, d), t(sk_, hkv, d), t(sk_, hkv, dv)
    # The lower-right bias path (torch.nn.attention.bias.CausalBias) asks flash, then efficient,
    # with is_causal=False, and otherwise materialises a mask: only those two may serve it.
    names = ("flash", "efficient") if causal_kind == "lower_right" else _FUSED
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal_kind == "top_left", hq != hkv)
    usable, reasons = [], []
    with sdpa_kernel(_fused_backends()):
        for name in names:
            fn = _can_use()[name]
            if fn is None:
                reasons.append(f"{name}: not in this torch build")
                continue
            # debug=False: with debug=True the checks report through TORCH_WARN, which no Python handler scopes to
            # this call: a user saw them on stderr ("[W ... sdp_utils_cpp.h] Warning: ...") or as UserWarnings of
            # an enclosing autograd Function, once per GQA shape (the GPU tier's logs, 21st-27th sessions).
            if fn(params, debug=False):
                usable.append(name)
            else:
                reasons.append(f"{name}: torch.backends.cuda.can_use_{name}_attention refuses it (dtype, head dims, "
                               "head counts, causal alignment or grad: its debug=True call prints which)")
    if causal_kind == "lower_right" and hq != hkv and "flash" not in usable:
        # CausalBias hands GQA to the mem-efficient op without expanding K/V, which it cannot take.
        usable = []
        reasons.append("efficient: lower-right causal bias path has no GQA")
    return tuple(usable), tuple(reasons)


class SdpaBackend(dispatch.Backend):
    """`sdpa`: whichever fused kernel PyTorch picks among cuDNN, FlashAttention-2 and memory-efficient (in that
    priority; never MATH on CUDA), and PyTorch's default on CPU.  Named only: auto-selection measures and picks
    the three kernels one by one (sdpa-cudnn, sdpa-flash, sdpa-efficient)."""

    name = "sdpa"
    auto = False
    kernels = _FUSED            # the fused SDPA kernels this backend may use, in priority order
    state_family = "sdpa"
    caps = Capabilities(devices=("cuda", "cpu"), dtypes=("float16", "bfloat16", "float32", "float64"),
                        max_head_dim=None, kinds=("dense",), paged_kvcache=False, mask_kinds=("none", "causal"),
                        softcap=False, alibi=False, dropout=False, lse=False, gqa=_HAS_GQA, saved_state="own",
                        sdpa_flash_devices=("cuda", "cpu"),
                        notes=("causal with Sq > Sk refused (SDPA returns NaN rows)",
                               "CUDA: float64 and deterministic backward refused (no fused kernel)",
                               "head dims, strides and lengths: PyTorch's own can_use_* checks decide"))

    @property
    def capabilities(self) -> dict:
        caps = self.caps.as_dict()
        caps["sdpa_kernels"] = list(self.kernels)
        if torch.cuda.is_available():
            c = torch.backends.cuda
            enabled = {"cudnn": bool(torch.backends.cudnn.is_available() and c.cudnn_sdp_enabled()),
                       "flash": bool(c.is_flash_attention_available() and c.flash_sdp_enabled()),
                       "efficient": bool(c.mem_efficient_sdp_enabled())}
            caps["sdpa_kernels_enabled"] = {k: enabled[k] for k in self.kernels}
        return caps

    def brackets_backward(self, spec: AttnSpec) -> bool:
        # On CUDA the output comes from one fused op (never MATH), whose backward is one node: hooks on it
        # (monitor.bracket_node) replace serve's two autograd Functions.  Not where PyTorch wraps the op in other
        # ones (a range on those would miss the kernel): the bottom-right causal bias (a transpose after the op),
        # head dims off a multiple of 8 (padded, then sliced), GQA (K / V repeated for FA2 and memory-efficient);
        # nor on a CPU, where PyTorch may decompose the call.
        return (spec.device.type == "cuda" and _causal_kind(spec) != "lower_right" and spec.head_dim % 8 == 0
                and spec.head_dim_v % 8 == 0 and spec.heads_q == spec.heads_kv)

    def availability(self) -> list[str]:
        if sdpa_kernel is None:
            return [f"torch {torch.__version__} lacks torch.nn.attention.sdpa_kernel"]
        return []

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        r = []
        if spec.kind == "dense" and spec.seqlen_k == 0:
            r.append("no keys (Sk = 0): SDPA would return NaN, flashport returns zeros")
        if spec.window_right == 0 and spec.seqlen_q > spec.seqlen_k:
            r.append("causal with Sq > Sk: rows that see no key come back NaN from SDPA")
        if spec.device.type == "cuda" and spec.kind == "dense" and not r:
            r += self._cuda_reasons(spec, role)
        return r

    def _cuda_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        if spec.batch == 0 or spec.seqlen_q == 0:
            return ["empty batch or query: the fused kernels refuse zero-size launches"]
        if spec.dtype == torch.float64:
            return ["float64 on CUDA: no fused SDPA kernel (only the materialising MATH one)"]
        if role == "bwd" and spec.deterministic:
            return ["deterministic backward on CUDA: fused SDPA backward is not bitwise reproducible"]
        if spec.softmax_scale == 0 and "flash" in self.kernels:
            return ["softmax_scale = 0: PyTorch's FlashAttention-2 kernel returned non-finite outputs for it (H100, "
                    "torch 2.11; the GPU fuzz's seed 0 case 33: bf16, Sq 49, Sk 1, D 96)"]
        usable, why = _probe_cuda(spec.device, spec.dtype, spec.heads_q, spec.heads_kv, spec.head_dim,
                                  spec.head_dim_v, spec.seqlen_q, spec.seqlen_k, _causal_kind(spec),
                                  spec.needs_grad)
        if not any(k in usable for k in self.kernels):
            mine = [w for w in why if w.split(":")[0] in self.kernels] or list(why)
            return ["no fused SDPA kernel accepts this call (MATH is never used on CUDA): " + " | ".join(mine)]
        return []

    def run(self, spec: AttnSpec, inputs: AttnInputs):
        """-> (out [B, Sq, Hq, Dv] in q's dtype, lse).  `lse` is a NaN placeholder: SDPA does not expose
        it, supports() refuses return_lse, and the public API drops it for every other call."""
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))  # [B, H, S, D] views
        kind = _causal_kind(spec)
        kw = dict(scale=spec.softmax_scale)
        if spec.heads_q != spec.heads_kv:
            kw["enable_gqa"] = True
        if kind == "top_left":
            kw["is_causal"] = True
        elif kind == "lower_right":
            kw["attn_mask"] = causal_lower_right(spec.seqlen_q, spec.seqlen_k)
        if spec.device.type == "cuda":
            out = self._run_cuda(q, k, v, kw, self.kernels)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        if out.grad_fn is not None and self.brackets_backward(spec):   # the fused op's backward node
            monitor.bracket_node(spec, self.name, out.grad_fn)
        out = out.transpose(1, 2).contiguous()  # no-op when the kernel wrote [B, Sq, Hq, Dv] already
        lse = torch.full((1, 1, 1), float("nan"), dtype=torch.float32, device=out.device)
        return out, lse.expand(spec.batch, spec.heads_q, spec.seqlen_q)

    @staticmethod
    def _run_cuda(q, k, v, kw, kernels):
        with allowing(kernels):
            try:
                return F.scaled_dot_product_attention(q, k, v, **kw)
            except RuntimeError as e:
                if "No available kernel" not in str(e):
                    raise
                # The fused kernels may want a stride pattern the probe's stand-ins had; a copy fixes it
                # (a copy of the inputs, not a materialisation of the scores).
                return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), **kw)


class SdpaKernelBackend(SdpaBackend):
    """One fused SDPA kernel alone, on CUDA: chosen automatically where the selection table measured it fastest
    (it keeps its own forward state, so forward and backward come from it together)."""

    auto = True
    caps = dataclasses.replace(SdpaBackend.caps, devices=("cuda",),
                               dtypes=("float16", "bfloat16", "float32"), deterministic=False)

    def __init__(self, kernel: str, what: str):
        self.kernels = (kernel,)
        # The lower-right causal bias path calls SDPA's flash op itself whenever flash can serve, whatever
        # sdpa_kernel allows, so only cuDNN never reaches it.
        self.caps = dataclasses.replace(self.caps, sdpa_flash_devices=() if kernel == "cudnn" else ("cuda",))
        self.name = f"sdpa-{kernel}"
        self.__doc__ = f"`{self.name}`: PyTorch SDPA's {what} kernel alone, on CUDA. " + SdpaKernelBackend.__doc__

    def prefers(self, spec: AttnSpec, role: str) -> bool:
        # Static priority (no table bucket fits): FA2 and the memory-efficient kernel come after flashport's kernels,
        # which beat them in every bucket of the shipped tables but 6, by 1-4% (5 D=256 training buckets, one D=96
        # inference one), where cuDNN is faster still (1.3-1.7x at D=256, 1.4x at D=96).
        return self.kernels[0] == "cudnn"

    def leads(self, spec: AttnSpec, role: str) -> bool:
        if self.kernels[0] != "cudnn":
            return False
        from .triton import cudnn_leads
        return cudnn_leads(spec)

    def availability(self) -> list[str]:
        if not torch.cuda.is_available():
            return ["no CUDA device"]
        if _can_use()[self.kernels[0]] is None:
            return [f"{self.kernels[0]} attention is not in this torch build"]
        return super().availability()


SDPA_KERNELS = [SdpaKernelBackend("cudnn", "cuDNN"), SdpaKernelBackend("flash", "FlashAttention-2"),
                SdpaKernelBackend("efficient", "memory-efficient (xFormers)")]
