"""Issue [5] regressions of the online softmax: a Q tile taller than its K tiles under a narrow causal
window.  Rows of the tile's lower half see no key in the first K tile; the running max must stay -inf
there (a stand-in 0 kept as the max scaled the one visible key by 2^(s - 0), which underflows in fp16 for
large logits: outputs off by 0.5-3.6 on the H200, and dq / dk far from their exact zero through Delta).

The GPU's tuned configs have BLOCK_M = 128 > BLOCK_N = 64; here a 32 x 16 config is forced so the
interpreter crosses the same tile boundary.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from conformance import Case, _math  # noqa: E402
from flashport.check import assert_within_rule, magnitude  # noqa: E402
from flashport.spec import dense_spec  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

TALL_Q = dict(fwd=(32, 16, 4, 1), bwd_dkdv=(16, 32, 4, 1), bwd_dq=(32, 16, 4, 1))


def _inputs(dtype, sq, d, amp, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, sq, 2, d, generator=g) * amp).to(dtype)
    k = (torch.randn(1, sq, 1, d, generator=g) * amp).to(dtype)
    v = torch.randn(1, sq, 1, d, generator=g).to(dtype)
    do = torch.randn(1, sq, 2, d, generator=g).to(dtype)
    return q, k, v, do


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("window", [(0, 0), (1, 0), (2, 0)], ids=str)
@pytest.mark.parametrize("amp", [1.0, 3.0])
def test_tall_q_tile_narrow_window(dtype, window, amp):
    from flashport.kernels import attn_bwd, attn_fwd
    from flashport.kernels.tuning import KernelConfig
    cfg = {k: KernelConfig(*v) for k, v in TALL_Q.items()}
    sq, d = 45, 32
    q, k, v, do = _inputs(dtype, sq, d, amp)
    case = Case(b=1, sq=sq, sk=sq, hq=2, hkv=1, d=d, causal=True, window=window, dtype=dtype)
    spec, _ = dense_spec(q, k, v, causal=True, softmax_scale=None, window_size=window, softcap=0.0, alibi_slopes=None,
                         dropout_p=0.0, deterministic=False, return_lse=False)
    out, _, lse2 = attn_fwd.forward(spec, q, k, v, config=cfg["fwd"])
    dq, dk, dv = attn_bwd.backward(spec, do, q, k, v, out, lse2, configs=cfg)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = _math(*ref_leaves, case, None, torch.float64)
    low_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    low, _ = _math(*low_leaves, case, None, dtype)
    assert_within_rule(f"out {case}", out, ref, low, dtype, 2)
    ref_g = torch.autograd.grad(ref, ref_leaves, do.double())
    low_g = torch.autograd.grad(low, low_leaves, do)
    mag = magnitude(q, k, v, do)
    for name, a, r, lo in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_g, low_g):
        assert_within_rule(f"{name} {case}", a, r, lo, dtype, 3, mag)
    if window == (0, 0):   # one visible key per row: softmax is constant, the exact dq and dk are zero
        assert torch.equal(out, v.expand_as(out)), "each row's output is its one visible value row, exactly"
