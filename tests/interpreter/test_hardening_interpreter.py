"""Interpreter tier of tests/test_hardening.py: the real Triton kernels (fp32) with window bounds near
2**63 (index arithmetic wrapped around before they were folded to -1) and a max_seqlen far past the
packed total (the launch grid had 2**36 programs)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import flashport  # noqa: E402
from flashport.spec import varlen_spec  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

BIG = 2 ** 63 - 1


def _qkv(sq=19, sk=23):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, sq, 2, 16, generator=g), torch.randn(1, sk, 1, 16, generator=g), \
        torch.randn(1, sk, 1, 16, generator=g)


@pytest.mark.parametrize("window, kw", [((BIG, BIG), dict()), ((2 ** 62, 0), dict(causal=True)),
                                        ((BIG, 0), dict(causal=True))])
def test_huge_windows_match_their_unbounded_equivalent(window, kw):
    q, k, v = _qkv()
    want, want_lse = flashport.attention(q, k, v, return_lse=True, backend="triton", **kw)
    got, got_lse = flashport.attention(q, k, v, window_size=window, return_lse=True, backend="triton")
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    ref = flashport.attention(q.double(), k.double(), v.double(), backend="reference", **kw)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_huge_window_kvcache():
    g = torch.Generator().manual_seed(1)
    q, kc, vc = torch.randn(2, 2, 2, 16, generator=g), torch.randn(2, 24, 1, 16, generator=g), \
        torch.randn(2, 24, 1, 16, generator=g)
    lens = torch.tensor([5, 24], dtype=torch.int32)
    want = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="triton")
    got = flashport.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(BIG, BIG), backend="triton")
    assert torch.equal(got, want)


def test_max_seqlen_far_beyond_the_total():
    g = torch.Generator().manual_seed(2)
    lens_q, lens_k = [5, 0, 17], [9, 4, 20]
    cq = torch.tensor([0, 5, 5, 22], dtype=torch.int32)
    ck = torch.tensor([0, 9, 13, 33], dtype=torch.int32)
    q, k, v = torch.randn(22, 2, 16, generator=g), torch.randn(33, 1, 16, generator=g), \
        torch.randn(33, 1, 16, generator=g)
    spec = varlen_spec(q, k, v, cq, ck, 2 ** 40, 2 ** 40, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    assert (spec.seqlen_q, spec.seqlen_k) == (22, 33)     # first: before the fix the grid below never ends
    for kw in (dict(), dict(causal=True)):
        want = flashport.attention_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), backend="triton", **kw)
        got = flashport.attention_varlen(q, k, v, cq, ck, 2 ** 40, 2 ** 40, backend="triton", **kw)
        assert torch.equal(got, want)
