"""GPU tier of issue [7]: 10,000 varied calls as a user makes them (backend=None, the shipped selection
table, the guard sampling 1% on its side stream) leave allocated memory, every cache flashport owns and
Triton's compiled kernels flat; the guard's read-back is lazy and quarantines a faulty CUDA backend."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

import flashport  # noqa: E402
from flashport import dispatch, monitor, rollout  # noqa: E402

DEV = "cuda"

POOL = [dict(b=b, s=s, sk=sk, hq=hq, hkv=hkv, d=d, causal=causal, window=window)
        for (b, s, sk) in ((1, 128, 128), (2, 1000, 1000), (1, 333, 2049), (4, 1, 513))
        for (hq, hkv) in ((8, 2), (4, 4)) for d in (64, 128)
        for (causal, window) in ((False, (-1, -1)), (True, (-1, -1)), (False, (256, 0)))]


def _call(c, grad: bool):
    g = torch.Generator(device=DEV).manual_seed(hash(tuple(c.values())) & 0xFFFF)
    q = torch.randn(c["b"], c["s"], c["hq"], c["d"], device=DEV, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(c["b"], c["sk"], c["hkv"], c["d"], device=DEV, dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(grad)
    out = flashport.attention(q, k, v, causal=c["causal"], window_size=c["window"])
    if grad:
        out.backward(torch.ones_like(out))


def test_leak_10000_calls_on_the_gpu(monkeypatch):
    monkeypatch.delenv("FLASHPORT_TABLE", raising=False)   # as a user runs it: the shipped table
    monkeypatch.delenv("FLASHPORT_CUDNN_FIRST", raising=False)   # and static priority as shipped
    rng = random.Random(11)
    cases = [(c, grad) for c in POOL for grad in (False, True)]
    with flashport.guard(sample_rate=1.0):  # warm: every case compiled and checked once (the side stream's
        for c, grad in cases:               # cuBLAS workspace is allocated then, not counted as a leak)
            _call(c, grad)
    flashport.guard(sample_rate=0.01)
    flashport.stats()                       # every pending guard check read back
    torch.cuda.synchronize()
    caches = {k: v for k, v in monitor.cache_sizes().items() if k != "dispatch._memo"}
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i in range(10_000):
        _call(*rng.choice(cases))
    st = flashport.stats()
    torch.cuda.synchronize()
    after = {k: v for k, v in monitor.cache_sizes().items() if k != "dispatch._memo"}
    report = {"calls": 10_000 + len(cases), "allocated_before": alloc,
              "allocated_after": torch.cuda.memory_allocated(), "reserved_before": reserved,
              "reserved_after": torch.cuda.memory_reserved(), "memo": len(dispatch._memo),
              "compiled_kernels": sum(v for k, v in after.items() if k.endswith("(compiled)")),
              "caches_changed": {k: (caches.get(k), v) for k, v in after.items() if caches.get(k) != v},
              "stats": {n: {k: d[k] for k in ("calls", "backward", "fallbacks", "guard_checks", "guard_failures")}
                        for n, d in st.items()}}
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "leak_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
    assert report["allocated_after"] <= alloc + (1 << 20)
    assert report["reserved_after"] <= reserved + (256 << 20)
    assert report["caches_changed"] == {}
    assert flashport.quarantined() == {}
    assert sum(d["guard_checks"] for d in st.values()) >= 100 + len(cases) // 2
    assert all(d["guard_failures"] == 0 for d in st.values()), report["stats"]


def test_guard_reads_back_lazily_and_quarantines_a_faulty_cuda_backend(monkeypatch):
    from flashport.backend.triton import TritonBackend

    class Faulty(TritonBackend):
        name, state_family = "faulty-cuda", "faulty-cuda"

        def forward(self, spec, inputs):
            out, lse, private = super().forward(spec, inputs)
            return out + 0.25, lse, private

    monkeypatch.setattr(dispatch, "_REGISTRY", {"faulty-cuda": Faulty(), **dispatch._REGISTRY})
    dispatch.clear_cache()
    q = torch.randn(1, 1024, 8, 128, device=DEV, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    with flashport.guard(sample_rate=1.0):
        flashport.attention(q, k, v, causal=True)
        assert len(rollout._pending) == 1           # the check is in flight: the call did not wait for it
        st = flashport.stats()
    assert st["faulty-cuda"]["guard_failures"] == 1
    assert "faulty-cuda" in flashport.quarantined()
    flashport.attention(q, k, v, causal=True)
    assert flashport.stats()["faulty-cuda"]["calls"] == 1
