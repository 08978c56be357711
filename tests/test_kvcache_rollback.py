"""A KV-cache call that fails after its append leaves the cache as it was (issue [5])."""
from __future__ import annotations

import pytest
import torch

import flashport
from flashport import dispatch


@pytest.mark.parametrize("paged", [False, True])
def test_failure_after_the_append_restores_the_cache(monkeypatch, paged):
    g = torch.Generator().manual_seed(0)
    b, cap, hkv, d = 2, 16, 2, 8
    q = torch.randn(b, 2, 4, d, generator=g)
    k, v = torch.randn(b, 2, hkv, d, generator=g), torch.randn(b, 2, hkv, d, generator=g)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    if paged:
        table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
        kc, vc = torch.randn(4, 8, hkv, d, generator=g), torch.randn(4, 8, hkv, d, generator=g)
    else:
        table = None
        kc, vc = torch.randn(b, cap, hkv, d, generator=g), torch.randn(b, cap, hkv, d, generator=g)
    k0, v0 = kc.clone(), vc.clone()

    def broken(spec, inputs):
        assert not torch.equal(inputs.k, k0), "the append ran before the backend"
        raise RuntimeError("kernel launch failed")
    monkeypatch.setattr(dispatch.get("blockwise"), "run", broken)
    with pytest.raises(RuntimeError, match="kernel launch failed"):
        flashport.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, backend="blockwise")
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    monkeypatch.undo()
    out = flashport.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                           backend="blockwise")
    assert torch.isfinite(out).all() and not torch.equal(kc, k0)   # a good call still appends


def test_merge_is_differentiable():
    outs = [torch.randn(1, 3, 2, 4, requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 3, requires_grad=True) for _ in range(2)]
    out, lse = flashport.merge_attention_states(outs, lses)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in outs + lses)
