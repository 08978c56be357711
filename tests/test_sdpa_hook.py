"""flashport.integrations.sdpa: activate_flash_attention_impl("flashport") routes SDPA's flash path to flashport.

On CPU: F.scaled_dot_product_attention against a float64 reference built here (SDPA's top-left causal rule
written out), flashport's counters as the proof that flashport ran, restore, the recursion guard, and the
CUDA ops' implementations driven through the dispatcher by registering them for CPU tensors in a scoped
library (no CPU kernel exists for those ops, so nothing else is shadowed).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import flashport
from flashport import cli, dispatch
from flashport.integrations import sdpa as hook
from flashport.spec import dense_spec

needs_hook = pytest.mark.skipif(not hook.available(), reason=f"no SDPA hook here: {hook.reason()}")


@pytest.fixture
def active():
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    activate_flash_attention_impl("flashport")
    try:
        yield
    finally:
        restore_flash_attention_impl()


def _counts():
    return {name: (row["forward"], row["backward"]) for name, row in flashport.stats().items()}


def _reference(q, k, v, is_causal, scale):
    """SDPA's math in float64: [B, H, S, D], GQA by repeating kv heads, is_causal top-left (j <= i)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return torch.softmax(s, -1) @ vv, (q, k, v)


def _qkv(b, hq, hkv, sq, sk, d, dtype, seed=0, bshd=False):
    g = torch.Generator().manual_seed(seed)

    def t(h, s):
        x = torch.randn(b, s, h, d, generator=g, dtype=dtype) if bshd else torch.randn(b, h, s, d, generator=g,
                                                                                        dtype=dtype)
        return (x.transpose(1, 2) if bshd else x).requires_grad_()
    return t(hq, sq), t(hkv, sk), t(hkv, sk)


CASES = {   # name: (B, Hq, Hkv, Sq, Sk, D, sdpa keywords)
    "plain": (2, 3, 3, 17, 17, 32, {}),
    "causal-square": (2, 2, 2, 33, 33, 16, {"is_causal": True}),
    "causal-sq<sk": (1, 2, 2, 5, 29, 16, {"is_causal": True}),        # top-left: keys past Sq unseen
    "causal-sq>sk": (2, 2, 2, 23, 7, 24, {"is_causal": True}),        # top-left: no empty rows
    "scale": (1, 4, 4, 9, 13, 8, {"scale": 0.37}),
    "gqa-causal": (2, 4, 2, 11, 19, 40, {"enable_gqa": True, "is_causal": True}),
    "odd": (3, 1, 1, 1, 127, 80, {}),
}
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}


@needs_hook
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", CASES)
def test_sdpa_calls_run_flashport_and_match_the_reference(active, name, dtype):
    b, hq, hkv, sq, sk, d, kw = CASES[name]
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, bshd=name == "scale")   # a transposed [B, S, H, D] buffer too
    flashport.reset_stats()
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert _counts() == {"blockwise": (1, 1)}           # flashport served both directions, once each
    ref, leaves = _reference(q, k, v, kw.get("is_causal", False), kw.get("scale"))
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    assert out.dtype == dtype and out.shape == (b, hq, sq, d) and out.stride() == torch.empty_like(q).stride()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    for g, r, t in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        torch.testing.assert_close(g.double(), r, **TOL[dtype])


@needs_hook
def test_outputs_have_aten_layouts_and_lse(active):
    q, k, v = _qkv(2, 3, 3, 6, 10, 16, torch.float64)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    meta_out, meta_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(t.detach().to("meta") for t in (q, k, v)), 0.0, True)
    assert (out.stride(), lse.stride(), lse.dtype) == (meta_out.stride(), meta_lse.stride(), meta_lse.dtype)
    s = (q @ k.transpose(-1, -2)).detach() / 4
    s = s.masked_fill(torch.ones(6, 10, dtype=torch.bool).tril().logical_not(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-12, rtol=1e-12)


@needs_hook
def test_no_grad_call_runs_only_the_forward(active):
    q, k, v = (t.detach() for t in _qkv(1, 2, 2, 8, 8, 16, torch.float32))
    flashport.reset_stats()
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert _counts() == {"blockwise": (1, 0)}


@needs_hook
def test_restore_puts_pytorch_kernel_back():
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    assert hook.status()["hook"] == "registered"
    activate_flash_attention_impl("flashport")
    try:
        assert hook.status() == {"hook": "active", "reason": None}
        assert cli.info_dict()["sdpa_hook"]["hook"] == "active"
    finally:
        restore_flash_attention_impl()
    assert hook.status()["hook"] == "registered"
    flashport.reset_stats()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert _counts() == {}                               # PyTorch's own kernel, both directions
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"


@needs_hook
def test_flashport_sdpa_backend_inside_the_hook_does_not_recurse(active, monkeypatch):
    # backend="sdpa" calls F.scaled_dot_product_attention, which lands in the hook; the hook selects without
    # that backend, so the chain is exactly two deep: sdpa outside, blockwise inside.
    entered = []
    real = hook._forward
    monkeypatch.setattr(hook, "_forward", lambda *a, **kw: entered.append(1) or real(*a, **kw))
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in _qkv(1, 2, 2, 8, 8, 16, torch.float32))
    flashport.reset_stats()
    out = flashport.attention(q, k, v, causal=True, backend="sdpa")
    out.sum().backward()
    assert entered == [1]
    assert _counts()["blockwise"] == (1, 1) and _counts()["sdpa"][0] == 1
    ref = flashport.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@needs_hook
def test_sdpa_named_inside_the_hook_is_refused_not_recursed(active):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    with flashport.use_backend("sdpa"), pytest.raises(flashport.UnsupportedError, match="SDPA hook replaces"):
        F.scaled_dot_product_attention(q, k, v)
    with flashport.use_backend("reference"):              # a named backend that is no SDPA kernel serves
        flashport.reset_stats()
        F.scaled_dot_product_attention(q, k, v)
        assert _counts() == {"reference": (1, 0)}


def test_state_refuses_backends_declared_to_run_sdpa_flash():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    spec, _ = dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    assert "cpu" in dispatch.get("sdpa").caps.sdpa_flash_devices
    assert dispatch.select_counted(spec, "sdpa")[0].fwd.name == "sdpa"      # elsewhere it serves this call
    with pytest.raises(flashport.UnsupportedError, match="SDPA hook replaces"):
        dispatch.select_counted(spec, "sdpa", "sdpa_hook")
    for b in dispatch._REGISTRY.values():
        refused = bool(dispatch._state_reasons(b, spec, "sdpa_hook"))
        assert refused == ("cpu" in b.caps.sdpa_flash_devices)
    assert {b.name: b.caps.sdpa_flash_devices for b in dispatch._REGISTRY.values()
            if b.name.startswith("sdpa-")} == {"sdpa-cudnn": (), "sdpa-flash": ("cuda",),
                                              "sdpa-efficient": ("cuda",), "sdpa-cpu": ("cpu",)}


@needs_hook
def test_what_flashport_cannot_serve_is_refused(active):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, torch.float32)
    with pytest.raises(flashport.UnsupportedError, match="attn_mask"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(8, 8))
    with pytest.raises(flashport.UnsupportedError, match="dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5)


def test_missing_hook_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(hook, "_registry", lambda: None)
    assert not hook.available() and hook.register() is False
    assert hook.status() == {"hook": "missing", "reason": hook.reason()}
    assert "register_flash_attention_impl" in hook.reason()
    assert cli.main(["info"]) == 0
    assert "sdpa hook: missing: torch" in capsys.readouterr().out


@needs_hook
def test_info_says_registered():
    assert cli.info_dict()["sdpa_hook"] == {"hook": "registered", "reason": None}
    from torch.nn.attention import list_flash_attention_impls
    assert "flashport" in list_flash_attention_impls()


# ----------------------------------------------------------------------------- the CUDA ops, on CPU tensors
@pytest.fixture
def cuda_ops_on_cpu():
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op, fn in hook.CUDA_IMPLS.items():
            lib.impl(op, fn, "CPU")
        yield torch.ops.aten
    finally:
        lib._destroy()


def _bshd(*ts):
    return tuple(t.detach().transpose(1, 2).requires_grad_() for t in ts)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("sq,sk", [(12, 12), (5, 21), (21, 5)])
def test_sdpa_flash_op_is_bottom_right_like_flashattention2(cuda_ops_on_cpu, sq, sk, dropout_p):
    q, k, v = _qkv(2, 4, 2, sq, sk, 16, torch.float32, seed=3)
    torch.manual_seed(7)
    out, lse, _, _, mq, mk, seed, offset, debug = cuda_ops_on_cpu._scaled_dot_product_flash_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dropout_p, True, scale=0.3)
    assert (mq, mk, lse.shape, lse.dtype, seed.dtype, seed.shape, offset.shape, debug.numel()) == \
        (sq, sk, (2, 4, sq), torch.float32, torch.uint64, (2,), (), 0)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.manual_seed(7)    # flashport draws the same (seed, offset): the same keep-mask
    fq, fk, fv = _bshd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    ref = flashport.attention(fq, fk, fv, causal=True, softmax_scale=0.3, dropout_p=dropout_p)
    ref_grads = torch.autograd.grad(ref, (fq, fk, fv), do.transpose(1, 2))
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grads[0], ref_grads[0].transpose(1, 2), atol=1e-5, rtol=1e-5)
    for g, r in zip(grads[1:], ref_grads[1:]):   # k, v were repeated for the op: sum the repeats back
        torch.testing.assert_close(g, r.transpose(1, 2).unflatten(1, (2, 2)).sum(2), atol=1e-5, rtol=1e-5)


def test_flash_attention_forward_varlen_and_window(cuda_ops_on_cpu):
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = torch.tensor([0, 7, 18], dtype=torch.int32), torch.tensor([0, 9, 31], dtype=torch.int32)
    q = torch.randn(18, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(31, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    out, lse, seed, offset, _ = cuda_ops_on_cpu._flash_attention_forward(
        q, k, v, cu_q, cu_k, 11, 22, 0.0, True, False, window_size_left=4)
    assert lse.shape == (4, 18) and out.shape == q.shape
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = flashport.attention_varlen(q, k, v, cu_q, cu_k, 11, 22, causal=True, window_size=(4, 0),
                                     backend="reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    inplace = torch.empty_like(q)
    lse2 = cuda_ops_on_cpu._flash_attention_forward_no_dropout_inplace(
        inplace, q, k, v, cu_q, cu_k, 11, 22, 0.0, True, False, window_size_left=4)
    torch.testing.assert_close((inplace, lse2), (out, lse))
