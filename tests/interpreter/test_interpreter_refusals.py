"""Interpreter tier: what the `triton` backend refuses under TRITON_INTERPRET=1 rather than run wrongly.

Triton's interpreter computes bf16 dots wrongly (garbage, no error), so bfloat16 calls are refused with
that reason for every kind of call -- dense, varlen, KV cache -- while fp16 / fp32 ones are served.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

import flashport  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]

REASON = "bfloat16 under TRITON_INTERPRET=1: Triton's interpreter computes bf16 dots wrongly"


def _calls(dtype):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return {
        "dense": lambda: flashport.attention(rnd(1, 5, 2, 16), rnd(1, 5, 2, 16), rnd(1, 5, 2, 16), backend="triton"),
        "varlen": lambda: flashport.attention_varlen(rnd(7, 2, 16), rnd(7, 2, 16), rnd(7, 2, 16), cu, cu, 4, 4,
                                                     backend="triton"),
        "kvcache": lambda: flashport.attention_with_kvcache(rnd(2, 1, 2, 16), rnd(2, 8, 2, 16), rnd(2, 8, 2, 16),
                                                            cache_seqlens=torch.tensor([3, 8], dtype=torch.int32),
                                                            backend="triton"),
    }


@pytest.mark.parametrize("kind", ["dense", "varlen", "kvcache"])
def test_bf16_is_refused_with_the_reason(kind):
    with pytest.raises(flashport.UnsupportedError) as e:
        _calls(torch.bfloat16)[kind]()
    assert REASON in str(e.value)


@pytest.mark.parametrize("kind", ["dense", "varlen", "kvcache"])
def test_fp16_is_still_served(kind):
    out = _calls(torch.float16)[kind]()
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
