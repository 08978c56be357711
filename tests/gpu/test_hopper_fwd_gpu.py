"""GPU tier of the Hopper forward (kernels/attn_fwd_hopper.py, Gluon, FlashAttention-3 schedule): skipped
unless the GPU is an sm_90 part.  The kernel serves a subset of calls inside the `triton` backend, so
each test checks both that the call was served by it (or, for the cases it must decline, that it was
not) and the result under the conformance tolerance rule, gradients included (the backward reads the
lse2 this kernel writes)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU")]

import flashport  # noqa: E402
from conformance import Case, check_dense, kwargs_of, make_inputs  # noqa: E402

DEV = "cuda"


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the Hopper kernel served.  (Imported here, not at collection: importing the
    kernels before the interpreter tier sets TRITON_INTERPRET would compile them for every tier.)"""
    from flashport.kernels import attn_fwd_hopper
    # Short shapes keep the float64 reference cheap; the length floor is a speed choice (tested below).
    monkeypatch.setattr(attn_fwd_hopper, "MIN_KEYS", 0)
    monkeypatch.setattr(attn_fwd_hopper, "MIN_KEYS_CAUSAL", 0)
    calls = []
    real = attn_fwd_hopper.forward

    def spy(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)
    monkeypatch.setattr(attn_fwd_hopper, "forward", spy)
    if not attn_fwd_hopper.enabled():
        pytest.skip("Gluon unavailable")
    return calls


SERVED = [
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128),
    Case(b=2, sq=256, sk=256, hq=4, hkv=4, d=128, causal=True),
    Case(b=1, sq=384, sk=640, hq=8, hkv=2, d=128),                   # Sq != Sk, GQA
    Case(b=2, sq=256, sk=512, hq=4, hkv=2, d=128),                   # Sq != Sk with B > 1: b*Sq vs b*Sk rows
    Case(b=1, sq=1024, sk=1024, hq=4, hkv=1, d=128, causal=True),    # MQA, 8 causal tiles per head
    Case(b=1, sq=128, sk=128, hq=2, hkv=2, d=128, causal=True, scale=0.3),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SERVED, ids=str)
def test_served_calls_conform(case, dtype, served):
    check_dense("triton", case.replace(dtype=dtype), DEV, grads=True)
    assert served, "the Hopper kernel did not serve this call"


DECLINED = [
    Case(b=1, sq=200, sk=256, hq=2, hkv=2, d=128),                   # not a multiple of 128
    Case(b=1, sq=256, sk=384, hq=2, hkv=2, d=128, causal=True),      # causal with Sq != Sk
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, noncontig=True),   # strided: no TMA view
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=64),
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, window=(64, 0)),
    Case(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, softcap=5.0),
]


@pytest.mark.parametrize("case", DECLINED, ids=str)
def test_declined_calls_run_the_triton_kernel(case, served):
    check_dense("triton", case.replace(dtype=torch.bfloat16), DEV, grads=False)
    assert not served


@pytest.mark.parametrize("causal", [False, True])
def test_served_at_the_shipped_length_floor(causal, monkeypatch):
    """With the shipped gate (no lowered floor): the shortest served call conforms, forward and lse."""
    from flashport.kernels import attn_fwd_hopper
    if not attn_fwd_hopper.enabled():
        pytest.skip("Gluon unavailable")
    calls = []
    real = attn_fwd_hopper.forward
    monkeypatch.setattr(attn_fwd_hopper, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    s = attn_fwd_hopper.MIN_KEYS_CAUSAL if causal else attn_fwd_hopper.MIN_KEYS
    check_dense("triton", Case(b=1, sq=s, sk=s, hq=2, hkv=1, d=128, causal=causal, dtype=torch.bfloat16), DEV,
                grads=False)
    assert calls


def test_short_sequences_stay_on_the_triton_kernel():
    from flashport.kernels import attn_fwd_hopper
    from flashport.spec import dense_spec
    for causal, sk in ((False, attn_fwd_hopper.MIN_KEYS), (True, attn_fwd_hopper.MIN_KEYS_CAUSAL)):
        for s in (sk - 128, sk):
            q = torch.empty(1, s, 2, 128, device=DEV, dtype=torch.bfloat16)
            spec, _ = dense_spec(q, q, q, causal=causal, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                 alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
            assert bool(attn_fwd_hopper.reasons(spec, q, q, q)) == (s < sk), (causal, s)


def test_switch_off_and_agreement_with_the_triton_kernel(served, monkeypatch):
    case = Case(b=2, sq=512, sk=512, hq=8, hkv=2, d=128, causal=True, dtype=torch.bfloat16)
    q, k, v, _, slopes = make_inputs(case, DEV)
    kw = dict(kwargs_of(case, slopes), backend="triton", return_lse=True)
    out, lse = flashport.attention(q, k, v, **kw)
    again, _ = flashport.attention(q, k, v, **kw)
    assert len(served) == 2 and torch.equal(out, again)             # deterministic
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD", "0")
    ref, ref_lse = flashport.attention(q, k, v, **kw)
    assert len(served) == 2                                         # rolled back to the Triton kernel
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)
