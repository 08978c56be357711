"""Dropout on `blockwise`, checked exactly: the keep-mask is a pure function of (seed, offset, b, h, i, j),
so the reference fed the same mask must give the same output and gradients."""
import pytest
import torch

import flashport
from flashport.backend import blockwise
from flashport.backend.reference import reference_attention
from flashport.dropout import dense_keep_mask, draw_rng_state

P = 0.3


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(blockwise, "BLOCK_M", 8)
    monkeypatch.setattr(blockwise, "BLOCK_N", 16)


def inputs(b=2, sq=19, sk=37, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, hq, d, generator=g), torch.randn(b, sk, hkv, d, generator=g),
            torch.randn(b, sk, hkv, d, generator=g), torch.randn(b, sq, hq, d, generator=g))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 6), softcap=2.0)],
                         ids=["plain", "causal", "window-softcap"])
def test_dropout_matches_reference_with_the_same_mask(kw):
    q, k, v, do = inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out, lse = flashport.attention(*leaves, dropout_p=P, return_lse=True, backend="blockwise", **kw)
    grads = torch.autograd.grad(out, leaves, do)

    torch.manual_seed(11)  # the same draw flashport made: seed and offset from q's device generator
    rng = draw_rng_state(q.device)
    mask = dense_keep_mask(rng, P, 2, 4, q.shape[1], k.shape[1])
    assert torch.equal(mask, blockwise.dropout_mask(rng, P, 2, 4, q.shape[1], k.shape[1]))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_attention(*ref_leaves, dropout_p=P, dropout_mask=mask, return_lse=True, **kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)   # lse ignores dropout
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_a_different_mask_gives_a_different_output():
    # guards the exact check above: it would notice a backend that ignored the mask
    q, k, v, _ = inputs()
    torch.manual_seed(11)
    out = flashport.attention(q, k, v, dropout_p=P, backend="blockwise")
    torch.manual_seed(12)
    mask = dense_keep_mask(draw_rng_state(q.device), P, 2, 4, q.shape[1], k.shape[1])
    assert not torch.allclose(out, reference_attention(q, k, v, dropout_p=P, dropout_mask=mask), atol=1e-3)


def test_same_seed_same_output_and_new_draw_each_call():
    q, k, v, _ = inputs()
    torch.manual_seed(3)
    a = flashport.attention(q, k, v, dropout_p=P, backend="blockwise")
    b = flashport.attention(q, k, v, dropout_p=P, backend="blockwise")
    torch.manual_seed(3)
    c = flashport.attention(q, k, v, dropout_p=P, backend="blockwise")
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_keep_rate_is_one_minus_p():
    rng = torch.tensor([123456789, 42], dtype=torch.int64)
    for p in (0.1, 0.3, 0.7):
        mask = blockwise.dropout_mask(rng, p, 2, 3, 64, 128)
        n = mask.numel()
        rate = mask.float().mean().item()
        assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, (p, rate)


def test_dropout_is_unbiased_in_expectation():
    # E[out] over masks equals the no-dropout output (keep-scaling 1 / (1 - p)); 200 draws of a tiny case
    q, k, v, _ = inputs(b=1, sq=3, sk=5, hq=1, hkv=1, d=8)
    torch.manual_seed(0)
    mean = torch.stack([flashport.attention(q, k, v, dropout_p=0.5, backend="blockwise") for _ in range(200)]).mean(0)
    exact = flashport.attention(q, k, v, backend="blockwise")
    assert (mean - exact).abs().max() < 0.25
