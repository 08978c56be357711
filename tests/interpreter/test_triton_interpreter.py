"""Interpreter tier of the `triton` backend: the real kernels (flashport/kernels/attn_fwd.py and
attn_bwd.py) run in Triton's interpreter on CPU tensors, on tiny fp32 / fp16 shapes, with 16 x 16
tiles so that odd sizes cross full, boundary and skipped tiles.

Must run in its own pytest process: tests/interpreter/conftest.py sets TRITON_INTERPRET=1 before
Triton decides (at kernel decoration time) to interpret.
"""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import flashport  # noqa: E402
from conformance import BASE_CASES, Case, check_dense, make_inputs  # noqa: E402
from flashport.backend.reference import materialized_attention  # noqa: E402
from flashport.check import GridCase, assert_within_rule, check_case, magnitude  # noqa: E402
from flashport.dropout import dense_keep_mask, draw_rng_state, threshold24  # noqa: E402
from flashport.kernels.common import dropout_keep  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    # The interpreter turns runtime loop bounds into ints through a deprecated NumPy path.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


# ----------------------------------------------------------------------------- dense conformance
@pytest.mark.parametrize("case", BASE_CASES, ids=str)
def test_base_cases_fp32(case):
    check_dense("triton", case)


FP16_CASES = [
    Case(dtype=torch.float16),
    Case(b=1, sq=3, sk=113, hq=2, hkv=1, d=40, causal=True, dtype=torch.float16),
    Case(b=2, sq=37, sk=13, hq=2, hkv=2, d=32, causal=True, dtype=torch.float16),       # rows see no key
    Case(b=1, sq=33, sk=33, hq=2, hkv=2, d=64, softcap=5.0, window=(9, 2), dtype=torch.float16),
    Case(b=2, sq=19, sk=29, hq=4, hkv=1, d=24, dv=40, alibi="batch_head", causal=True, dtype=torch.float16),
    Case(b=1, sq=21, sk=35, hq=2, hkv=1, d=32, noncontig=True, window=(3, 8), dtype=torch.float16),
]


@pytest.mark.parametrize("case", FP16_CASES, ids=str)
def test_fp16(case):
    check_dense("triton", case)


# Head dims padded in-kernel to the next power of two (BLOCK_D), incl. Dv != D.
@pytest.mark.parametrize("d,dv", [(80, 80), (96, 48), (192, 192), (256, 256), (8, 24)], ids=str)
def test_head_dims(d, dv):
    check_dense("triton", Case(b=1, sq=18, sk=20, hq=2, hkv=1, d=d, dv=dv, causal=True))


# The tile-range arithmetic (skipped / boundary / full tiles, both orientations) for many windows.
WINDOWS = [(sq, sk, w) for sq, sk in ((33, 33), (17, 50), (50, 17))
           for w in ((0, 0), (0, -1), (-1, 0), (16, 16), (1, 40), (40, 1), (100, 100), (-1, 15))]


@pytest.mark.parametrize("sq,sk,window", WINDOWS, ids=str)
def test_windows(sq, sk, window):
    check_dense("triton", Case(b=1, sq=sq, sk=sk, hq=1, hkv=1, d=16, window=window))


SPLIT_CASES = [Case(b=1, sq=33, sk=47, hq=2, hkv=1, d=16, window=(5, 9)),
               Case(b=2, sq=40, sk=21, hq=2, hkv=2, d=24, causal=True, softcap=3.0, alibi="head"),
               Case(b=1, sq=17, sk=50, hq=3, hkv=1, d=16, window=(-1, 3), noncontig=True)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=str)
def test_split_loop_variant(case, monkeypatch):
    """The other loop structure (separate boundary / full tile loops, KernelConfig.split)."""
    from flashport.kernels import tuning
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tuning.KernelConfig(16, 16, 4, 1, split=True))
    check_dense("triton", case)


def test_split_loop_variant_varlen(monkeypatch):
    from flashport.kernels import tuning
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tuning.KernelConfig(16, 16, 4, 1, split=True))
    r = check_case("triton", VARLEN[1], torch.float32, "cpu")
    assert r.status == "PASS" and "dq dk dv" in r.checked, r


def test_gqa_group_reduction_and_causal_fold():
    check_dense("triton", Case(b=1, sq=20, sk=45, hq=6, hkv=2, d=16, causal=True, window=(7, -1)))


GROUP_LOOP_CASES = [Case(b=1, sq=20, sk=45, hq=6, hkv=2, d=16, causal=True, window=(7, -1)),
                    Case(b=2, sq=40, sk=21, hq=4, hkv=1, d=24, causal=True, softcap=3.0, alibi="head"),
                    Case(b=1, sq=33, sk=47, hq=3, hkv=1, d=16, window=(5, 9), noncontig=True)]


@pytest.mark.parametrize("split", [False, True], ids=["one-loop", "split-loops"])
@pytest.mark.parametrize("case", GROUP_LOOP_CASES, ids=str)
def test_gqa_group_loop(case, split, monkeypatch):
    """FLASHPORT_GQA_GROUP_LOOP=1: one dK/dV program per kv head loops over its group's query heads (ALiBi slopes
    and the mask per query head), against the reference; and the varlen kind."""
    from flashport.kernels import tuning
    monkeypatch.setenv("FLASHPORT_GQA_GROUP_LOOP", "1")
    monkeypatch.setattr(tuning, "INTERPRETER_CONFIG", tuning.KernelConfig(16, 16, 4, 1, split=split))
    check_dense("triton", case)
    r = check_case("triton", VARLEN[0], torch.float32, "cpu")
    assert r.status == "PASS" and "dq dk dv" in r.checked, r


@pytest.mark.parametrize("sq,sk", [(0, 5), (5, 0), (1, 1)], ids=str)
def test_empty_sequences(sq, sk):
    q = torch.randn(2, sq, 2, 16, requires_grad=True)
    k = torch.randn(2, sk, 1, 16, requires_grad=True)
    v = torch.randn(2, sk, 1, 16, requires_grad=True)
    out, lse = flashport.attention(q, k, v, return_lse=True, backend="triton")
    assert out.shape == (2, sq, 2, 16) and lse.shape == (2, 2, sq)
    if sk == 0:
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), allow_unused=True)
    for g, t in zip(grads, (q, k, v)):
        assert g is None or (g.shape == t.shape and torch.isfinite(g).all())


# ----------------------------------------------------------------------------- varlen
VARLEN = [
    GridCase("varlen-gqa", kind="varlen", hq=4, hkv=2, seqs=((5, 7), (0, 3), (17, 17), (1, 1), (3, 0)), tail=3),
    GridCase("varlen-causal", kind="varlen", hq=2, hkv=1, d=40, causal=True, seqs=((9, 20), (33, 33), (4, 0)),
             tail=2),
    GridCase("varlen-window-softcap", kind="varlen", window=(4, 2), softcap=2.0, seqs=((19, 11), (6, 9))),
    GridCase("varlen-alibi-bh", kind="varlen", hq=2, hkv=1, alibi="batch_head", causal=True,
             seqs=((0, 0), (18, 30)), tail=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", VARLEN, ids=lambda c: c.name)
def test_varlen(case, dtype):
    """NaN-poisoned padding past cu_seqlens[-1], empty sequences, tail rows zero with lse -inf."""
    r = check_case("triton", case, dtype, "cpu")
    assert r.status == "PASS" and "dq dk dv" in r.checked, r


def test_varlen_tail_rows_zero_and_grads_zero():
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    q = torch.randn(12, 2, 16)
    k = torch.randn(11, 1, 16)
    v = torch.randn(11, 1, 16)
    q[9:], k[9:], v[9:] = float("nan"), float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashport.attention_varlen(*leaves, cu, cu, 5, 5, causal=True, return_lse=True, backend="triton")
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))
    assert bool((lse[:, 9:] == float("-inf")).all()) and torch.isfinite(lse[:, :9]).all()
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all() and torch.equal(g[9:], torch.zeros_like(g[9:]))


def test_varlen_strided_cu_seqlens():
    """cu_seqlens that are views with stride 2 must give the answer of their contiguous copies."""
    cu = torch.tensor([0, 0, 4, 4, 4, 4, 9, 9], dtype=torch.int32)[::2]     # [0, 4, 4, 9], stride 2
    q, k, v = torch.randn(9, 2, 16), torch.randn(9, 1, 16), torch.randn(9, 1, 16)
    got = flashport.attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, backend="triton")
    want = flashport.attention_varlen(q, k, v, cu.contiguous(), cu.contiguous(), 5, 5, causal=True,
                                      backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dropout
@triton.jit
def _keep_kernel(Out, Rng, bh, sq, sk, drop_threshold, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = dropout_keep(tl.load(Rng), tl.load(Rng + 1).to(tl.int32), bh, i[:, None], j[None, :], drop_threshold)
    tl.store(Out + i[:, None] * sk + j[None, :], keep.to(tl.int8), mask=(i[:, None] < sq) & (j[None, :] < sk))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kernel_keep_mask_is_the_shared_mask(p):
    """The in-kernel Philox mask equals flashport.dropout.dense_keep_mask bit for bit."""
    torch.manual_seed(3)
    rng = draw_rng_state(torch.device("cpu"))
    rng[1] = 2**31 + 12345  # offsets >= 2**31 must wrap to uint32 exactly like the PyTorch version
    b, hq, sq, sk = 2, 3, 19, 21
    ref = dense_keep_mask(rng, p, b, hq, sq, sk)
    for bb in range(b):
        for h in range(hq):
            got = torch.empty(sq, sk, dtype=torch.int8)
            _keep_kernel[(2, 2)](got, rng, bb * hq + h, sq, sk, threshold24(p), BLOCK=16)
            assert torch.equal(got.bool(), ref[bb, h]), (bb, h)


def _dropout_run(case: Case, p: float, seed: int):
    q, k, v, do, _ = make_inputs(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out, lse = flashport.attention(*leaves, causal=case.causal, window_size=case.window, dropout_p=p,
                                   return_lse=True, backend="triton")
    grads = torch.autograd.grad(out, leaves, do)
    return (q, k, v, do), out, lse, grads


@pytest.mark.parametrize("case", [Case(b=2, sq=17, sk=23, hq=4, hkv=2, d=16),
                                  Case(b=1, sq=20, sk=20, hq=2, hkv=1, d=32, causal=True, window=(6, -1))], ids=str)
def test_dropout_matches_reference_with_the_same_mask(case):
    """Forward and backward use exactly the shared keep-mask: compared against `reference` given it."""
    p, seed = 0.3, 11
    (q, k, v, do), out, lse, grads = _dropout_run(case, p, seed)
    torch.manual_seed(seed)
    keep = dense_keep_mask(draw_rng_state(torch.device("cpu")), p, case.b, case.hq, case.sq, case.sk)
    left, right = case.window[0], 0 if case.causal else case.window[1]
    kw = dict(scale=case.d ** -0.5, left=left, right=right, keep=keep, dropout_p=p)
    ref_l = [t.double().requires_grad_() for t in (q, k, v)]
    low_l = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = materialized_attention(*ref_l, **kw)
    low, _ = materialized_attention(*low_l, compute_dtype=torch.float32, **kw)
    assert_within_rule("dropout out", out, ref, low, torch.float32, 2)
    assert torch.allclose(lse, ref_lse.float(), atol=1e-5)  # lse is before dropout
    ref_g = torch.autograd.grad(ref, ref_l, do.double())
    low_g = torch.autograd.grad(low, low_l, do)
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref_g, low_g):
        assert_within_rule(f"dropout {name}", a, r, lo, torch.float32, 3, mag=magnitude(*ref_l, do))


def test_dropout_is_reproducible_and_seed_dependent():
    case = Case(b=1, sq=17, sk=17, hq=2, hkv=2, d=16)
    _, out1, _, g1 = _dropout_run(case, 0.5, 5)
    _, out2, _, g2 = _dropout_run(case, 0.5, 5)
    _, out3, _, _ = _dropout_run(case, 0.5, 6)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert not torch.equal(out1, out3)


def test_backend_exposes_its_dropout_mask():
    """DESIGN: each backend with dropout exposes its keep-mask; `reference` fed it reproduces the run."""
    from flashport.backend import triton as triton_backend
    from flashport.backend.reference import reference_attention
    case, p, seed = Case(b=2, sq=9, sk=13, hq=2, hkv=1, d=16), 0.4, 21
    (q, k, v, _), out, _, _ = _dropout_run(case, p, seed)
    torch.manual_seed(seed)
    keep = triton_backend.dropout_mask(draw_rng_state(torch.device("cpu")), p, case.b, case.hq, case.sq, case.sk)
    want = reference_attention(q, k, v, dropout_p=p, dropout_mask=keep)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, reference_attention(q, k, v, dropout_p=p, dropout_mask=~keep), atol=1e-3)

# ----------------------------------------------------------------------------- other contract points
def test_deterministic_backward_is_bitwise_repeatable():
    case = Case(b=2, sq=33, sk=40, hq=4, hkv=1, d=32, causal=True, deterministic=True)
    q, k, v, do, _ = make_inputs(case)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flashport.attention(*leaves, causal=True, deterministic=True, backend="triton")
        runs.append(torch.autograd.grad(out, leaves, do))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("through_out", [True, False], ids=["out-and-lse", "lse-only"])
def test_gradient_through_lse(through_out):
    """d lse / d s = P: the backward folds dlse into Delta; checked against float64 autograd.  lse-only: the
    output's gradient arrives as None (the Function does not materialise it) and counts as zero."""
    case = Case(b=1, sq=19, sk=23, hq=2, hkv=1, d=16, causal=True)
    q, k, v, do, _ = make_inputs(case)
    do = do if through_out else torch.zeros_like(do)
    dlse = torch.randn(1, 2, 19)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashport.attention(*leaves, causal=True, return_lse=True, backend="triton")
    got = torch.autograd.grad((out * do).sum() + (lse * dlse).sum() if through_out else (lse * dlse).sum(), leaves)
    for cd, store in ((torch.float64, "ref"), (torch.float32, "low")):
        ls = [t.detach().to(cd).requires_grad_() for t in (q, k, v)]
        o, l_ = materialized_attention(*ls, scale=16 ** -0.5, right=0, compute_dtype=cd)
        g = torch.autograd.grad((o * do.to(cd)).sum() + (l_.to(cd) * dlse.to(cd)).sum(), ls)
        if store == "ref":
            ref_g = g
        else:
            low_g = g
    for name, a, r, lo in zip(("dq", "dk", "dv"), got, ref_g, low_g):
        assert_within_rule(f"lse-grad {name}", a, r, lo, torch.float32, 3, mag=magnitude(q, k, v, do, dlse))


@pytest.mark.parametrize("zero_dq", [False, True], ids=["delta", "delta-and-zeroed-dq-accum"])
def test_backward_preprocess(zero_dq):
    """The preprocess every backward runs: Delta = rowsum(dO * O) for each row (odd Sq: a partial tile), and
    for the Hopper backward the float32 dQ accumulator zeroed in the same launch (poisoned with NaN first,
    so a row it missed shows)."""
    from flashport.kernels import attn_bwd
    from flashport.spec import dense_spec
    q = torch.randn(2, 37, 3, 32)
    spec, _ = dense_spec(q, q, q, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    out, do = torch.randn_like(q), torch.randn_like(q)
    delta = torch.full((2, 3, 37), float("nan"))
    acc = torch.full(q.shape, float("nan")) if zero_dq else None
    attn_bwd._preprocess(spec, out, do, delta, delta.stride()[:2], None, acc)
    torch.testing.assert_close(delta, (out * do).sum(-1).transpose(1, 2), rtol=1e-5, atol=1e-5)
    if zero_dq:
        assert torch.equal(acc, torch.zeros_like(acc))


def test_no_grad_path_and_strided_lse_shapes():
    q, k, v = torch.randn(2, 9, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    with torch.no_grad():
        out, lse = flashport.attention(q, k, v, return_lse=True, backend="triton")
    ref, ref_lse = materialized_attention(q, k, v, scale=0.25)
    assert out.shape == (2, 9, 4, 16) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_supports_reasons():
    from flashport.backend.triton import TritonBackend
    from flashport.spec import dense_spec
    kw = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
              deterministic=False, return_lse=False)
    be = TritonBackend()
    ok = dense_spec(*(torch.randn(1, 4, 1, 16) for _ in range(3)), **kw)[0]
    assert be.availability() == [] and be.supports(ok) == []
    f64 = dense_spec(*(torch.randn(1, 4, 1, 16, dtype=torch.float64) for _ in range(3)), **kw)[0]
    assert any("float64" in r for r in be.supports(f64))
    big = dense_spec(*(torch.randn(1, 2, 1, 320) for _ in range(3)), **kw)[0]
    assert any("head dim" in r for r in be.supports(big))
    with pytest.raises(flashport.UnsupportedError):
        flashport.attention(*(torch.randn(1, 4, 1, 16, dtype=torch.float64) for _ in range(3)), backend="triton")


def test_cpu_needs_interpreter(monkeypatch):
    from flashport.backend.triton import TritonBackend
    from flashport.spec import dense_spec
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = dense_spec(*(torch.randn(1, 4, 1, 16) for _ in range(3)), causal=False, softmax_scale=None,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False,
                      return_lse=False)[0]
    assert any("TRITON_INTERPRET" in r for r in TritonBackend().supports(spec))


def test_shipped_config_table_is_valid():
    """flashport/configs/triton_configs.json parses into configs with tile sizes tl.dot accepts."""
    from flashport.kernels import tuning
    table = tuning._load_table()
    assert table, "no tuned configs shipped"
    for key, cfg in table.items():
        gpu, kernel, bucket, dtype, mask, length = key.split("|")
        assert kernel in tuning.KERNELS and mask in ("full", "causal", "local") and bucket[0] == "d", key
        assert length in ("short", "long"), key
        assert dtype in ("fp16", "bf16", "fp32"), key
        for n in (cfg.block_m, cfg.block_n):
            assert n >= 16 and n & (n - 1) == 0, key
        assert cfg.num_warps in (4, 8) and 1 <= cfg.num_stages <= 4, key


@pytest.mark.parametrize("d, expected", [(64, 16), (80, 16), (72, 8), (40, 8), (36, 4), (33, 1)])
def test_alignment_hint_is_what_the_strides_share(d, expected):
    """ALIGN (kernels.common.offset) may only claim what every batch / sequence / head stride divides:
    a hint that overclaims makes the GPU issue misaligned vector loads."""
    from flashport.kernels.common import KernelArgs
    from flashport.spec import dense_spec
    q, k, v = (torch.randn(1, 5, 2, d) for _ in range(3))
    spec, _ = dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    a = KernelArgs(spec, q, k, v)
    assert a.constexprs["ALIGN"] == expected
    a.cover(torch.randn(3, 7, 2, d)[:, 1:])  # a sliced view keeps the strides: same answer
    assert a.constexprs["ALIGN"] == expected
    a.cover(torch.randn(1, 5, 2, 2 * d + 1)[..., :d])  # row stride 2d + 1: odd
    assert a.constexprs["ALIGN"] == 1
