"""Backend `fa4`: FlashAttention-4's CuTe DSL kernels (pip package `flash-attn-4`, module `flash_attn.cute`), an
optional peer on Hopper and Blackwell (`pip install flashport[fa4]`).  Imported lazily: `import flashport` never
imports flash_attn; `availability()` looks for the package first and imports it only where a card of compute
capability >= 9.0 is present (the import pulls in the CUTLASS DSL, seconds).

Equivalent call (flashport's layout is FlashAttention's, so no transposes):
    out, lse = flash_attn.cute.flash_attn_func(q, k, v, softmax_scale=s, causal=False,
                                               window_size=(left or None, right or None),   # -1 -> None
                                               softcap=softcap, return_lse=True)
    # varlen: flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., cu_seqlens_k=..., max_seqlen_q=..., ...)
    dq, dk, dv = flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, s, False, softcap,
                                                           window_size_left=..., window_size_right=...,
                                                           deterministic=..., dlse=dlse)

FA4's conventions, read from flash_attn/cute/interface.py, softmax.py and mask.py of 4.0.0b36:
- lse is the natural-log logsumexp of the final scores (scale, then softcap as softcap*tanh(s/softcap)), float32,
  [B, Hq, Sq] dense and [Hq, total_q] varlen, -inf for a row that sees no key (whose output is 0): the contract's.
  Its backward takes any such (out, lse) -- its preprocess maps lse = -inf to P = 0 -- so this backend's saved
  state is "lse": it mixes with the other "lse" backends (`fa4/triton`, `triton/fa4`).  The backward entry point
  is private (`interface._flash_attn_bwd`); where its signature is not the one this module calls, the backward
  is refused with the reason and the forward stays available.
- windows: row i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, bottom-right aligned, None meaning
  unbounded -- flashport's rule, except that FA4 turns -1 into "unbounded" only when *both* sides are negative
  (a lone -1 is a real bound there), so each -1 is passed as None.  causal=True is passed as (None, 0), which
  FA4 resolves to its causal path.
- head dims: FA4 accepts on sm_90 any D and Dv in 8..256 divisible by 8, on sm_100 / sm_110 D, Dv <= 128, or
  (192, 128), or (256, 256).  fp16 / bf16 only (fp8 is forward-only, sm_100).  Served here: D == Dv in HEAD_DIMS,
  what passed the contract on an H100 (HEAD_DIMS' comment).
- GQA / MQA natively (packed GQA), softcap forward and backward.  Its deterministic backward was not bitwise
  repeatable under GQA on the H100 (two backwards differed in dq, dk), so deterministic=True calls go elsewhere.
- dense calls where a row sees no key, or a key is seen by no row (causal with Sq > Sk, windows narrower than the
  offset of Sq and Sk): FA4 returned inf outputs and gradients there on the H100, so those are refused; varlen,
  whose rows past a sequence's keys this module zeroes itself, passed.

Refused, each with its reason: ALiBi and dropout (FA4 has neither), float32, KV-cache calls (see below),
programmable mods (FA4's score_mod is CuTe DSL code, not flashport's torch mods), cards below sm_90 (FA4's sm_80
path is not the one measured here) and sm_120 (untested here), tensors of 2^31 elements or more (FA4's index
math is not verified past int32 here).

KV cache: the append is flashport's (serve.kvcache_call writes it before any backend runs), and FA4 could attend
over the cache through seqused_k (dense) or page_table + seqused_k (paged).  It is not served: FA4 loads whole key
tiles, so V rows past a sequence's valid length (inside its last tile or page) enter P @ V with P = 0, and 0 * NaN
is NaN -- its own docstring asks for finite rows there.  The contract lets those cache slots hold anything (the
checks poison them with NaN), and making them finite would cost a pass over the cache on every decode step.
Varlen has the same hazard only past cu_seqlens_k[-1] (a sequence's overshoot reads the next sequence's real
rows), so where a packed tensor has rows past the last sequence the varlen path hands FA4 copies whose rows there
are zero (`_finite_tail`; q and dout too in the backward), and zeroes what FA4 leaves unwritten there (out,
lse = -inf, dq, dk, dv).  A tensor packed tight (cu_seqlens[-1] == its rows, the usual case) goes to FA4 as it is:
there are no such rows, and FA4's loads past the tensor's end read zeros.  Telling the two apart reads
cu_seqlens[-1] on the host once per cu_seqlens tensor (`_packed_rows`: one sync when a batch's tensor is first
seen, then a cache hit in every layer); where a sync is not allowed (CUDA graph capture, torch.compile tracing)
the copies are made.

Selection: never by static priority.  `measured_only = True` (dispatch._auto) keeps it out of every choice that
the selection table does not make: backend=None takes fa4 only in a bucket where `flashport tune` measured it
fastest among the plans that serve the call.  Named (`backend="fa4"`, `"fa4/triton"`) it is strict like every
backend.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
import weakref
from collections import OrderedDict
from types import SimpleNamespace
from typing import Optional

import torch

from .. import dispatch
from ..capabilities import Capabilities
from ..masks import Visibility
from ..spec import AttnInputs, AttnSpec

PACKAGE = "flash-attn-4"
MODULE = "flash_attn.cute"
TESTED = "4.0.0b36"
INSTALL = "pip install flashport[fa4]"
NOT_INSTALLED = f"{PACKAGE} not installed: {INSTALL}"
# FA4's own rule on sm_90 is 8 <= D, Dv <= 256 in multiples of 8 (interface._validate_head_dims), but on an H100
# (4.0.0b36, `flashport check --backend fa4` and the GPU fuzz tier, results/issue14_h100_s15) its gradients were wrong
# at D = 40, 72 and 80, its forward gave NaN lse at 40/24, and its GQA backward asserts D == Dv.  Served: the head
# dims that passed there, D == Dv.
HEAD_DIMS = (16, 32, 48, 64, 96, 128, 256)
MAX_ELEMENTS = 2**31 - 1
# What this module passes to FA4's functions; a release whose signatures lack any of it is refused with the reason.
_FWD_PARAMS = ("softmax_scale", "causal", "window_size", "softcap", "return_lse")
_VARLEN_PARAMS = _FWD_PARAMS + ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_BWD_PARAMS = ("window_size_left", "window_size_right", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
               "max_seqlen_k", "deterministic", "dlse")


def version() -> Optional[str]:
    """The installed flash-attn-4 release (None when it is not installed)."""
    from importlib import metadata
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:   # on sys.path without its metadata (or a test's stand-in)
        return (getattr(sys.modules.get(MODULE), "__version__", None) or "unknown") if _present() else None


def _present() -> bool:
    """flash_attn.cute can be imported, judged without importing it (FA4's wheel has no flash_attn/__init__.py, so
    this executes nothing of it; FlashAttention-2's flash_attn package alone does not count)."""
    if MODULE in sys.modules:
        return sys.modules[MODULE] is not None
    try:
        return importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        return False


def _missing(fn, names) -> list[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return []
    return [n for n in names if n not in params]


@functools.lru_cache(maxsize=1)
def _api() -> SimpleNamespace:
    """FA4's entry points -> namespace(fwd, varlen, bwd, problems, bwd_problem): problems say why none can be used
    (the import failed, a function or a parameter this module passes is missing), bwd_problem why the backward
    cannot (its private entry point changed).  Imported once, on first need."""
    try:
        mod = importlib.import_module(MODULE + ".interface")
    except Exception as e:  # a broken install (missing CUTLASS DSL library, CUDA mismatch) is a reason, not a crash
        first = str(e).splitlines()[0] if str(e) else ""
        return SimpleNamespace(fwd=None, varlen=None, bwd=None, bwd_problem=None,
                               problems=[f"{PACKAGE} {version()} failed to import: {type(e).__name__}: {first}"])
    found = {n: getattr(mod, n, None) for n in ("flash_attn_func", "flash_attn_varlen_func", "_flash_attn_bwd")}

    def problem(name, params):
        fn = found[name]
        missing = ["(missing)"] if fn is None else _missing(fn, params)
        return f"{PACKAGE} {version()}: {name} lacks {', '.join(missing)} (tested with {TESTED})" if missing else None

    problems = [p for p in (problem("flash_attn_func", _FWD_PARAMS),
                            problem("flash_attn_varlen_func", _VARLEN_PARAMS)) if p]
    return SimpleNamespace(fwd=found["flash_attn_func"], varlen=found["flash_attn_varlen_func"],
                           bwd=found["_flash_attn_bwd"], problems=problems,
                           bwd_problem=problem("_flash_attn_bwd", _BWD_PARAMS))


def _device_reasons() -> list[str]:
    """Why no card of this process can run FA4 as served here."""
    if not torch.cuda.is_available():
        return ["no CUDA device"]
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if not any(c >= (9, 0) for c in caps):
        return [f"compute capability {max(caps)[0]}.{max(caps)[1]} < 9.0: FA4 serves Hopper (sm_90) and Blackwell "
                f"(sm_100) here"]
    return []


def fa4_window(spec: AttnSpec) -> tuple[Optional[int], Optional[int]]:
    """flashport's (window_left, window_right), -1 unbounded and causal folded into right = 0 -> FA4's window_size,
    None unbounded (FA4 reads a lone negative bound as a bound).  Both are bottom-right aligned."""
    return (None if spec.window_left < 0 else spec.window_left,
            None if spec.window_right < 0 else spec.window_right)


def _valid_rows(cu: torch.Tensor, n: int) -> torch.Tensor:
    """bool [n, 1, 1]: packed row r belongs to a sequence (r < cu[-1]); a device comparison, no host sync."""
    return (torch.arange(n, device=cu.device) < cu[-1].to(torch.int64))[:, None, None]


_PACKED: OrderedDict = OrderedDict()   # id(cu) -> (weak reference to cu, cu._version, cu[-1] on the host)
PACKED_CACHE = 64


def _packed_rows(cu: torch.Tensor) -> Optional[int]:
    """cu[-1] as a host int, read once per cu_seqlens tensor and version (an in-place change re-reads it), or None
    where reading it would sync a stream being captured or a graph being traced."""
    if torch.compiler.is_compiling() or (cu.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    hit = _PACKED.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version:
        _PACKED.move_to_end(id(cu))
        return hit[2]
    rows = int(cu[-1])
    _PACKED[id(cu)] = (weakref.ref(cu), cu._version, rows)
    while len(_PACKED) > PACKED_CACHE:
        _PACKED.popitem(last=False)
    return rows


def _tight(cu: torch.Tensor, n: int) -> bool:
    """Every one of a packed tensor's n rows belongs to a sequence (known without a sync, or read once)."""
    rows = _packed_rows(cu)
    return rows is not None and rows >= n


def _finite_tail(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """A copy of packed x [total, H, D] with zeros past cu[-1]: FA4's last key (or query) tile reads up to a tile of
    rows past the last sequence, and 0 * NaN there would be NaN in P @ V (or in dK, dV)."""
    return torch.where(_valid_rows(cu, x.shape[0]), x, x.new_zeros(()))


def _empty(spec: AttnSpec, inputs: AttnInputs) -> bool:
    """No query or no key anywhere: FA4's forward returns zeros / -inf, but its backward launches regardless."""
    return (inputs.q.numel() == 0 or inputs.k.shape[-3] == 0 or spec.batch == 0 or spec.seqlen_q == 0
            or spec.seqlen_k == 0)


class Fa4Backend(dispatch.Backend):
    __doc__ = __doc__
    name = "fa4"
    measured_only = True      # backend=None takes it only where the selection table measured it (module docstring)
    state_family = "fa4"      # no private state: its backward reads the contract's (out, lse)
    caps = Capabilities(devices=("cuda",), dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS, max_head_dim=256,
                        dv_ne_d=False, kinds=("dense", "varlen"), paged_kvcache=False, softcap=True, alibi=False,
                        dropout=False, lse=True, deterministic=False, gqa=True, min_capability=(9, 0),
                        max_capability=(11, 9), saved_state="lse",
                        notes=(f"optional: {INSTALL} (flash-attn-4, tested {TESTED}); kernels compile at first call",
                               "D == Dv in 16..256 where it passed the contract on an H100 (not 40, 72, 80; not "
                               "Dv != D); sm_100/sm_110: D <= 128 or 256",
                               "dense calls with a row that sees no key or a key no row sees are left to "
                               "flashport's kernels (FA4 gave inf there on an H100)",
                               "KV cache left to flashport's kernels: FA4 reads V rows past seqused_k inside a "
                               "tile, which the contract lets hold NaN",
                               "varlen: a packed tensor with rows past cu_seqlens[-1] is copied with them zeroed "
                               "(FA4 reads up to a tile past the last sequence); one packed tight is not",
                               "chosen by backend=None only where the selection table measured it fastest"))

    def availability(self) -> list[str]:
        if not _present():
            return [NOT_INSTALLED]
        why = _device_reasons()
        if why:
            return why
        return list(_api().problems)

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        r = []
        if role == "bwd" and _present() and _api().bwd_problem:
            r.append(_api().bwd_problem)
        if spec.device.type == "cuda":
            from .. import env
            major = env.capability(spec.device)[0]
            d, dv = spec.head_dim, spec.head_dim_v
            if major in (10, 11) and not (max(d, dv) <= 128 or (d, dv) in ((192, 128), (256, 256))):
                r.append(f"head dims {d}/{dv} on sm_{major}0 (FA4 serves D, Dv <= 128, 192/128 or 256/256 there)")
            if major in (10, 11) and role == "bwd" and (d, dv) == (256, 256) and spec.return_lse:
                r.append("a differentiated lse with head dim 256 on sm_100 (FA4's hd256 backward takes no dlse)")
        if spec.softmax_scale <= 0:
            # the 16th session's H200 fuzz: inf outputs at scale -0.112 (likely FA4 folding the scale into exp2 after
            # the row max, which is the max of the scaled scores only for a positive scale; not read in its source)
            r.append("softmax_scale <= 0 (FA4 assumes a positive scale: inf outputs with a negative one on an H200)")
        if spec.kind == "dense" and spec.seqlen_q and spec.seqlen_k:
            vis = Visibility.from_spec(spec)
            sq, sk = spec.seqlen_q, spec.seqlen_k
            if vis.row_sees_nothing(0) or vis.row_sees_nothing(sq - 1):   # the band is monotone: the ends decide
                r.append("a row that sees no key (FA4 gave inf outputs there on an H100)")
            elif any(a >= b for a, b in (vis.query_range(0, 1), vis.query_range(sk - 1, sk))):
                r.append("a key that no row sees (FA4 gave inf gradients there on an H100)")
        # rows FA4 addresses: B * Sq dense; at most B * max_seqlen (plus a tile) varlen
        rows = spec.batch * max(spec.seqlen_q, spec.seqlen_k)
        heads = max(spec.heads_q, spec.heads_kv) * max(spec.head_dim, spec.head_dim_v)
        if rows * heads > MAX_ELEMENTS:
            r.append("a tensor of 2^31 elements or more (FA4's int32 index math is not verified there)")
        return r

    def extra_bytes(self, spec: AttnSpec, role: str = "fwd") -> int:
        extra = super().extra_bytes(spec, role)
        rows = spec.batch * spec.seqlen_q * spec.heads_q
        keys = spec.batch * spec.seqlen_k * spec.heads_kv
        if role == "bwd":   # dQ accumulated in float32 (and dK, dV too under GQA) beside dq, dk, dv
            extra += rows * spec.head_dim * 4 + (keys * (spec.head_dim + spec.head_dim_v) * 4 if spec.group_size > 1
                                                 else 0)
        if spec.kind == "varlen":   # the zero-tailed copies of k and v (and q in the backward), if rows trail
            item = torch.finfo(spec.dtype).bits // 8
            extra += keys * (spec.head_dim + spec.head_dim_v) * item + (rows * spec.head_dim * item
                                                                        if role == "bwd" else 0)
        return extra

    # ------------------------------------------------------------------------- forward and backward
    def forward(self, spec: AttnSpec, inputs: AttnInputs):
        """-> (out [B, Sq, Hq, Dv] or [total_q, Hq, Dv] in q's dtype, lse [B, Hq, Sq] or [Hq, total_q] float32, None)."""
        q, k, v = inputs.q, inputs.k, inputs.v
        if _empty(spec, inputs):
            rows = q.shape[:-1]
            lse_shape = (rows[0], rows[2], rows[1]) if spec.kind == "dense" else (rows[1], rows[0])
            return (q.new_zeros(*rows, spec.head_dim_v),
                    torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device), None)
        api = _api()
        kw = dict(softmax_scale=spec.softmax_scale, causal=False, window_size=fa4_window(spec),
                  softcap=float(spec.softcap), return_lse=True)
        with torch.no_grad():
            if spec.kind == "dense":
                out, lse = api.fwd(q, k, v, **kw)
                return out, lse, None
            cq, ck = inputs.cu_seqlens_q, inputs.cu_seqlens_k
            if not _tight(ck, k.shape[0]):
                k, v = _finite_tail(k, ck), _finite_tail(v, ck)
            out, lse = api.varlen(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=spec.seqlen_q,
                                  max_seqlen_k=spec.seqlen_k, **kw)
            if not _tight(cq, q.shape[0]):
                valid = _valid_rows(cq, q.shape[0])
                out = out.masked_fill_(~valid, 0)                             # rows FA4 never writes
                lse = lse.masked_fill_(~valid[:, 0, 0][None, :], float("-inf"))
        return out, lse, None

    def backward(self, spec: AttnSpec, inputs: AttnInputs, saved: dispatch.Saved, dout, dlse):
        q, k, v = saved.q, saved.k, saved.v
        if _empty(spec, inputs):
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        left, right = fa4_window(spec)
        kw = dict(window_size_left=left, window_size_right=right, deterministic=bool(spec.deterministic),
                  dlse=None if dlse is None else dlse.to(torch.float32).contiguous())
        tight_q = tight_k = True
        if spec.kind == "varlen":
            cq, ck = inputs.cu_seqlens_q, inputs.cu_seqlens_k
            tight_q, tight_k = _tight(cq, q.shape[0]), _tight(ck, k.shape[0])
            if not tight_q:
                q, dout = _finite_tail(q, cq), _finite_tail(dout, cq)
            if not tight_k:
                k, v = _finite_tail(k, ck), _finite_tail(v, ck)
            kw.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=spec.seqlen_q, max_seqlen_k=spec.seqlen_k)
        with torch.no_grad():
            dq, dk, dv = _api().bwd(q, k, v, saved.out, dout, saved.lse, spec.softmax_scale, False,
                                    float(spec.softcap), **kw)[:3]
            # gradients of the rows past the last sequence are zero, not FA4's leftovers
            if not tight_q:
                dq = dq.masked_fill_(~_valid_rows(inputs.cu_seqlens_q, dq.shape[0]), 0)
            if not tight_k:
                kv_ok = _valid_rows(inputs.cu_seqlens_k, dk.shape[0])
                dk, dv = dk.masked_fill_(~kv_ok, 0), dv.masked_fill_(~kv_ok, 0)
        return dq, dk, dv

