"""Which calls the Gluon Hopper forward (kernels/attn_fwd_hopper.py) accepts, checked without a GPU: the
gate runs on every forward, and anything it lets through that the kernel cannot handle would crash or
compute garbage on an H100/H200 (the kernel itself is checked by tests/gpu/test_hopper_fwd_gpu.py and,
compiled for sm_90a, by tests/test_sm90_codegen.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashport.spec import dense_spec


def _spec(b=1, s=4096, hq=4, hkv=4, d=128, causal=False, sk=None, **kw):
    q = torch.empty(b, s, hq, d, dtype=torch.bfloat16, device="meta")    # shapes only, no memory
    k = torch.empty(b, sk or s, hkv, d, dtype=torch.bfloat16, device="meta")
    spec, _ = dense_spec(q, k, k, causal=causal, softmax_scale=kw.get("scale"), window_size=kw.get("window", (-1, -1)),
                         softcap=kw.get("softcap", 0.0), alibi_slopes=None, dropout_p=0.0, deterministic=False,
                         return_lse=False)
    return dataclasses.replace(spec, device=torch.device("cuda", 0)), q, k   # as if on a GPU: no CUDA call needed


@pytest.mark.parametrize("kw, reason", [
    (dict(d=64), "head dim"),
    (dict(s=4000), "multiples of 128"),
    (dict(s=1024), "at least 2048"),
    (dict(s=2048, causal=True), "at least 4096"),
    (dict(s=128, sk=8192), "at least 2048"),                 # short Sq, long Sk: never measured
    (dict(s=4096, sk=8192, causal=True), "Sq == Sk"),
    (dict(b=0), "batch * heads"),
    (dict(b=8192, hq=16, hkv=16), "batch * heads"),          # grid y would pass 65535
    (dict(window=(256, 0)), "window"),
    (dict(softcap=5.0), "softcap"),
    (dict(scale=-0.5), "positive softmax scale"),
])
def test_gate_declines_what_the_kernel_cannot_serve(kw, reason):
    from flashport.kernels import attn_fwd_hopper
    spec, q, k = _spec(**kw)
    got = attn_fwd_hopper.reasons(spec, q, k, k)
    assert got and reason in got[0], got


def test_gate_declines_cpu_tensors_and_switch_off(monkeypatch):
    from flashport.kernels import attn_fwd_hopper
    spec, q, k = _spec()
    assert attn_fwd_hopper.reasons(dataclasses.replace(spec, device=torch.device("cpu")), q, k, k)
    monkeypatch.setenv("FLASHPORT_HOPPER_FWD", "0")
    assert not attn_fwd_hopper.enabled()
    assert "FLASHPORT_HOPPER_FWD" in attn_fwd_hopper.reasons(spec, q, k, k)[0]


def test_a_kernel_that_fails_to_compile_switches_itself_off(monkeypatch):
    """Safe fallback: if the toolchain rejects the Gluon kernel, forward() warns once and returns None (the
    caller runs the Triton kernel), and the gate declines that variant from then on."""
    from flashport.kernels import attn_fwd_hopper
    if attn_fwd_hopper.gluon is None:
        pytest.skip("Gluon not installed")

    class Rejecting:
        def warmup(self, *a, **kw):
            raise RuntimeError("ptxas: unsupported")
    monkeypatch.setattr(attn_fwd_hopper, "_attn_fwd_hopper", Rejecting())
    monkeypatch.setattr(attn_fwd_hopper, "broken", {})
    monkeypatch.setattr(attn_fwd_hopper, "_compiled", set())
    q = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    spec, _ = dense_spec(q, q, q, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        assert attn_fwd_hopper.forward(spec, q, q, q) is None
    assert "ptxas: unsupported" in attn_fwd_hopper.broken[(torch.bfloat16, True, q.device)]
    gpu_spec, gq, gk = _spec(causal=True)
    attn_fwd_hopper.broken[(gpu_spec.dtype, True, gpu_spec.device)] = "RuntimeError: ptxas: unsupported"
    monkeypatch.setattr(attn_fwd_hopper, "enabled", lambda: True)
    assert "failed to compile" in attn_fwd_hopper.reasons(gpu_spec, gq, gk, gk)[0]
