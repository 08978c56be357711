"""Which backward calls the Gluon Hopper backward (kernels/attn_bwd_hopper.py) accepts, checked without a
GPU: anything the gate lets through that the kernel cannot handle would crash or compute garbage on an
H100/H200, and deterministic=True must never reach it (its dQ is summed by reduce-adds in scheduling
order).  The kernel itself is checked by tests/gpu/test_hopper_bwd_gpu.py and tools/gpu/gluon_bwd_probe.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance import rejecting_launcher
from flashport.spec import dense_spec


def _spec(b=1, s=1024, hq=4, hkv=4, d=128, causal=False, sk=None, deterministic=False, **kw):
    q = torch.empty(b, s, hq, d, dtype=kw.get("dtype", torch.bfloat16), device="meta")   # shapes only
    k = torch.empty(b, sk or s, hkv, d, dtype=kw.get("dtype", torch.bfloat16), device="meta")
    spec, _ = dense_spec(q, k, k, causal=causal, softmax_scale=kw.get("scale"), window_size=kw.get("window", (-1, -1)),
                         softcap=kw.get("softcap", 0.0), alibi_slopes=None, dropout_p=kw.get("dropout", 0.0),
                         deterministic=deterministic, return_lse=False)
    return dataclasses.replace(spec, device=torch.device("cuda", 0)), q, k   # as if on a GPU: no CUDA call needed


@pytest.fixture
def bwd(monkeypatch):
    from flashport.kernels import attn_bwd_hopper
    monkeypatch.setattr(attn_bwd_hopper, "broken", {})
    return attn_bwd_hopper


@pytest.mark.parametrize("kw, reason", [
    (dict(d=72), "head dim"),
    (dict(d=256), "head dim"),
    (dict(deterministic=True), "deterministic=True"),
    (dict(dtype=torch.float32), "bfloat16 / float16"),
    (dict(softcap=5.0), "softcap"),
    (dict(dropout=0.1), "dropout"),
    (dict(scale=-0.5), "positive softmax scale"),
    (dict(window=(256, 0), s=512, sk=1024), "Sq == Sk"),
    (dict(s=512, sk=1024, causal=True), "Sq == Sk"),
    (dict(s=100), "at least 128"),
    (dict(s=256, sk=100), "at least 128"),
    (dict(b=0), "batch * heads"),
    (dict(b=8192, hq=16, hkv=16), "batch * heads"),           # grid y would pass 65535
    (dict(s=1 << 24, hq=1, hkv=1), "int32"),                  # per-head offsets are 32-bit
])
def test_gate_declines_what_the_kernel_cannot_serve(kw, reason, bwd):
    spec, q, k = _spec(**kw)
    got = bwd.reasons(spec, q, k, k, q)
    assert got and reason in got[0], got


def test_gate_declines_cpu_tensors_and_switch_off(monkeypatch, bwd):
    spec, q, k = _spec()
    assert "CUDA" in bwd.reasons(dataclasses.replace(spec, device=torch.device("cpu")), q, k, k, q)[0]
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD", "0")
    assert not bwd.enabled()
    assert "FLASHPORT_HOPPER_BWD" in bwd.reasons(spec, q, k, k, q)[0]


def test_gate_reaches_the_device_checks_for_a_servable_call(monkeypatch, bwd):
    """A call inside the subset passes every spec check: what is left is the device (sm_90) and the
    tensors (contiguous, aligned), which the gate asks last."""
    if bwd.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(bwd, "_capability", lambda index: (8, 0))
    for kw in (dict(), dict(causal=True), dict(hq=8, hkv=2), dict(s=256, sk=640), dict(dtype=torch.float16),
               dict(d=64), dict(d=64, causal=True, hq=8, hkv=1),
               dict(s=1500, d=64), dict(s=200, sk=333, hq=4, hkv=2), dict(s=300, causal=True)):   # ragged lengths
        spec, q, k = _spec(**kw)
        assert "sm_90" in bwd.reasons(spec, q, k, k, q)[0], kw
    monkeypatch.setattr(bwd, "_capability", lambda index: (9, 0))
    spec, q, k = _spec()
    strided = torch.empty(1, 4, 1024, 128, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    assert "contiguous" in bwd.reasons(spec, q, k, k, strided)[0]


def test_a_kernel_that_fails_to_compile_switches_itself_off(monkeypatch, bwd):
    """Safe fallback: if the toolchain rejects the Gluon kernel, backward() warns once and returns None (the
    caller runs the Triton kernels), and the gate declines that variant from then on -- not another head dim, nor
    the same call with a switched variant (broken_key)."""
    if bwd.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(bwd, "_launch", rejecting_launcher())
    monkeypatch.setattr(bwd, "_compiled", set())
    q = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    spec, _ = dense_spec(q, q, q, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)
    lse = torch.zeros(1, 2, 256)
    with pytest.warns(RuntimeWarning, match="failed to compile"):
        assert bwd.backward(spec, q, q, q, q, q, lse, lse) is None
    assert "ptxas: unsupported" in bwd.broken[(torch.bfloat16, 128, "causal", False, q.device, "s2_tma2_lse", False,
                                               False)]
    gpu_spec, gq, gk = _spec(causal=True)
    bwd.broken[bwd.broken_key(gpu_spec)] = "RuntimeError: ptxas: unsupported"
    monkeypatch.setattr(bwd, "enabled", lambda: True)
    assert "failed to compile" in bwd.reasons(gpu_spec, gq, gk, gk, gq)[0]
    monkeypatch.setattr(bwd, "_capability", lambda index: (9, 0))
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_DQ_FIRST", "1")   # a switched variant is another compilation
    assert bwd.reasons(gpu_spec, gq, gk, gk, gq) == []
    monkeypatch.delenv("FLASHPORT_HOPPER_BWD_DQ_FIRST")
    spec64, q64, k64 = _spec(causal=True, d=64)   # another head dim is another compilation
    assert bwd.reasons(spec64, q64, k64, k64, q64) == []


def test_default_variants_compile_for_sm90a(tmp_path):
    """The kernel has no interpreter: this is its CPU-side check, compiled for sm_90a with Triton's bundled
    ptxas (tools/gpu/gluon_bwd_probe.py --compile-only, in a subprocess because the interpreter tier sets
    TRITON_INTERPRET in every test process): the library's variant for each head dim, bf16 / fp16, causal
    and not, MHA and GQA, whole tiles and ragged lengths all compile to
    HGMMA (no HMMA), TMA loads, TMA reduce-adds for dQ, setmaxnreg, registers within the
    consumers' 240 and shared memory within sm_90's opt-in.  Spills: ptxas spills a few scalars today (<= 32
    bytes of stack, a handful of LDL per Q tile); the bound catches a change that makes it spill for real."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("Triton's bundled cuobjdump is missing")
    from flashport.kernels import attn_bwd_hopper
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "tools" / "gpu" / "gluon_bwd_probe.py"), "--compile-only",
                           "--library-default", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["compile"]
    assert sorted({(r["variant"], r["d"]) for r in rows}) == sorted((v, d) for d, v in attn_bwd_hopper.DEFAULT.items())
    assert len(rows) == 7 * len(attn_bwd_hopper.DEFAULT)
    assert sum(r["ragged"] for r in rows) == 2 * len(attn_bwd_hopper.DEFAULT)   # the RAGGED compilation too
    for r in rows:
        assert "error" not in r, r["error"]
        s, ops = r["sass"], r.get("sass_ops", {})
        assert s["HGMMA"] > 0 and s["HMMA"] == 0 and s["UTMALDG"] > 0, (r["causal"], s)
        assert any(op.startswith("UTMAREDG.2D.ADD") for op in ops), ops   # dQ's TMA reduce-adds
        assert any(op.startswith("USETMAXREG") for op in ops), ops
        assert r["max_register_used"] <= attn_bwd_hopper.CONSUMER_REGS, r["max_register_used"]
        assert r["shared_bytes"] <= 232448, r["shared_bytes"]
        assert r["stack_bytes"] <= 64, (r["d"], r["dtype"], r["gqa"], r["causal"], r["stack_bytes"])


def test_windows_pass_the_gate_with_sq_equal_sk_unless_switched_off(monkeypatch, bwd):
    """Sliding windows with Sq == Sk pass the gate by default (the kernel's WINDOW variant);
    FLASHPORT_HOPPER_BWD_WINDOW=0 (rollback), or Sq != Sk, leaves them to the Triton kernels."""
    if bwd.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(bwd, "enabled", lambda: True)
    monkeypatch.setattr(bwd, "_capability", lambda index: (9, 0))
    windows = (dict(window=(256, 0)), dict(window=(-1, 64)), dict(window=(100, 37), d=64, hq=8, hkv=2),
               dict(window=(17, 3), s=300))
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_WINDOW", "0")
    for kw in windows:
        spec, q, k = _spec(**kw)
        assert "FLASHPORT_HOPPER_{FWD,BWD}_WINDOW=0" in bwd.reasons(spec, q, k, k, q)[0], kw
    monkeypatch.delenv("FLASHPORT_HOPPER_BWD_WINDOW")
    for kw in windows:
        spec, q, k = _spec(**kw)
        assert bwd.reasons(spec, q, k, k, q) == [], kw
    spec, q, k = _spec(window=(256, 0), s=512, sk=1024)
    assert "Sq == Sk" in bwd.reasons(spec, q, k, k, q)[0]
    # the bounds the kernel reads: an unbounded side reaches every key
    spec, _, _ = _spec(window=(-1, 64))
    assert bwd.window_bounds(spec) == (2048, 64)
    spec, _, _ = _spec(causal=True)
    assert bwd.window_bounds(spec) == (0, 0)


def test_alibi_passes_the_backward_gate_unless_switched_off(monkeypatch, bwd):
    """The backward serves ALiBi slopes by default, whichever forward wrote the lse; FLASHPORT_HOPPER_BWD_ALIBI=0
    (rollback) leaves them to the Triton kernels."""
    if bwd.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(bwd, "enabled", lambda: True)
    monkeypatch.setattr(bwd, "_capability", lambda index: (9, 0))
    q = torch.empty(2, 1024, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 1024, 2, 128, dtype=torch.bfloat16, device="meta")
    slopes = torch.empty(2, 8, device="meta")
    spec, _ = dense_spec(q, k, k, causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=slopes, dropout_p=0.0, deterministic=False, return_lse=False)
    spec = dataclasses.replace(spec, device=torch.device("cuda", 0))
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_ALIBI", "0")
    assert "ALiBi" in bwd.reasons(spec, q, k, k, q)[0]
    monkeypatch.delenv("FLASHPORT_HOPPER_BWD_ALIBI")
    assert bwd.reasons(spec, q, k, k, q) == []


def test_split_head_dims_pass_the_gate_unless_switched_off(monkeypatch, bwd):
    """D=80 and D=96 run as two power-of-two column parts (attn_bwd_hopper.SPLIT) by default;
    FLASHPORT_HOPPER_BWD_SPLIT=0 (rollback) leaves them to the Triton kernels and no other head dim."""
    if bwd.gluon is None:
        pytest.skip("Gluon not installed")
    monkeypatch.setattr(bwd, "enabled", lambda: True)
    monkeypatch.setattr(bwd, "_capability", lambda index: (9, 0))
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_SPLIT", "0")
    for d in (80, 96):
        spec, q, k = _spec(d=d, causal=d == 96)
        assert "FLASHPORT_HOPPER_BWD_SPLIT=0" in bwd.reasons(spec, q, k, k, q)[0]
    monkeypatch.delenv("FLASHPORT_HOPPER_BWD_SPLIT")
    for d in (80, 96):
        spec, q, k = _spec(d=d, hq=8, hkv=2, s=300)
        assert bwd.reasons(spec, q, k, k, q) == [], d
    for kw, reason in ((dict(d=72), "head dim"), (dict(d=96, deterministic=True), "deterministic=True")):
        spec, q, k = _spec(**kw)
        assert reason in bwd.reasons(spec, q, k, k, q)[0], kw
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_SPLIT", "0")
    spec, q, k = _spec(d=128)
    assert bwd.reasons(spec, q, k, k, q) == []
