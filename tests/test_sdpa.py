"""Backend `sdpa` on CPU: conformance where it serves a call, reasons where it does not, strictness."""
import pytest
import torch

import flashport
from flashport.backend.sdpa import SdpaBackend
from flashport.check import GridCase, check_case
from flashport.spec import dense_spec

SERVED = [
    GridCase("mha", b=2, sq=17, sk=17, hq=3, hkv=3, d=32),
    GridCase("gqa", b=2, sq=19, sk=29, hq=4, hkv=2, d=40),
    GridCase("mqa-dv", sq=31, sk=57, hq=4, hkv=1, d=64, dv=24),
    GridCase("causal-square", sq=33, sk=33, hq=2, hkv=1, d=64, causal=True),
    GridCase("causal-lower-right", sq=5, sk=113, hq=2, hkv=2, d=16, causal=True),  # Sq < Sk: bottom-right
    GridCase("single", sq=1, sk=1, hq=1, hkv=1, d=16),
    GridCase("d80-odd", sq=127, sk=3, hq=2, hkv=2, d=80),
]


@pytest.mark.parametrize("case", SERVED, ids=lambda c: c.name)
def test_sdpa_conformance_with_grads(case):
    r = check_case("sdpa", case, torch.float32, "cpu")
    assert r.status == "PASS", r
    assert r.checked == "out dq dk dv", r     # gradients checked; lse is never served


def test_sdpa_float64_on_cpu():
    # The rule has no oracle above float64; compare with the reference at float64 precision instead.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, h, 24, generator=g, dtype=torch.float64, requires_grad=True)
               for n, h in ((9, 4), (21, 2), (21, 2)))
    out = flashport.attention(q, k, v, causal=True, softmax_scale=0.3, backend="sdpa")
    ref = flashport.attention(q, k, v, causal=True, softmax_scale=0.3, backend="reference")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-12)
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_sdpa_bf16_forward_and_grads():
    r = check_case("sdpa", GridCase("bf16", b=2, sq=24, sk=40, hq=4, hkv=2, d=32, causal=True), torch.bfloat16, "cpu")
    assert r.status == "PASS", r


def _spec(sq=8, sk=8, hq=2, hkv=2, d=16, grad=False, **kw):
    q = torch.randn(1, sq, hq, d, requires_grad=grad)
    k, v = torch.randn(1, sk, hkv, d), torch.randn(1, sk, hkv, d)
    args = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                dropout_p=0.0, deterministic=False, return_lse=False)
    args.update(kw)
    return dense_spec(q, k, v, **args)[0]


@pytest.mark.parametrize("kw, reason", [
    (dict(softcap=2.0), "softcap"),
    (dict(alibi_slopes=torch.ones(2)), "ALiBi"),
    (dict(window_size=(3, 3)), "window"),
    (dict(window_size=(-1, 2)), "window"),
    (dict(dropout_p=0.1), "dropout"),
    (dict(return_lse=True), "lse"),
    (dict(causal=True, sq=9, sk=4), "Sq > Sk"),
    (dict(sk=0), "no keys"),
])
def test_sdpa_reasons(kw, reason):
    spec = _spec(**kw)
    reasons = SdpaBackend().supports(spec)
    assert any(reason in r for r in reasons), reasons


def test_sdpa_serves_causal_window_spelling():
    # window (-1, 0) is causal spelled as a window: served like causal=True
    assert SdpaBackend().supports(_spec(window_size=(-1, 0))) == []
    assert SdpaBackend().supports(_spec(causal=True, sq=4, sk=9)) == []


def test_sdpa_refuses_varlen_and_kvcache():
    q = torch.randn(6, 2, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(flashport.UnsupportedError, match="varlen"):
        flashport.attention_varlen(q, q, q, cu, cu, 6, 6, backend="sdpa")
    cache = torch.randn(1, 8, 2, 16)
    with pytest.raises(flashport.UnsupportedError, match="kvcache"):
        flashport.attention_with_kvcache(q[None, :1], cache, cache.clone(), backend="sdpa")


def test_sdpa_is_strict_when_named():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(flashport.UnsupportedError, match="sdpa: .*softcap"):
        flashport.attention(q, q, q, softcap=1.0, backend="sdpa")
    with flashport.use_backend("sdpa"), pytest.raises(flashport.UnsupportedError, match="lse"):
        flashport.attention(q, q, q, return_lse=True)


def test_sdpa_not_auto_selected_on_cpu():
    # CPU gets flashport's own blockwise path automatically; sdpa only when named.
    from flashport import dispatch
    assert dispatch.select(_spec()).name != "sdpa"
    assert dispatch.select(_spec(), "sdpa").name == "sdpa"


def test_sdpa_output_layout_and_no_nan_from_noncontiguous_inputs():
    big = torch.randn(2, 20, 6, 24)
    q, k, v = big[:, ::2, :4, :16], big[:, 1::2, 4:6, :16], big[:, 1::2, 4:6, 8:24]   # strided views
    out = flashport.attention(q, k, v, causal=True, backend="sdpa")
    ref = flashport.attention(q, k, v, causal=True, backend="reference")
    assert out.shape == (2, 10, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_sdpa_capabilities_are_honest():
    info = {b.name: b for b in flashport.backends()}["sdpa"]
    assert info.available
    caps = info.capabilities
    assert caps["kinds"] == ["dense"] and caps["saved_state"] == "own"
    for feature in ("paged_kvcache", "dropout", "alibi", "softcap", "lse"):
        assert caps[feature] is False
    assert caps["bwd"] is True and "window" not in caps["mask_kinds"]


def test_flash_kernel_refuses_a_zero_scale_on_cuda():
    """softmax_scale = 0 is refused wherever PyTorch's FlashAttention-2 kernel may run it (it returned non-finite
    outputs on an H100: the GPU fuzz's seed 0 case 33); cuDNN and the efficient kernel alone still serve it, and a
    nonzero scale reaches the probe as before (stubbed here: no CUDA on this machine)."""
    import dataclasses

    from flashport.backend import sdpa
    spec = dataclasses.replace(_spec(softmax_scale=0.0), device=torch.device("cuda", 0))
    probed = []
    original = sdpa._probe_cuda
    sdpa._probe_cuda = lambda *a: probed.append(a) or (("cudnn", "flash", "efficient"), ())
    try:
        for kernels, refused in ((("flash",), True), (sdpa._FUSED, True), (("cudnn",), False),
                                 (("efficient",), False)):
            b = SdpaBackend()
            b.kernels = kernels
            why = b._cuda_reasons(spec, "fwd")
            assert (bool(why) and "softmax_scale = 0" in why[0]) == refused, (kernels, why)
        b = SdpaBackend()
        b.kernels = ("flash",)
        assert b._cuda_reasons(dataclasses.replace(spec, softmax_scale=0.125), "fwd") == []
    finally:
        sdpa._probe_cuda = original
    assert probed


def _sdpa_state():
    return tuple(getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in ("cudnn", "flash", "mem_efficient", "math")), \
        torch._C._get_sdp_priority_order()


@pytest.mark.parametrize("kernels", [("cudnn",), ("flash",), ("efficient",), ("cudnn", "flash", "efficient")])
def test_allowing_sets_what_sdpa_kernel_sets_and_restores_it(kernels):
    """sdpa.allowing (what the SDPA backends run each CUDA call under) leaves SDPA in the state
    torch.nn.attention.sdpa_kernel(..., set_priority=True) would (the enable flags; the priority order where more than
    one kernel is allowed), and restores the state it found exactly, also when the call raises."""
    from torch.nn.attention import sdpa_kernel

    from flashport.backend import sdpa as sdpa_backend
    torch.backends.cuda.enable_math_sdp(False)   # a user's own setting, to be found again afterwards
    try:
        before = _sdpa_state()
        with sdpa_kernel([sdpa_backend._SDP[k]() for k in kernels], set_priority=True):
            theirs = _sdpa_state()
        # (sdpa_kernel itself does not give the priority order back exactly where a kernel was disabled: it
        # restores the enabled ones' order first)
        torch._C._set_sdp_priority_order(before[1])
        with sdpa_backend.allowing(kernels):
            ours = _sdpa_state()
        assert ours[0] == theirs[0]
        if len(kernels) > 1:
            assert ours[1] == theirs[1]
        assert _sdpa_state() == before
        with pytest.raises(RuntimeError), sdpa_backend.allowing(kernels):
            raise RuntimeError("a failing call")
        assert _sdpa_state() == before
    finally:
        torch.backends.cuda.enable_math_sdp(True)


def test_the_cuda_probe_asks_pytorchs_checks_without_their_warnings(monkeypatch):
    """_probe_cuda calls PyTorch's can_use_* checks with debug=False: with debug=True they report through TORCH_WARN,
    which reached users' stderr (or an enclosing autograd Function's UserWarnings) once per GQA shape on the GPU.
    A refused kernel still gets a reason naming its check.  The checks are stand-ins here (a CPU build's refuse
    everything)."""
    from flashport.backend import sdpa
    asked = []

    def check(name, ok):
        def fn(params, debug=False):
            asked.append((name, debug))
            return ok
        return fn

    monkeypatch.setattr(sdpa, "_can_use", lambda: {"cudnn": check("cudnn", False), "flash": check("flash", True),
                                                   "efficient": check("efficient", False)})
    usable, why = sdpa._probe_cuda.__wrapped__(torch.device("meta"), torch.bfloat16, 8, 2, 128, 128, 16, 16,
                                               "top_left", True)
    assert usable == ("flash",)
    assert sorted(asked) == [("cudnn", False), ("efficient", False), ("flash", False)]
    assert [w.split(":")[0] for w in why] == ["cudnn", "efficient"] and "can_use_cudnn_attention" in why[0]
