"""Backend `blockwise` (tiled online softmax in PyTorch ops) against the fp64 reference, under the
tolerance rule, forward and backward.  Small tile sizes exercise the multi-tile paths on small shapes."""
import pytest
import torch

import flashport
from conformance import BASE_CASES, Case, check_dense, make_inputs
from flashport.backend import blockwise
from flashport.backend.reference import reference_attention


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_M", 16)
    monkeypatch.setattr(blockwise, "BLOCK_N", 32)


@pytest.mark.parametrize("case", BASE_CASES, ids=str)
def test_base_cases_fp32(case):
    check_dense("blockwise", case)


LOWP = [BASE_CASES[0], BASE_CASES[2], BASE_CASES[3], BASE_CASES[4], BASE_CASES[7], BASE_CASES[9]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", LOWP, ids=str)
def test_base_cases_low_precision(case, dtype):
    check_dense("blockwise", case.replace(dtype=dtype))


# Every odd length and every head dim appears at least once, without the full product.
ODD = [(1, 257, 16), (3, 17, 40), (17, 3, 64), (113, 127, 80), (127, 113, 96), (257, 1, 128), (17, 113, 256),
       (257, 257, 40)]


def check_one_key_rows(case):
    """Rows that see exactly one key have p = 1 and an exact dq of 0, where the rule's bound shrinks
    to a cast's noise while D_i = rowsum(dO * O) and dP = dO @ V.T round differently (FlashAttention-2
    does the same).  So: the rule for out/lse, and a plain closeness check for the gradients."""
    check_dense("blockwise", case, grads=False)
    q, k, v, do, slopes = make_inputs(case)
    grads = []
    for backend in ("blockwise", "reference"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashport.attention(*leaves, causal=case.causal, window_size=case.window, backend=backend)
        grads.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,d", ODD, ids=lambda x: str(x))
def test_odd_sizes(sq, sk, d, causal):
    case = Case(b=1, sq=sq, sk=sk, hq=2, hkv=1, d=d, causal=causal)
    if sk == 1:
        check_one_key_rows(case)
    else:
        check_dense("blockwise", case)


@pytest.mark.parametrize("case", [
    Case(b=1, sq=33, sk=65, hq=2, hkv=1, d=32),                      # one past 2 tiles of 16 / 32
    Case(b=2, sq=48, sk=64, hq=4, hkv=2, d=16, causal=True),         # exact multiples
    Case(b=1, sq=65, sk=33, hq=2, hkv=2, d=16, causal=True),         # Sq > Sk: leading tiles see nothing
    Case(b=1, sq=70, sk=97, hq=3, hkv=1, d=24, window=(20, 5)),      # window skips whole tiles both sides
    Case(b=2, sq=47, sk=81, hq=4, hkv=2, d=16, softcap=3.0, alibi="batch_head", causal=True),
    Case(b=1, sq=41, sk=77, hq=2, hkv=1, d=32, dv=16, alibi="head", window=(-1, 9), noncontig=True),
], ids=str)
def test_multi_tile_boundaries(case, small_tiles):
    check_dense("blockwise", case)


def test_diagonal_window_multi_tile(small_tiles):
    check_one_key_rows(Case(b=1, sq=50, sk=50, hq=2, hkv=1, d=16, window=(0, 0)))


def test_tiles_shrink_for_large_batch_times_heads(monkeypatch):
    # B * Hq * BLOCK_M * BLOCK_N above TILE_ELEMENTS halves the tile (here down to 16 x 32)
    monkeypatch.setattr(blockwise, "TILE_ELEMENTS", 8 * 16 * 32)
    check_dense("blockwise", Case(b=2, sq=40, sk=70, hq=4, hkv=2, d=16, causal=True, alibi="head"))


def test_default_tile_boundary():
    # one past BLOCK_M = 128 and BLOCK_N = 512 at the default tile sizes
    check_dense("blockwise", Case(b=1, sq=blockwise.BLOCK_M + 1, sk=blockwise.BLOCK_N + 1, hq=1, hkv=1, d=16,
                                  causal=True))


@pytest.mark.parametrize("case", [BASE_CASES[0], BASE_CASES[3], BASE_CASES[7], BASE_CASES[9]], ids=str)
def test_float64_close_to_reference(case, small_tiles):
    # The tolerance rule degenerates in fp64 (the math path IS the reference), so use a tight allclose.
    case = case.replace(dtype=torch.float64)
    q, k, v, do, slopes = make_inputs(case)
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)
    grads = []
    for backend in ("blockwise", "reference"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flashport.attention(*leaves, **kw, return_lse=True, backend=backend)
        grads.append((out, lse, *torch.autograd.grad(out, leaves, do)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_inputs_are_not_modified():
    # Regression: pre-scaling q in place corrupted the caller's q when no copy was needed.
    q, k, v, _, _ = make_inputs(Case(b=1, sq=1, sk=1, hq=1, hkv=1, d=16))
    saved = [t.clone() for t in (q, k, v)]
    flashport.attention(q, k, v, backend="blockwise")
    for a, b in zip((q, k, v), saved):
        assert torch.equal(a, b)


def test_rows_without_keys_are_zero_with_zero_grads(small_tiles):
    case = Case(b=1, sq=40, sk=8, hq=2, hkv=1, d=16, causal=True)   # rows 0..31 see no key
    q, k, v, do, _ = make_inputs(case)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flashport.attention(*leaves, causal=True, return_lse=True, backend="blockwise")
    assert torch.equal(out[:, :32], torch.zeros_like(out[:, :32]))
    assert torch.isneginf(lse[..., :32]).all() and torch.isfinite(lse[..., 32:]).all()
    dq, dk, dv = torch.autograd.grad((out * do).sum() + lse[..., 32:].sum(), leaves)
    assert torch.equal(dq[:, :32], torch.zeros_like(dq[:, :32]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_gradient_through_lse(small_tiles):
    case = Case(b=2, sq=37, sk=45, hq=4, hkv=2, d=16, causal=True, softcap=4.0, alibi="head")
    q, k, v, do, slopes = make_inputs(case)
    w = torch.randn(case.b, case.hq, case.sq)
    grads = []
    for backend in ("blockwise", "reference"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flashport.attention(*leaves, causal=True, softcap=4.0, alibi_slopes=slopes, return_lse=True,
                                       backend=backend)
        grads.append(torch.autograd.grad((out * do).sum() + (lse * w).sum(), leaves))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_deterministic_backward_is_bitwise_repeatable(small_tiles):
    case = Case(b=1, sq=50, sk=70, hq=4, hkv=1, d=16, causal=True)
    q, k, v, do, _ = make_inputs(case)
    runs = []
    for _ in range(2):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashport.attention(*leaves, causal=True, deterministic=True, backend="blockwise")
        runs.append(torch.autograd.grad(out, leaves, do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_backend_info_and_auto_choice_on_cpu():
    info = {b.name: b for b in flashport.backends()}
    assert info["blockwise"].available and info["blockwise"].capabilities["bwd"]
    assert info["blockwise"].capabilities["materialises_scores"] is False
    q, k, v, _, _ = make_inputs(Case(b=1, sq=5, sk=5, hq=1, hkv=1, d=16))
    # Whatever auto picks on this machine (blockwise is always a candidate) matches the reference.
    torch.testing.assert_close(flashport.attention(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)
