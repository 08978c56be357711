"""flashport.few_keys: the sink tokens' call (a window with sinks) takes the kernels' forward and a dense float32
backward.  Its gradients, through out and lse both (the merge sends both), against float64 autograd of the
reference: GQA, softcap, rows that see no key, and the switch that puts the kernels' backward back."""
import pytest
import torch

import flashport
from flashport import few_keys


def _loss(out, lse, do, dl):
    return (out.double() * do).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * dl).sum()


@pytest.mark.parametrize("hq,hkv,softcap,w", [(4, 4, 0.0, 8), (4, 2, 0.0, 3), (6, 2, 5.0, 8), (2, 1, 0.0, -1)])
def test_dense_backward_matches_float64(hq, hkv, softcap, w):
    g = torch.Generator().manual_seed(hq * 7 + hkv + int(softcap) + w)
    sq, sk, d = 40, 4, 16
    q = torch.randn(2, sq, hq, d, generator=g, requires_grad=True)
    k, v = (torch.randn(2, sk, hkv, d, generator=g, requires_grad=True) for _ in range(2))
    do = torch.randn(2, sq, hq, d, generator=g).double()
    dl = torch.randn(2, hq, sq, generator=g).double()
    right = sq - sk - w - 1          # the sinks' call: row i sees key j when j <= i - w - 1 (w = -1: every key)
    scale = d ** -0.5
    out, lse = few_keys.attention(q, k, v, right=right, softmax_scale=scale, softcap=softcap, deterministic=False)
    got = torch.autograd.grad(_loss(out, lse, do, dl), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flashport.attention(*leaves, window_size=(-1, right), softmax_scale=scale, softcap=softcap,
                                       return_lse=True, backend="reference")
    want = torch.autograd.grad(_loss(ref, ref_lse, do, dl), leaves)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (w < 0) or torch.isneginf(lse).any()      # the first w + 1 rows see no sink key
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_the_switch_keeps_the_kernels_backward(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 24, 2, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 3, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    kw = dict(right=24 - 3 - 5, softmax_scale=0.3, softcap=0.0, deterministic=False)
    fns = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FLASHPORT_FEW_KEYS_DENSE_BWD", flag)
        out, lse = few_keys.attention(q, k, v, **kw)
        fns.append(out.grad_fn.name())
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        fns.append(grads)
    assert "FewKeys" in fns[0] and "FewKeys" not in fns[2]
    for a, b in zip(fns[1], fns[3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
