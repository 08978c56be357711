"""Launch configurations of the attention kernels: which BLOCK_M / BLOCK_N / num_warps / num_stages.

- Under the interpreter (TRITON_INTERPRET=1): one small fixed config per kernel, no tuning.
- On a GPU: a table of tuned configs keyed by (GPU name, kernel, head-dim bucket, dtype, mask kind,
  length class: "short" up to SHORT_SEQ queries/keys, else "long") loaded from
  flashport/configs/triton_configs.json at import; missing entries fall back to the other length
  class, then to defaults for the compute capability.  Candidates whose estimated shared memory
  exceeds the card's limit are dropped, and a launch that still runs out of resources moves on to
  the next candidate (the first one that launches is remembered per key).
- `autotune(...)` times candidates on the current GPU and writes the table (run on the GPU).

Kernels: "fwd" (block_m = Q tile, block_n = K/V tile), "bwd_dkdv" (block_n = K/V tile it owns,
block_m = Q tile it streams), "bwd_dq" (block_m = Q tile it owns, block_n = K/V tile it streams).
`split` picks the loop structure: one pipelined loop with boundary tiles masked behind a run-time
branch (default), or separate loops for boundary and full tiles.
warp_specialize is never used: a probe on Triton 3.6 / H100 gave NaN with it.
"""
from __future__ import annotations

import functools
import json
import warnings
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Callable, Optional

import torch
from .. import env

CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "triton_configs.json"
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split: bool = False  # separate loops for boundary and full tiles (see kernels/common.py)


INTERPRETER_CONFIG = KernelConfig(16, 16, 4, 1)


def interpreting() -> bool:
    return env.interpreting()


def _config_problem(cfg) -> Optional[str]:
    """Why a table entry is not a valid KernelConfig (None: it is).  The table is data written by
    `autotune` or by hand: a wrong type or a tile size tl.dot cannot take must not reach a launch."""
    if not isinstance(cfg, dict):
        return f"not an object but {type(cfg).__name__}"
    fields = {f.name for f in dataclass_fields(KernelConfig)}
    unknown = sorted(set(cfg) - fields)
    if unknown:
        return f"unknown field(s) {unknown}"
    for name in ("block_m", "block_n", "num_warps", "num_stages"):
        x = cfg.get(name)
        if type(x) is not int or x <= 0:   # bool is no int here; JSON floats (64.0) are refused too
            return f"{name} must be a positive int, got {x!r}"
    for name in ("block_m", "block_n"):
        if cfg[name] < 16 or cfg[name] & (cfg[name] - 1):
            return f"{name} must be a power of two >= 16 (tl.dot's minimum), got {cfg[name]}"
    if cfg["num_warps"] & (cfg["num_warps"] - 1):
        return f"num_warps must be a power of two, got {cfg['num_warps']}"
    if type(cfg.get("split", False)) is not bool:
        return f"split must be a bool, got {cfg['split']!r}"
    return None


def _load_table(path: Path = CONFIG_PATH) -> dict:
    """{key: KernelConfig} from the JSON table at `path`, entry by entry.

    Never raises: every triton call goes through this table, so a malformed file (a list, wrong types,
    missing fields) costs its bad entries -- skipped with one warning naming the file and the keys -- and
    not the backend.  A missing file is an empty table.  Only json.loads reads it: data, never code."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:   # unreadable, not UTF-8, not JSON, nested too deep
        warnings.warn(f"flashport: ignoring tuning table {path}: {type(e).__name__}: {e}", RuntimeWarning)
        return {}
    entries = doc.get("entries", {}) if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        what = type(doc if entries is None else entries).__name__
        warnings.warn(f"flashport: ignoring tuning table {path}: expected an object with an \"entries\" object, "
                      f"got {what}", RuntimeWarning)
        return {}
    table, bad = {}, []
    for key, cfg in entries.items():
        problem = _config_problem(cfg)
        if problem is None:
            table[key] = KernelConfig(**cfg)
        else:
            bad.append(f"{key!r}: {problem}")
    if bad:
        shown = "; ".join(bad[:20]) + (f"; and {len(bad) - 20} more" if len(bad) > 20 else "")
        warnings.warn(f"flashport: tuning table {path}: skipped {len(bad)} invalid entries -- {shown}",
                      RuntimeWarning)
    return table


TABLE: dict = _load_table()


# ----------------------------------------------------------------------------- keys
def head_bucket(spec) -> int:
    from .common import block_dim
    return max(block_dim(spec.head_dim), block_dim(spec.head_dim_v))


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


# The table's names for the mask kinds (flashport.masks.MASK_KINDS): the shipped entries were tuned
# under them.  A kind missing here keys under its own name (no entries yet: the defaults serve).
_TABLE_MASK = {"none": "full", "causal": "causal", "window": "local"}


def mask_key(spec) -> str:
    kind = spec.visibility.kind
    return _TABLE_MASK.get(kind, kind)


def gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    return torch.cuda.get_device_name(device)


# Sequences up to this many keys/queries give each program only a few tiles, so prologue and
# epilogue weigh more and smaller tiles (more programs per SM) can win: they get their own entries.
SHORT_SEQ = 1024


def length_key(spec) -> str:
    return "short" if max(spec.seqlen_q, spec.seqlen_k) <= SHORT_SEQ else "long"


def table_key(gpu: str, kernel: str, bucket: int, dtype: str, mask: str, length: str = "long") -> str:
    return f"{gpu}|{kernel}|d{bucket}|{dtype}|{mask}|{length}"


def spec_keys(gpu: str, kernel: str, spec) -> list[str]:
    """Table keys for a call, most specific first: its own length class, then the other one."""
    base = (gpu, kernel, head_bucket(spec), dtype_key(spec.dtype), mask_key(spec))
    own = length_key(spec)
    return [table_key(*base, own), table_key(*base, "long" if own == "short" else "short")]


# ----------------------------------------------------------------------------- defaults
def _c(*rows):
    return [KernelConfig(*r) for r in rows]


# (block_m, block_n, num_warps, num_stages), best first, for 16-bit inputs on sm80+ (H100 / A100):
# ordered by timings on an H200 (bf16, causal and not; PERFLOG rows 1, 2, 6, 10), and checked against
# sm_90a compile reports (tools/gpu/compile_report.py): no register spills in the first entries, and tiles
# whose dots all reach HGMMA (a dot with fewer than 64 rows per warpgroup falls back to HMMA).
_FWD_64 = _c((128, 64, 8, 3), (64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 1))
_DKDV_64 = _c((16, 128, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3), (16, 32, 4, 1))
_DQ_64 = _c((128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2), (32, 16, 4, 1))
_DEFAULTS_16BIT = {
    "fwd": {16: _FWD_64, 32: _FWD_64, 64: _FWD_64,
            128: _c((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 4, 2),
                    (64, 32, 4, 1)),
            256: _c((128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 4, 1),
                    (32, 32, 4, 1))},
    "bwd_dkdv": {16: _DKDV_64, 32: _DKDV_64, 64: _DKDV_64,
                 128: _c((32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 64, 8, 2),
                         (16, 32, 4, 1)),
                 256: _c((32, 64, 8, 1), (32, 64, 8, 2), (16, 64, 8, 2), (64, 64, 8, 1), (32, 32, 8, 1),
                         (16, 32, 4, 1))},
    "bwd_dq": {16: _DQ_64, 32: _DQ_64, 64: _DQ_64,
               128: _c((128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
                       (32, 16, 4, 1)),
               256: _c((128, 32, 8, 2), (64, 64, 8, 1), (64, 32, 8, 2), (128, 32, 8, 1), (64, 64, 8, 2),
                       (16, 16, 4, 1))},
}
# fp32 with IEEE dots runs on FMA units: small tiles keep the fp32 operands within registers.
_DEFAULTS_FP32 = {
    "fwd": _c((64, 64, 8, 1), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)),
    "bwd_dkdv": _c((32, 64, 8, 1), (32, 32, 4, 1), (16, 32, 4, 1), (16, 16, 4, 1)),
    "bwd_dq": _c((64, 32, 8, 1), (32, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1)),
}


def default_configs(kernel: str, bucket: int, dtype: torch.dtype, split_variants: int = 0,
                    limit: Optional[int] = None) -> list[KernelConfig]:
    """Default candidates, best first (the first `limit`); split_variants adds the split-loop
    version of the first ones."""
    base = list(_DEFAULTS_FP32[kernel] if dtype == torch.float32 else _DEFAULTS_16BIT[kernel][bucket])[:limit]
    return base + [replace(c, split=True) for c in base[:split_variants]]


# ----------------------------------------------------------------------------- shared memory
def smem_estimate(kernel: str, cfg: KernelConfig, bd: int, bdv: int, elt: int) -> int:
    """Bytes of shared memory a config needs (pipelined tiles + operands staged for the dots)."""
    bm, bn, st = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kernel == "fwd":      # Q resident, K and V tiles pipelined
        return elt * (bm * bd + st * bn * (bd + bdv))
    if kernel == "bwd_dkdv":  # K, V resident; Q, dO pipelined; P^T and dS^T staged
        return elt * (bn * (bd + bdv) + st * bm * (bd + bdv) + 2 * bm * bn)
    return elt * (bm * (bd + bdv) + st * bn * (bd + bdv) + bm * bn)   # bwd_dq


# Opt-in shared memory per block by compute capability, for when the device properties lack it.
SMEM_OPTIN = {(8, 0): 166912, (8, 7): 166912, (9, 0): 232448}


def smem_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    if optin:
        return int(optin)
    major, minor = props.major, props.minor
    return SMEM_OPTIN.get((major, minor), 101376)


def candidates(kernel: str, spec, device: torch.device) -> list[KernelConfig]:
    """Configs to try for this call, best first, all estimated to fit in shared memory."""
    if device.type != "cuda":
        return [INTERPRETER_CONFIG]
    from .common import block_dim
    bucket = head_bucket(spec)
    tuned = [TABLE[key] for key in spec_keys(gpu_name(device), kernel, spec) if key in TABLE]
    cfgs = tuned[:1] + default_configs(kernel, bucket, spec.dtype)
    elt = torch.finfo(spec.dtype).bits // 8
    bd, bdv, limit = block_dim(spec.head_dim), block_dim(spec.head_dim_v), smem_limit(device)
    seen, out = set(), []
    for c in cfgs:
        if c not in seen and smem_estimate(kernel, c, bd, bdv, elt) <= limit:
            seen.add(c)
            out.append(c)
    return out


@functools.lru_cache(maxsize=1024)
def _smem_reasons(spec, device: torch.device) -> tuple[str, ...]:
    kernels = KERNELS if spec.needs_grad else ("fwd",)
    return tuple(f"no {k} tile config fits in {smem_limit(device)} bytes of shared memory for head dim "
                 f"{spec.head_dim}/{spec.head_dim_v}" for k in kernels if not candidates(k, spec, device))


def smem_reasons(spec, device: torch.device) -> list[str]:
    """Why no config fits this card's shared memory (empty list: some config fits).

    Asked by `supports()` on every call; memoised per spec (a frozen, hashable dataclass), since a
    training or serving loop repeats the same shapes and the answer only depends on the card."""
    return list(_smem_reasons(spec, device))


# ----------------------------------------------------------------------------- launching
_chosen: dict = {}


def launch_with_fallback(kernel: str, spec, device: torch.device, launch: Callable[[KernelConfig], None],
                         config: Optional[KernelConfig] = None, variant=()) -> KernelConfig:
    """Run `launch(cfg)` with the first candidate that the card can run (remembered per key).  variant: what
    else changes the kernel's footprint (the compiled mods: an attn_bias read or a table's gradient needs more
    shared memory than the same shape without them, so they must not share a remembered config)."""
    if config is not None:
        launch(config)
        return config
    if device.type != "cuda":
        launch(INTERPRETER_CONFIG)
        return INTERPRETER_CONFIG
    from triton.runtime.errors import OutOfResources
    # exact head dims in the key: D=64/Dv=128 and D=128/Dv=128 share a bucket but not a smem footprint
    key = (kernel, str(device), spec.head_dim, spec.head_dim_v, spec.dtype, mask_key(spec), length_key(spec),
           variant)
    if key in _chosen:
        try:
            launch(_chosen[key])
            return _chosen[key]
        except OutOfResources:   # a footprint the key does not tell apart: choose again
            del _chosen[key]
    last = None
    for cfg in candidates(kernel, spec, device):
        try:
            launch(cfg)
        except OutOfResources as e:  # estimate too optimistic for this card: next candidate
            last = e
            continue
        _chosen[key] = cfg
        return cfg
    raise RuntimeError(f"flashport triton: no {kernel} config fits this device") from last


# ----------------------------------------------------------------------------- autotuning
def autotune(shapes, *, kernels=KERNELS, dtypes=(torch.bfloat16,), configs: Optional[dict] = None,
             path: Optional[Path] = CONFIG_PATH, warmup: int = 10, rep: int = 40, log=print) -> dict:
    """Time candidate configs on the current GPU and store the fastest per key in the JSON table.

    shapes: iterable of (B, S, H, D, causal).  configs: {kernel: {bucket: [KernelConfig]}} overriding
    the candidate lists (default: the first four default configs for that bucket and the split-loop
    versions of the first two).  Returns {key: (cfg, ms)}.
    Each candidate is checked against the first one's output, so a config that computes garbage
    (NaN, a miscompile) is never stored."""
    import triton.testing

    from . import attn_bwd, attn_fwd
    from ..spec import dense_spec

    dev = torch.device("cuda", torch.cuda.current_device())
    best: dict = {}
    for dtype in dtypes:
        for (b, s, h, d, causal) in shapes:
            q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=dtype) for _ in range(3))
            do = torch.randn_like(q)
            spec, inputs = dense_spec(q, k, v, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                      alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
            out, _, lse2 = attn_fwd.forward(spec, q, k, v)
            for kernel in kernels:
                bucket = head_bucket(spec)
                cands = (configs or {}).get(kernel, {}).get(bucket) or default_configs(kernel, bucket, dtype, 2, 4)
                key = spec_keys(gpu_name(dev), kernel, spec)[0]
                ref = None
                for cfg in cands:
                    if kernel == "fwd":
                        def fn(cfg=cfg):
                            return attn_fwd.forward(spec, q, k, v, config=cfg)[0]
                    else:
                        def fn(cfg=cfg, kernel=kernel):
                            cfgs = {kernel: cfg}
                            return attn_bwd.backward(spec, do, q, k, v, out, lse2, configs=cfgs)
                    try:
                        res = fn()
                    except Exception as e:  # noqa: BLE001 - out of resources / unsupported on this card
                        log(f"  {key} {cfg}: failed ({type(e).__name__})")
                        continue
                    res = res if isinstance(res, torch.Tensor) else torch.cat([r.flatten() for r in res])
                    if ref is None:
                        ref = res
                    if not torch.isfinite(res).all() or not torch.allclose(res.float(), ref.float(), atol=2e-2,
                                                                            rtol=2e-2):
                        log(f"  {key} {cfg}: wrong result, skipped")
                        continue
                    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep)
                    log(f"  {key} {cfg}: {ms:.3f} ms")
                    if key not in best or ms < best[key][1]:
                        best[key] = (cfg, ms)
    if path is not None and best:
        table = json.loads(path.read_text()) if path.exists() else {"entries": {}}
        table.setdefault("entries", {}).update({k: asdict(c) for k, (c, _) in best.items()})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        TABLE.update({k: c for k, (c, _) in best.items()})
    return best
