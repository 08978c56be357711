"""A target for Nsight Compute: the Gluon Hopper backward kernel (one variant) launched a few times on one
training shape, nothing else of note on the GPU.

    PYTHONPATH=. ncu --clock-control none -k regex:_attn_bwd_hopper --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/gpu/ncu_bwd_target.py --variant s2_tma_lse --causal

(--launch-skip 2 skips the compile-time warm-up launch and one cold launch.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gluon_bwd_probe import _spec  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default=None, help="attn_bwd_hopper.VARIANTS key (default: the library's)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--launches", type=int, default=4)
    args = ap.parse_args(argv)
    from flashport.kernels import attn_bwd_hopper, attn_fwd
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, args.seqlen, args.heads, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    spec = _spec(q, k, args.causal)
    out, _, lse2 = attn_fwd.forward(spec, q, k, v)
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    for _ in range(args.launches):
        attn_bwd_hopper.backward(spec, do, q, k, v, out, lse2, delta,
                                 variant=args.variant or attn_bwd_hopper.DEFAULT)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
