"""Backend `gluon`: flashport's Hopper kernels in Gluon (Triton's lower-level dialect), FlashAttention-3's
schedules on sm_90.

Serves: dense bf16 / fp16 calls with q/k and v of one head dim, causal with Sq == Sk, no softcap or dropout,
GQA included; sliding windows with Sq == Sk, ALiBi, and head dims 80 / 96 as two column parts, each with a rollback
switch that leaves it to the Triton kernels (FLASHPORT_HOPPER_{FWD,BWD}_{WINDOW,ALIBI,SPLIT}=0).
- forward (kernels/attn_fwd_hopper.py): D = 64, 80, 96, 128 or 256, Sq and Sk multiples of 128, lse returned;
- backward (kernels/attn_bwd_hopper.py): D = 64, 80, 96 or 128, Sq and Sk >= 128 (ragged
  lengths masked), deterministic=False only (dQ is summed by TMA reduce-adds in arrival order).
Its saved state is the Triton kernels' (out, lse in log2 units), so it pairs with `triton` either way.
Strided or misaligned tensors, and a variant that fails to compile on this toolchain, are served by the
Triton kernels instead and counted (kernels/attn_*_hopper.fallbacks).  FLASHPORT_HOPPER_FWD=0 /
FLASHPORT_HOPPER_BWD=0 take either direction out of every choice.
"""
from __future__ import annotations

from ..capabilities import Capabilities
from ..spec import AttnSpec
from ..kernels import versions
from .triton import TritonBackend, _interpreting, trains_at_256

FWD_HEAD_DIMS = (64, 80, 96, 128, 256)   # 80, 96: two column parts (attn_fwd_hopper.TILES), behind their switch
BWD_HEAD_DIMS = (64, 80, 96, 128)   # 80, 96: two column parts (attn_bwd_hopper.SPLIT), behind their switch


class GluonBackend(TritonBackend):
    __doc__ = __doc__
    name = "gluon"
    hopper = True
    caps = Capabilities(devices=("cuda",), dtypes=("float16", "bfloat16"), head_dims=FWD_HEAD_DIMS, dv_ne_d=False,
                        kinds=("dense",), mask_kinds=("none", "causal", "window"), softcap=False, alibi=True,
                        dropout=False, deterministic=False, min_capability=(9, 0), max_capability=(9, 0),
                        triton_versions=versions.TESTED_TRITON,
                        notes=("forward: Sq and Sk multiples of 128; causal and windows need Sq == Sk; windows, ALiBi and "
                               "D = 80 / 96 unless FLASHPORT_HOPPER_FWD_{WINDOW,ALIBI,SPLIT}=0",
                               f"backward: head dims {', '.join(map(str, BWD_HEAD_DIMS))}, Sq and Sk >= 128; "
                               "windows (Sq == Sk), ALiBi and D = 80 / 96 unless "
                               "FLASHPORT_HOPPER_BWD_{WINDOW,ALIBI,SPLIT}=0",
                               "static preference (no table): forward from attn_fwd_hopper.MIN_KEYS keys"))

    def availability(self) -> list[str]:
        reasons = super().availability()
        if reasons:
            return reasons
        if _interpreting():
            return ["TRITON_INTERPRET=1: Gluon kernels do not run in Triton's interpreter"]
        from ..kernels import attn_fwd_hopper
        if attn_fwd_hopper.gluon is None:
            return ["this Triton has no Gluon (triton.experimental.gluon)"]
        return []

    def own_reasons(self, spec: AttnSpec, role: str) -> list[str]:
        if spec.kind != "dense" or spec.device.type != "cuda":
            return []   # the declaration already says why
        if role == "fwd":
            from ..kernels import attn_fwd_hopper
            return attn_fwd_hopper.spec_reasons(spec, length_floor=False)
        from ..kernels import attn_bwd_hopper
        return attn_bwd_hopper.spec_reasons(spec)

    def prefers(self, spec: AttnSpec, role: str) -> bool:
        if role == "bwd":
            return True
        if trains_at_256(spec):   # its training forward pairs with the Triton backward there
            return False
        from ..kernels import attn_fwd_hopper
        floor = attn_fwd_hopper.min_keys(spec.head_dim, attn_fwd_hopper.is_causal(spec))
        return floor is not None and min(spec.seqlen_q, spec.seqlen_k) >= floor
