"""Backend `flex`: PyTorch's FlexAttention (compiled `flex_attention`) for programmable calls on CUDA.

Equivalent math (layout [B, Sq, Hq, D] in, [B, Sq, Hq, Dv] out):
    out, lse = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
                              score_mod=<softcap, ALiBi, the user's score_mod, + attn_bias>,
                              block_mask=<the built-in rule AND mask_mod AND the user's block mask>,
                              enable_gqa=Hq != Hkv, return_lse=True)

The whole score pipeline of flashport.programmable becomes one Flex score_mod, and the visibility (causal or
window with bottom-right alignment, mask_mod, the user's non-empty tiles) one mask_mod, whose block mask
flashport.create_block_mask builds in bounded memory and which is cached per (mods, shape): built once, reused
across calls and layers, as Flex expects.  Lengths enter the mods as 0-d tensors, never as Python ints, so
that a new sequence length does not recompile (`torch.compile(flex_attention, dynamic=True)`, one compiled
function).  Gradients, including those of attn_bias and of tensors a score_mod captures, come from Flex's own
autograd ("own" state: forward and backward run together).

Why CUDA only: on a CPU, compiled Flex serves inference only and no lse (torch 2.13), and eager Flex
materialises the scores, the silent O(S^2) fallback flashport never takes.  Programmable calls on a CPU go to
`blockwise`.
"""
from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Optional

import torch

from .. import dispatch
from ..block_mask import create_block_mask
from ..capabilities import Capabilities
from ..masks import Visibility, alibi_bias
from ..programmable import FEATURES
from ..spec import AttnInputs, AttnSpec

BLOCK = 128                 # Flex's default tile: the block mask's granularity
_BLOCK_MASKS: OrderedDict = OrderedDict()
BLOCK_MASK_CACHE = 16       # block masks kept (each holds its mods alive); the oldest goes first
_compiled = []


RECOMPILE_LIMIT = 64        # distinct mods (compiled graphs) one process may use through this backend


@contextlib.contextmanager
def _dynamo_limits():
    """Dynamo's limits for the compiled call, and AOTAutograd's buffer donation off: a donated backward raises on
    `backward(retain_graph=True)` ("compiled with non-empty donated buffers"), which a user may call on any
    flashport output (the bench's backward timing does)."""
    import torch._dynamo.config as cfg
    import torch._functorch.config as fcfg
    # specialize_float: under dynamic=True, Dynamo otherwise turns a float the mods close over (the softcap) into
    # a 0-d tensor input, and `if cap > 0` inside Flex's score_mod becomes a data-dependent branch: a graph break
    # at the flex_attention HOP, after which its autograd fails ("all unwrapped values must be FakeTensor").
    patch = {k: v for k, v in (("recompile_limit", RECOMPILE_LIMIT), ("fail_on_recompile_limit_hit", True),
                                ("specialize_float", True)) if hasattr(cfg, k)}
    # Donation is switched off for the whole process, not inside this call only: torch 2.11 compiles the backward
    # lazily, at the first backward, reading the global flag then (the 22nd session's GPU probe: patched inside
    # the call, the second backward still raised; off process-wide, both backwards agree bit for bit).  It costs a
    # compiled backward the memory of buffers it could have reused, nothing else.
    if getattr(fcfg, "donated_buffer", False):
        fcfg.donated_buffer = False
    # use_duck_shape off: Dynamo otherwise equates sizes that happen to be equal at the first compile (2 key
    # blocks at S=256 and batch 2, the 22nd session's GPU tier) and recompiles when they part.
    import torch.fx.experimental._config as fxcfg
    with contextlib.ExitStack() as stack:
        stack.enter_context(cfg.patch(**patch))
        if hasattr(fxcfg, "use_duck_shape"):
            stack.enter_context(fxcfg.patch(use_duck_shape=False))
        yield


def _lse_request() -> dict:
    # torch >= 2.9 asks for the lse through return_aux (return_lse is deprecated there)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
        return {"return_aux": AuxRequest(lse=True)}
    except ImportError:
        return {"return_lse": True}


# Flex's default tiles for a score_mod that reads a captured tensor requiring grad (a learnable relative-position
# table) need more shared memory than an H100 / H200 has (245760 B of 232448 B at D=64 in the 16th session's
# run): "No valid triton configs", for forward and backward alike.  One pipeline stage and 64-row tiles fit.  Flex
# hands "fwd_" keys to the forward kernel only and "bwd_" keys to the backward's (prefix removed).
SMALL_TILES = {"fwd_num_stages": 1, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_num_stages": 1, "bwd_BLOCK_M1": 32,
               "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32}


def _kernel_options(inputs: AttnInputs) -> Optional[dict]:
    return SMALL_TILES if inputs.prog is not None and inputs.prog.captured else None


def _flex():
    """The compiled flex_attention (imported on first use: it pulls in torch._dynamo, seconds of import)."""
    if not _compiled:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled.append(torch.compile(flex_attention, dynamic=True))
    return _compiled[0]


def _compile_failure(e: BaseException) -> bool:
    """Inductor found no kernel for this call (Flex's templates refuse some tile / dtype / mod combinations:
    "NoValidChoicesError" in the 22nd session's GPU fuzz), as opposed to a wrong input or a failing kernel."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._inductor.exc import InductorError
    except ImportError:
        return False
    return isinstance(e, (BackendCompilerFailed, InductorError))


def _score_mod(spec: AttnSpec, inputs: AttnInputs, lengths: tuple):
    """softcap -> ALiBi -> score_mod -> + attn_bias as one Flex score_mod (None when the scores stay plain).
    It closes over functions, tensors and the softcap constant only, never over per-call Python objects:
    Dynamo guards a closure by its code and the cells' contents, so each call's fresh closure reuses the
    compiled kernel."""
    prog, cap = inputs.prog, spec.softcap
    user = None if prog is None else prog.score_mod
    bias = None if prog is None else prog.attn_bias
    slopes = inputs.alibi_slopes
    # Captured tensors are indexed as they are, never expanded first: an expanded (stride-0) view that requires
    # grad is what Flex's autograd cannot take apart.  Size-1 dims are indexed at 0 (Python constants here).
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes[None]
    if cap == 0 and slopes is None and user is None and bias is None:
        return None
    sb = slopes is not None and slopes.shape[0] > 1
    # attn_bias broadcasts from the right ([Sk], [Sq, Sk], ... [B, H, Sq, Sk]): which of (b, h, q_idx, kv_idx) index it
    used = () if bias is None else tuple(n > 1 for n in bias.shape)
    used = (None,) * (4 - len(used)) + used

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap > 0:
            score = cap * torch.tanh(score / cap)
        if slopes is not None:
            score = score + alibi_bias(slopes[b if sb else 0, h], q_idx, kv_idx, *lengths)
        if user is not None:
            score = user(score, b, h, q_idx, kv_idx).to(score.dtype)
        if bias is not None:
            idx = tuple(x if u else 0 for x, u in zip((b, h, q_idx, kv_idx), used) if u is not None)
            score = score + bias[idx].to(score.dtype)
        return score
    return score_mod


def _block_mask(spec: AttnSpec, inputs: AttnInputs, lengths: tuple):
    """The Flex BlockMask of the call's visibility, built by flashport.create_block_mask and cached."""
    prog = inputs.prog
    user_mask = None if prog is None else prog.mask_mod
    user_blocks = None if prog is None else prog.block_mask
    left, right = spec.window_left, spec.window_right
    per_b = user_blocks is not None and user_blocks.shape[0] > 1
    per_h = user_blocks is not None and user_blocks.shape[1] > 1
    key = (id(user_mask), id(user_blocks), spec.batch if per_b else None, spec.heads_q if per_h else None,
           spec.seqlen_q, spec.seqlen_k, left, right, str(spec.device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        _BLOCK_MASKS.move_to_end(key)
        return hit[0]

    tiles = None if user_blocks is None else user_blocks.state
    qb, kb = (1, 1) if user_blocks is None else user_blocks.block_size
    rule = Visibility(*lengths, left, right)      # lengths as tensors: the rule's own sees()
    bounded = left >= 0 or right >= 0             # without bounds the rule hides nothing inside the lengths

    def visibility(with_tiles):
        def mask_mod(b, h, q_idx, kv_idx):
            ok = rule.sees(q_idx, kv_idx) if bounded else None
            if with_tiles:
                t = tiles[b if per_b else 0, h if per_h else 0, q_idx // qb, kv_idx // kb] != 0
                ok = t if ok is None else ok & t
            if user_mask is not None:
                u = user_mask(b, h, q_idx, kv_idx)
                ok = u if ok is None else ok & u
            return ok
        return mask_mod

    # The block states come from every term.  Flex evaluates its mask_mod on each element of a partial block, so
    # the user's tiles are left out of it where they align with Flex's blocks: then a tile's state is constant on
    # each Flex block, and empty ones are never listed.
    aligned = qb % BLOCK == 0 and kb % BLOCK == 0
    with_tiles = tiles is not None and not aligned
    elementwise = visibility(with_tiles) if (bounded or with_tiles or user_mask is not None) else None

    if not (bounded or tiles is not None or user_mask is not None):
        return None                                 # every pair visible: Flex's dense path

    from torch.nn.attention.flex_attention import BlockMask
    ours = create_block_mask(visibility(tiles is not None), spec.batch if per_b else None,
                             spec.heads_q if per_h else None, spec.seqlen_q, spec.seqlen_k, device=spec.device,
                             block_size=BLOCK)
    partial, full = ours.state == 1, ours.state == 2

    def listed(sel):
        num = sel.sum(-1, dtype=torch.int32)
        # the listed tile columns first, in order (a stable sort of "not listed")
        idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return num, idx

    kv_num, kv_idx = listed(partial)
    full_num, full_idx = listed(full)
    flex_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(BLOCK, BLOCK),
                                         mask_mod=elementwise, seq_lengths=(spec.seqlen_q, spec.seqlen_k))
    _BLOCK_MASKS[key] = (flex_mask, user_mask, user_blocks)   # the ids in the key stay those objects' ids
    while len(_BLOCK_MASKS) > BLOCK_MASK_CACHE:
        _BLOCK_MASKS.popitem(last=False)
    return flex_mask


@functools.lru_cache(maxsize=64)
def _lengths(sq: int, sk: int, device: torch.device) -> tuple:
    """(Sq, Sk) as 0-d tensors on the device, made once per (Sq, Sk, device): a fresh torch.tensor(n, device=cuda)
    per call is a host-to-device copy that waits for the GPU, so each call would wait for the one before."""
    return torch.tensor(sq, device=device), torch.tensor(sk, device=device)


class FlexBackend(dispatch.Backend):
    """PyTorch's compiled FlexAttention on CUDA for dense calls, programmable ones above all (score_mod,
    mask_mod, block masks, attn_bias with its gradient), plus softcap, ALiBi, windows and GQA.  Forward and
    backward run together in Flex's own autograd."""

    name = "flex"
    # Named only until its GPU tier passes: in the 14th session's run (H100) compiled Flex broke on some of
    # flashport's composed mods (an AssertionError inside Flex's autograd after a graph break, PERFLOG row 39).
    auto = False
    auto_devices = ("cuda",)
    caps = Capabilities(devices=("cuda",), dtypes=("float16", "bfloat16", "float32"),
                        head_dims=(16, 32, 64, 128, 256), kinds=("dense",), paged_kvcache=False, dropout=False,
                        deterministic=False, min_capability=(8, 0), saved_state="own", mods=FEATURES,
                        notes=("compiled once with dynamic shapes; the block mask of each (mods, shape) is built "
                               "once and cached",))

    def availability(self) -> list[str]:
        import importlib.util
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:   # not imported: dynamo is slow
            return [f"torch {torch.__version__} has no torch.nn.attention.flex_attention"]
        if not torch.cuda.is_available():
            return ["no CUDA device (compiled Flex on a CPU serves inference without lse only)"]
        return []

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        r = []
        if spec.seqlen_q == 0 or spec.seqlen_k == 0 or spec.batch == 0:
            r.append("empty call (zero length or batch)")
        if spec.softmax_scale <= 0:
            r.append("softmax_scale <= 0")
        return r

    def run(self, spec: AttnSpec, inputs: AttnInputs):
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))      # [B, H, S, D] views
        lengths = _lengths(spec.seqlen_q, spec.seqlen_k, q.device)
        # Each distinct mod is one more compiled graph.  Past Dynamo's recompile limit, compiled Flex would fall
        # back to eager Flex, which materialises the scores: FlexAttention's known silent O(S^2) failure.  A
        # larger limit for this call, and an error instead of that fallback.
        try:
            with _dynamo_limits():
                out, aux = _flex()(q, k, v, score_mod=_score_mod(spec, inputs, lengths),
                                   block_mask=_block_mask(spec, inputs, lengths), scale=spec.softmax_scale,
                                   enable_gqa=spec.heads_q != spec.heads_kv,
                                   kernel_options=_kernel_options(inputs), **_lse_request())
        except Exception as e:
            if not _compile_failure(e):
                raise
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise dispatch.UnsupportedError(f"backend 'flex': FlexAttention's compiler built no kernel for this "
                                            f"call ({type(e).__name__}: {first})") from e
        return out.transpose(1, 2), getattr(aux, "lse", aux)
