"""What a backend serves, as data, and the one generic check that reads it.

Each backend declares a `Capabilities`; `reasons(caps, spec, role)` turns a call that falls outside
it into readable reasons, and the backend adds only what the declaration cannot say (a length
floor, a probe of PyTorch's own kernels).  `flashport.backends()` shows `as_dict()`, and the tests
build their case matrix from the same declarations (tests/test_selection.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

ROLES = ("fwd", "bwd")
KINDS = ("dense", "varlen", "kvcache")
DTYPES = ("float16", "bfloat16", "float32", "float64")


def mask_kind(spec) -> str:
    """The visibility rule's name (flashport.masks.Visibility.kind): "none", "causal" or "window"."""
    return spec.visibility.kind


MASK_KINDS = ("none", "causal", "window")


@dataclass(frozen=True)
class Capabilities:
    fwd: bool = True
    bwd: bool = True
    devices: tuple = ("cuda",)                  # device types
    dtypes: tuple = ("float16", "bfloat16", "float32")
    head_dims: Optional[tuple] = None           # exact head dims served; None: any up to max_head_dim
    max_head_dim: Optional[int] = 256
    dv_ne_d: bool = True                        # Dv != D
    kinds: tuple = KINDS
    paged_kvcache: bool = True
    mask_kinds: tuple = MASK_KINDS
    softcap: bool = True
    alibi: bool = True
    dropout: bool = True
    lse: bool = True                            # return_lse
    deterministic: bool = True                  # deterministic=True backward
    gqa: bool = True
    # programmable features served (flashport.programmable.FEATURES: score_mod, mask_mod, block_mask, attn_bias)
    mods: tuple = ()
    # gradients into tensors a score_mod captures (a learnable table).  The spec cannot tell that a call has such
    # tensors, so `reasons` cannot check it: a backend without it refuses when the call runs; fuzzers read it.
    mod_grads: bool = True
    min_capability: Optional[tuple] = None      # CUDA compute capability, inclusive
    max_capability: Optional[tuple] = None
    triton_versions: Optional[tuple] = None     # tested releases (None: Triton not used)
    # "lse": forward and backward exchange (out, lse) and mix with other "lse" backends;
    # "own": the backward needs the backend's own forward state (chosen as a pair).
    saved_state: str = "lse"
    materialises_scores: bool = False
    # Device types where the kernel may be PyTorch SDPA's flash op, which flashport's SDPA hook replaces
    # (flashport/integrations/sdpa.py): inside the hook such a backend would call the hook again.
    sdpa_flash_devices: tuple = ()
    exact: bool = True
    notes: tuple = field(default=())            # what the declaration cannot say, in words

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def reasons(caps: Capabilities, spec, role: str) -> list[str]:
    """Why `caps` cannot serve `spec` in `role` ("fwd" or "bwd"); [] when it can."""
    r = []
    if not getattr(caps, role):
        r.append(f"no {'backward' if role == 'bwd' else 'forward'}")
    if spec.device.type not in caps.devices:
        r.append(f"device {spec.device.type!r} (serves {', '.join(caps.devices)})")
    dtype = str(spec.dtype).replace("torch.", "")
    if dtype not in caps.dtypes:
        r.append(f"dtype {dtype} (serves {', '.join(caps.dtypes)})")
    d, dv = spec.head_dim, spec.head_dim_v
    if caps.head_dims is not None and (d not in caps.head_dims or dv not in caps.head_dims):
        r.append(f"head dim {d}/{dv} (serves {', '.join(map(str, caps.head_dims))})")
    if caps.max_head_dim is not None and max(d, dv) > caps.max_head_dim:
        r.append(f"head dim {max(d, dv)} > {caps.max_head_dim}")
    if d != dv and not caps.dv_ne_d:
        r.append(f"Dv != D ({dv} vs {d})")
    if spec.kind not in caps.kinds:
        r.append(f"{spec.kind} calls (serves {', '.join(caps.kinds)})")
    if spec.kind == "kvcache" and spec.paged and not caps.paged_kvcache:
        r.append("paged KV cache")
    mk = mask_kind(spec)
    if mk not in caps.mask_kinds:
        r.append(f"mask kind {mk!r} (serves {', '.join(caps.mask_kinds)})")
    if spec.softcap > 0 and not caps.softcap:
        r.append("softcap")
    if spec.alibi is not None and not caps.alibi:
        r.append("ALiBi")
    if spec.dropout_p > 0 and not caps.dropout:
        r.append("dropout")
    if spec.return_lse and not caps.lse:
        r.append("return_lse (lse not exposed)")
    if role == "bwd" and spec.deterministic and not caps.deterministic:
        r.append("deterministic=True backward (not bitwise reproducible)")
    for f in getattr(spec, "mods", ()):   # JAX specs have no programmable part
        if f not in caps.mods:
            r.append(f"{f} (not compiled by this backend yet)" if f in ("score_mod", "mask_mod") else f)
    if spec.heads_q != spec.heads_kv and not caps.gqa:
        r.append("GQA / MQA")
    if spec.device.type == "cuda" and (caps.min_capability or caps.max_capability):
        from . import env
        cc = env.capability(spec.device)
        if caps.min_capability and cc < caps.min_capability:
            r.append(f"compute capability {cc[0]}.{cc[1]} < {caps.min_capability[0]}.{caps.min_capability[1]}")
        if caps.max_capability and cc > caps.max_capability:
            r.append(f"compute capability {cc[0]}.{cc[1]} > {caps.max_capability[0]}.{caps.max_capability[1]}")
    return r


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)
