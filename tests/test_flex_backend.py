"""The `flex` backend's mapping of the contract onto FlexAttention, checked on a CPU with eager flex_attention
standing in for the compiled one (the backend itself serves CUDA only: compiled Flex on a CPU has no backward
and no lse, and eager Flex materialises).  Flex has no backward on a CPU at all, so the gradients are checked on
the GPU (tests/gpu/test_flex_gpu.py); here the forward and lse."""
import pytest
import torch

import flashport
from flashport import mods
from flashport.backend import flex
from flashport.spec import dense_spec

fa = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture
def eager_flex(monkeypatch):
    monkeypatch.setattr(flex, "_compiled", [fa.flex_attention])
    monkeypatch.setattr(flex, "BLOCK", 16)
    flex._BLOCK_MASKS.clear()
    yield
    flex._BLOCK_MASKS.clear()


def _call(sq, sk, **kw):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, sq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, sk, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, sk, 2, 16, generator=g, dtype=torch.float64)
    opts = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=True)
    opts.update(kw)
    return (q, k, v), dense_spec(q, k, v, **opts), opts


CASES = {
    "causal-bottom-right": (40, 56, dict(causal=True)),
    "window": (48, 48, dict(window_size=(7, 3))),
    "softcap+alibi": (33, 33, dict(softcap=4.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]))),
    "score+mask+bias": (48, 48, dict(score_mod=mods.relative_position(torch.randn(4, 9, dtype=torch.float64)),
                                     mask_mod=mods.prefix_lm(10), attn_bias=torch.randn(4, 1, 48, dtype=torch.float64),
                                     causal=True)),
    "empty rows": (32, 32, dict(mask_mod=lambda b, h, i, j: (i >= 12) & (j <= i))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flex_mapping_equals_the_reference(name, eager_flex):
    sq, sk, kw = CASES[name]
    (q, k, v), (spec, inputs), opts = _call(sq, sk, **kw)
    out, lse = flex.FlexBackend().run(spec, inputs)
    ref, ref_lse = flashport.attention(q, k, v, backend="reference", **opts)
    # ALiBi's bias is float32 by contract: its rounding enters the float64 results at 1e-8
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 if "alibi" in name else 1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=0, atol=1e-5)


def test_user_block_mask_and_cache(eager_flex):
    bm = flashport.create_block_mask(mods.causal, None, None, 48, 48, block_size=16)
    (q, k, v), (spec, inputs), opts = _call(48, 48, block_mask=bm)
    out, _ = flex.FlexBackend().run(spec, inputs)
    out2, _ = flex.FlexBackend().run(spec, inputs)
    assert len(flex._BLOCK_MASKS) == 1          # built once, reused
    ref = flashport.attention(q, k, v, backend="reference", causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_flex_is_listed_and_refuses_cpu():
    info = {b.name: b for b in flashport.backends()}["flex"]
    assert "score_mod" in info.capabilities["mods"]
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(flashport.UnsupportedError, match="flex"):
        flashport.attention(q, q, q, backend="flex", score_mod=mods.tanh_softcap(3.0))
