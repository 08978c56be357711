"""Backend `triton`: flashport's own FlashAttention kernels (flashport/kernels), forward and backward.

Runs on CUDA devices of compute capability >= 8.0, and on CPU tensors when TRITON_INTERPRET=1
(Triton's interpreter; CI uses it).  The kernels are imported on first use, because
`triton.jit` decides at decoration time whether a kernel is compiled or interpreted: importing
flashport never fixes that choice.  kvcache calls go to flashport.kernels.decode.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict
from typing import Optional

import torch

from .. import dispatch, env
from ..capabilities import Capabilities
from ..kernels import versions
from ..kernels.versions import is_tested, tested_text
from ..spec import AttnInputs, AttnSpec

# Programmable features the kernels serve: mods compiled by kernels/mod_codegen.py (attn_bias as a read the compiled
# score function adds, see score_function), block masks' empty tiles skipped (kernels/block_skip.py).
MODS = ("score_mod", "mask_mod", "block_mask", "attn_bias")

MAX_HEAD_DIM = 256
MAX_GRID_YZ = 65535  # CUDA grid limit for the head and batch dimensions
# KV-cache calls with at least this many queries run on the prefill kernel (kernels/attn_fwd.kvcache_forward: one
# program per 64-128 query rows and head, causal tiles skipped), fewer on the decode kernel (GQA rows packed, keys
# split across programs).  Measured on the H200 (GQA 32/8, D=128, bf16; PERFLOG row 56): the decode kernel is 3-4x
# faster at 16 queries and 1.2x at 64, the prefill kernel 1.6x at 256 and 2.2x at 1024; 128 is between, unmeasured.
PREFILL_MIN_Q = 128


@functools.lru_cache(maxsize=8)
def _triton_version() -> Optional[str]:
    try:
        import triton
        return str(getattr(triton, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - a broken install is as good as none
        return None


def _interpreting() -> bool:
    return env.interpreting()


def _allow_untested() -> bool:
    return env.flag("FLASHPORT_ALLOW_UNTESTED_TRITON")


# Triton's interpreter runs bf16 dots wrongly (silently garbage, not an error): refused, never run.
BF16_INTERPRETER_REASON = "bfloat16 under TRITON_INTERPRET=1: Triton's interpreter computes bf16 dots wrongly"


def _interpreter_dtype_reasons(spec: AttnSpec, interpreting: bool) -> list[str]:
    return [BF16_INTERPRETER_REASON] if interpreting and spec.dtype == torch.bfloat16 else []


def _on_hopper(spec: AttnSpec) -> bool:
    index = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] == 9


# Where no table bucket fits, the dense calls that cuDNN's own plan leads in static priority on Hopper (sdpa-cudnn's
# `leads`).  From the H200 table (flashport/configs/selection-nvidia-h200.json, the 48 dense bf16 buckets that time
# both): cuDNN's forward + backward beats the best pair of these kernels in 47 of 48 training buckets -- 1.02-1.15x
# at D=64 / 128 (S 512-16k, causal or not, GQA 32/8), 1.34-1.67x at D=256, 1.5-2.2x at D=72 / 80 / 96 / 192-128 --
# and trails only at S=128k causal (0.97x); its inference forward wins every bucket at D <= 128 up to 137 GFLOP
# (0.83-0.93x ours, one tie, one 1.04x the other way), where the call is short enough that host time counts.  The
# padded dims were measured with the Gluon kernels' two-part 80 / 96 off; with it on, the H100 ran D=96 at 1.06-1.07x
# cuDNN's backward and 0.92-1.06x its forward, D=80 at 0.55-0.93x (PERFLOG rows 81, 86), so D=96 stays with them.
LONG_KEYS = 1 << 16                 # training calls from here on keep these kernels (the one bucket they win)
SMALL_FORWARD_FLOPS = 3 << 36       # ~206 GFLOP (monitor.flops): inference calls below it go to cuDNN first


def padded_dims(spec: AttnSpec) -> bool:
    """Head dims the Triton kernels pad to the next power of two in every dot (the Gluon kernels split 80 / 96)."""
    return spec.head_dim not in (64, 128, 256) or spec.head_dim_v != spec.head_dim


def trains_at_256(spec: AttnSpec) -> bool:
    """A training call at D = Dv = 256: cuDNN's forward + backward outruns every pair of these kernels there (row 94)."""
    return spec.needs_grad and spec.head_dim == spec.head_dim_v == 256


def _gluon_splits_96(spec: AttnSpec) -> bool:
    return (spec.head_dim == spec.head_dim_v == 96 and env.flag("FLASHPORT_HOPPER_FWD_SPLIT")
            and env.flag("FLASHPORT_HOPPER_BWD_SPLIT"))


def cudnn_first(spec: AttnSpec) -> bool:
    """Whether cuDNN's plan leads static priority for a dense fp16 / bf16 call on Hopper (the caller checks the card):
    training calls at D=256 (row 94); unless FLASHPORT_CUDNN_FIRST=0 also training calls over fewer than LONG_KEYS
    keys, inference calls at D <= 128 under SMALL_FORWARD_FLOPS, and the head dims these kernels pad but D=96 where
    the Gluon kernels split it.  cuDNN refuses windows, softcap, ALiBi and deterministic backwards, which auto then
    gives to the next plan in static priority."""
    if spec.kind != "dense" or spec.dtype not in (torch.float16, torch.bfloat16):
        return False
    if trains_at_256(spec):
        return True
    if not env.flag("FLASHPORT_CUDNN_FIRST"):
        return False
    if padded_dims(spec):
        return not _gluon_splits_96(spec)
    if spec.needs_grad:
        return spec.seqlen_k < LONG_KEYS
    from ..monitor import flops
    return spec.head_dim <= 128 and flops(spec) < SMALL_FORWARD_FLOPS


def cudnn_leads(spec: AttnSpec) -> bool:
    """cudnn_first on a Hopper card (a CUDA call, outside the interpreter)."""
    return spec.device.type == "cuda" and not _interpreting() and cudnn_first(spec) and _on_hopper(spec)


def _capability(index: int) -> tuple[int, int]:
    return env.capability(torch.device("cuda", index))


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


LOG2E = 1.4426950408889634


def lse2_of(saved: dispatch.Saved) -> torch.Tensor:
    """The kernels' lse in log2 units (+inf where a row sees no key, so P = 0 there): the forward's own when it
    came from these kernels, else derived from the contract's lse."""
    if saved.private is not None:
        return saved.private
    lse = saved.lse.float()
    return torch.where(lse == float("-inf"), float("inf"), lse * LOG2E)


class TritonBackend(dispatch.Backend):
    """flashport's portable Triton kernels (kernels/attn_fwd.py, attn_bwd.py, decode.py): every call the
    contract allows up to head dim 256 in fp16 / bf16 / fp32 -- dense, varlen, KV cache (dense and paged),
    every mask kind, softcap, ALiBi, dropout, lse, deterministic backward -- on CUDA compute capability
    >= 8.0, and on CPU tensors under TRITON_INTERPRET=1 (when named; auto never picks the interpreter)."""

    name = "triton"
    auto_devices = ("cuda",)
    state_family = "kernels"
    caps = Capabilities(devices=("cuda", "cpu"), max_head_dim=MAX_HEAD_DIM, min_capability=(8, 0),
                        triton_versions=versions.TESTED_TRITON, mods=MODS, mod_grads=True,
                        notes=("cpu: only with TRITON_INTERPRET=1, and not bfloat16 there",
                               "KV cache: inference only, limits in kernels/decode.py",
                               "score_mod / mask_mod: compiled from their traced aten graph (kernels/mod_codegen.py); "
                               "a mod outside its whitelist is refused with the reason when the call runs",
                               "attn_bias: read by the compiled score function after score_mod",
                               "gradients of tensors a score_mod captures and of attn_bias: added by the dK/dV kernel "
                               "with float32 atomics (refused with deterministic=True)",
                               "block_mask: its empty tiles are skipped, its FULL tiles evaluate no mask_mod "
                               "(kernels/block_skip.py)"))

    # The Gluon kernels call these with hopper=True (backend/gluon.py).
    hopper = False

    def availability(self) -> list[str]:
        return list(_availability(_triton_version(), _interpreting(), _allow_untested()))

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        if spec.kind == "kvcache":  # the KV-cache kernel states its own limits (memoised per spec there)
            reasons = _device_reasons(spec.device) + _interpreter_dtype_reasons(spec, _interpreting())
            try:
                from ..kernels.decode import kvcache_supports
            except ImportError:
                return reasons + ["kvcache kernel not available"]
            return reasons + kvcache_supports(spec)
        return list(_supports(spec, _interpreting()))

    def prefers(self, spec: AttnSpec, role: str) -> bool:
        if spec.mods:
            # On a GPU the compiled mods come first; a mod the generator cannot compile is refused by input_reasons,
            # and auto takes the next plan (blockwise serves every mod).  Under the interpreter (CPU) they come last.
            return spec.device.type == "cuda"
        if spec.kind != "dense" or spec.device.type != "cuda" or _interpreting():
            return True
        # on Hopper, cuDNN runs the head dims these kernels pad 1.3-2x faster (results/issue8_h200_s12/, D = 72, 80,
        # 96, 192/128); at D=256 their training forward would pair with their backward, which cuDNN's outruns
        return not ((padded_dims(spec) or trains_at_256(spec)) and _on_hopper(spec))

    def input_reasons(self, spec: AttnSpec, inputs: AttnInputs) -> list[str]:
        return mods_reasons(spec, inputs)

    def forward(self, spec: AttnSpec, inputs: AttnInputs):
        if spec.kind == "kvcache":
            if spec.seqlen_q >= PREFILL_MIN_Q:   # chunked prefill / verification: the prefill kernel, paged reads
                from ..kernels.attn_fwd import kvcache_forward
                from ..kernels.common import device_guard
                from ..kernels.decode import valid_lengths
                with device_guard(spec.device):
                    out, lse = kvcache_forward(spec, inputs.q, inputs.k, inputs.v, valid_lengths(spec, inputs),
                                               inputs.block_table, alibi=inputs.alibi_slopes)
                return out, lse, None
            from ..kernels.decode import kvcache_attention
            out, lse = kvcache_attention(spec, inputs)
            return out, lse, None
        from ..kernels import attn_fwd
        from ..kernels.common import device_guard
        mods = compiled_mods(spec, inputs)
        with device_guard(spec.device):
            return attn_fwd.forward(spec, inputs.q, inputs.k, inputs.v, alibi=inputs.alibi_slopes,
                                    cu_seqlens_q=inputs.cu_seqlens_q, cu_seqlens_k=inputs.cu_seqlens_k,
                                    rng_state=inputs.rng_state, hopper=self.hopper, mods=mods,
                                    block_mask=_block_mask(inputs))

    def backward(self, spec: AttnSpec, inputs: AttnInputs, saved: dispatch.Saved, dout, dlse):
        from ..kernels import attn_bwd
        from ..kernels.common import device_guard
        mods = compiled_mods(spec, inputs)
        with device_guard(saved.q.device):
            grads = attn_bwd.backward(spec, dout, saved.q, saved.k, saved.v, saved.out, lse2_of(saved), dlse=dlse,
                                      alibi=inputs.alibi_slopes, cu_seqlens_q=inputs.cu_seqlens_q,
                                      cu_seqlens_k=inputs.cu_seqlens_k, rng_state=inputs.rng_state,
                                      hopper=self.hopper, mods=mods, block_mask=_block_mask(inputs))
        bias = None if inputs.prog is None else inputs.prog.attn_bias
        if bias is not None and bias.requires_grad and len(grads) > 3:   # its 4-d view's gradient, in its own shape
            grads = (*grads[:3], grads[3].reshape(bias.shape), *grads[4:])
        return grads


def _block_mask(inputs: AttnInputs):
    return None if inputs.prog is None else inputs.prog.block_mask


# block mask -> (mask_mod, the mask the kernels compile): one function object per pair, so that compiles are memoised
_VISIBLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def visible_mask(prog):
    """The per-element rule the kernels compile: mask_mod, AND with a block mask the element's block is not empty
    (Programmable.visible; the kernels skip the tiles it leaves empty, but a kernel tile may straddle blocks)."""
    bm, mask_mod = prog.block_mask, prog.mask_mod
    if bm is None:
        return mask_mod
    hit = _VISIBLE.get(bm)
    if hit is None or hit[0] is not mask_mod:
        def mask(b, h, q_idx, kv_idx):
            seen = bm.tile_visible(b, h, q_idx, kv_idx)
            return seen if mask_mod is None else seen & mask_mod(b, h, q_idx, kv_idx)
        hit = _VISIBLE[bm] = (mask_mod, mask)
    return hit[1]


def mod_reasons(spec: AttnSpec, prog) -> list[str]:
    """Why the kernels cannot serve a call's mods beyond what the declaration says (it cannot see the functions)."""
    if spec.needs_grad and prog.differentiable and spec.deterministic:
        return [f"{len(prog.differentiable)} captured tensor(s) / attn_bias require grad, and deterministic=True: the "
                "kernels add those gradients with atomics (blockwise sums them in a fixed order)"]
    if prog.attn_bias is not None and prog.attn_bias.numel() >= 2 ** 31:
        return [f"attn_bias of {prog.attn_bias.numel()} elements (the kernels index it in int32: at most 2**31 - 1)"]
    return []


# (score_mod, attn_bias's broadcast pattern, dtype, device) -> (score_mod, the score function, its stand-in bias): the
# function reads a small stand-in of the bias's rank, dtype and size-1 dimensions, whose pointer, strides and sizes
# each call replaces with its own bias (the generated code reads them at run time).  So a new bias tensor each step
# compiles nothing, and no cache keeps a caller's bias alive.  Bounded.
_BIASED: "OrderedDict" = OrderedDict()
BIASED_SIZE = 16


def score_function(prog):
    """(the score function the kernels compile, the stand-in bias it reads or None): score_mod, then + attn_bias at
    (b, h, q_idx, kv_idx), a size-1 dimension read at 0 (flashport/programmable.py's pipeline and broadcasting)."""
    bias, sm = prog.attn_bias, prog.score_mod
    if bias is None:
        return sm, None
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    key = (id(sm), tuple(n == 1 for n in shape), bias.dtype, bias.device)
    hit = _BIASED.get(key)
    if hit is None or hit[0] is not sm:
        stand_in = torch.zeros(tuple(1 if n == 1 else 2 for n in shape), dtype=bias.dtype, device=bias.device,
                               requires_grad=True)

        def biased(score, b, h, q_idx, kv_idx):
            s = score if sm is None else sm(score, b, h, q_idx, kv_idx)
            idx = tuple(x if n > 1 else x * 0 for x, n in zip((b, h, q_idx, kv_idx), stand_in.shape))
            return s + stand_in[idx].to(s.dtype)

        hit = _BIASED[key] = (sm, biased, stand_in)
        while len(_BIASED) > BIASED_SIZE:
            _BIASED.popitem(last=False)
    _BIASED.move_to_end(key)
    return hit[1], hit[2]


def _with_bias(mods, stand_in, bias):
    """The compiled mods with the call's own attn_bias (as a 4-d view) in the stand-in's place."""
    bias4 = bias.detach().reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    swap = lambda ts: tuple(bias4 if t is stand_in else t for t in ts)  # noqa: E731
    return dataclasses.replace(mods, captured=swap(mods.captured), grad_leaves=swap(mods.grad_leaves))


def mods_reasons(spec: AttnSpec, inputs: AttnInputs) -> list[str]:
    """Why the kernels cannot serve the call's mods (empty: they can, and the generated functions are kept in
    inputs.extra for the forward and the backward of the same call).  Dispatch chooses from the spec, which holds
    the features' names but not the functions, so a mod is judged here, from the inputs, before any kernel runs."""
    prog = inputs.prog
    if prog is None or "triton_mods" in inputs.extra:
        return inputs.extra.get("triton_mods_reasons", [])
    reasons = mod_reasons(spec, prog)
    mods = None
    if not reasons:
        from ..kernels.mod_codegen import compile_mods
        score, stand_in = score_function(prog)
        # gradients in prog.differentiable's order: attn_bias (its stand-in), then the captured tensors
        bias_grad = stand_in is not None and prog.attn_bias.requires_grad
        grads = ((stand_in,) if bias_grad else ()) + prog.captured
        got = compile_mods(score, visible_mask(prog), spec.device, grads if spec.needs_grad else ())
        reasons = [got] if isinstance(got, str) else []
        if not reasons:
            mods = got if stand_in is None else _with_bias(got, stand_in, prog.attn_bias)
    inputs.extra["triton_mods"], inputs.extra["triton_mods_reasons"] = mods, reasons
    return reasons


def compiled_mods(spec: AttnSpec, inputs: AttnInputs):
    """The call's generated mod functions (kernels.mod_codegen.CompiledMods), or None without mods.  Raises
    UnsupportedError with mods_reasons' reasons where the kernels cannot serve them."""
    reasons = mods_reasons(spec, inputs)
    if reasons:
        raise dispatch.UnsupportedError("backend 'triton' cannot serve this call:\n  - triton: " + "; ".join(reasons))
    return inputs.extra.get("triton_mods")


# Both answers depend only on the spec (a frozen, hashable dataclass), the installed Triton, the cards and
# TRITON_INTERPRET (part of the key), and they are asked on every call: memoised, since a training or
# serving loop repeats the same few shapes (each call costs microseconds of host time otherwise).
@functools.lru_cache(maxsize=64)
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
