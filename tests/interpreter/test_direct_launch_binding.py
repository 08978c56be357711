"""Interpreter tier: the portable Triton kernels (forward, dK/dV, dQ, preprocess) are launched through
kernels/launch.py's DirectLauncher, which on a GPU replays a compiled kernel with (args, meta) as given.  That is
only the JIT's call if every positional arg is a plain parameter, every parameter after them is in meta, and meta
holds no tensor (its values are part of the cache key).  Under the interpreter the same (args, meta) go through the
JIT, so the calls below check the binding rule on every launch shape the backends build -- dense, GQA, Q chunks,
paged KV-cache prefill, compiled mods with captured gradients, block masks -- and still compute the right answer."""
from __future__ import annotations

import os

import pytest
import torch

from conformance import Case, check_dense  # noqa: E402

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (own process)"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]


@pytest.fixture
def launches(monkeypatch):
    """Every (kernel name, unbound(args, meta), direct) the Triton kernels' launchers receive."""
    from flashport.kernels import attn_bwd, attn_fwd
    seen = []
    for module, name in ((attn_fwd, "_fwd_launch"), (attn_bwd, "_dkdv_launch"), (attn_bwd, "_dq_launch"),
                         (attn_bwd, "_preprocess_launch")):
        launcher = getattr(module, name)

        def record(grid, args, meta, direct=True, launcher=launcher):
            seen.append((launcher.jit_fn.__name__, launcher.unbound(args, meta), direct))
            return type(launcher).__call__(launcher, grid, args, meta, direct)
        monkeypatch.setattr(module, name, record)
    return seen


def _assert_bound(seen, kernels):
    assert {name for name, _, _ in seen} >= set(kernels), seen
    assert all(not why for _, why, _ in seen), [s for s in seen if s[1]]
    assert not any(direct for _, _, direct in seen)   # CPU tensors: never the direct path


@pytest.mark.parametrize("case, chunks", [
    (Case(b=2, sq=40, sk=24, hq=4, hkv=2, d=16, causal=True), "auto"),                 # GQA partials
    (Case(b=1, sq=70, sk=20, hq=2, hkv=2, d=16, window=(-1, 8), alibi="head"), "2"),  # Q chunks
    (Case(b=1, sq=33, sk=33, hq=2, hkv=1, d=24, dv=16, softcap=3.0), "auto"),        # Dv != D, MQA
])
def test_dense_launches_bind(case, chunks, launches, monkeypatch):
    monkeypatch.setenv("FLASHPORT_BWD_Q_CHUNKS", chunks)
    check_dense("triton", case)
    _assert_bound(launches, ("_attn_fwd", "_bwd_dkdv", "_bwd_dq", "_bwd_preprocess"))


def test_paged_prefill_launch_binds(launches, monkeypatch):
    import flashport
    from flashport.backend import triton as triton_backend
    monkeypatch.setattr(triton_backend, "PREFILL_MIN_Q", 16)   # the prefill kernel at an interpreter-sized Sq
    torch.manual_seed(0)
    b, sq, hq, hkv, d, page = 2, 20, 4, 2, 16, 16
    k_pages, v_pages = (torch.randn(5, page, hkv, d) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor([27, 30], dtype=torch.int32), causal=True,
              block_table=torch.tensor([[3, 1], [4, 0]], dtype=torch.int32))
    q = torch.randn(b, sq, hq, d)
    out = flashport.attention_with_kvcache(q, k_pages, v_pages, backend="triton", **kw)
    ref = flashport.attention_with_kvcache(q, k_pages, v_pages, backend="reference", **kw)
    out, ref = (x[0] if isinstance(x, tuple) else x for x in (out, ref))
    torch.testing.assert_close(out, ref.to(out.dtype), atol=2e-5, rtol=2e-5)
    _assert_bound(launches, ("_attn_fwd",))


def test_mod_launches_with_captured_gradients_bind(launches):
    import flashport
    from flashport import mods
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 24, 2, 16, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 9, requires_grad=True)
    out = flashport.attention(q, k, v, backend="triton", causal=True, score_mod=mods.relative_position(table))
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    assert table.grad is not None and torch.isfinite(table.grad).all()
    block_mask = flashport.create_block_mask(mods.document(torch.tensor([0] * 10 + [1] * 14)), 1, 1, 24, 24,
                                             device="cpu")
    out = flashport.attention(q, k, v, backend="triton", block_mask=block_mask)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    _assert_bound(launches, ("_attn_fwd", "_bwd_dkdv", "_bwd_dq"))
