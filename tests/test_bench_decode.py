"""The decode benchmark's timing pieces on CPU: eager + CUDA-graph fields, the capture fallback,
graph speedups in the table and plot, and the GPU probe's fp32 reference."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from flashport.backend.reference import materialized_attention
from flashport.bench import gpu, report, timing
from flashport.bench.shapes import Shape, kv_bytes

SHAPE = Shape("decode", 16, 1, 8192, 32, 8, 128, modes=("fwd",), kind="decode")


def test_decode_timings_report_eager_and_graph(monkeypatch):
    monkeypatch.setattr(gpu, "gpu_ms", lambda fn: 0.5)
    monkeypatch.setattr(gpu, "gpu_graph_ms", lambda fn: (0.25, None))
    t = gpu.decode_timings(lambda: None, SHAPE, {"copy_gbps": 4000.0})
    gbps = kv_bytes(SHAPE) / 0.5e-3 / 1e9
    assert t["ms"] == 0.5 and t["gbps"] == pytest.approx(gbps) and t["frac_of_copy"] == pytest.approx(gbps / 4000)
    assert t["graph_ms"] == 0.25 and t["graph_gbps"] == pytest.approx(2 * gbps)
    assert t["graph_frac_of_copy"] == pytest.approx(2 * gbps / 4000) and "graph_fallback" not in t
    monkeypatch.setattr(gpu, "gpu_graph_ms", lambda fn: (0.5, "graph capture failed: X"))
    t = gpu.decode_timings(lambda: None, SHAPE, {})
    assert t["graph_fallback"] == "graph capture failed: X" and t["frac_of_copy"] is None


def test_graph_capture_failure_falls_back_to_eager_with_the_reason(monkeypatch):
    def no_stream():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "gpu_ms", lambda fn: 1.25)
    ms, why = timing.gpu_graph_ms(lambda: None)
    assert ms == 1.25 and why.startswith("graph capture failed: RuntimeError") and "capturing" in why


def _doc():
    entries = []
    for impl, ms, gms, fallback in (("flashport-triton", 0.2, 0.05, None), ("sdpa-cudnn", 0.1, 0.08, None),
                                    ("sdpa-fa2", 0.12, 0.12, "graph capture failed: boom")):
        e = gpu._entry("decode", SHAPE, impl, "fwd", status="ok", first_call_s=1.0, max_abs_diff=0.0,
                       ms=ms, gbps=1.0 / ms, frac_of_copy=0.1 / ms, graph_ms=gms, graph_gbps=1.0 / gms,
                       graph_frac_of_copy=0.1 / gms)
        if fallback:
            e["graph_fallback"] = fallback
        entries.append(e)
    gpu.add_ratios(entries, {"copy_gbps": 4000.0})
    return {"suite": "decode", "ceilings": {"copy_gbps": 4000.0}, "environment": {"card": "fake"},
            "results": entries}


def test_graph_speedups_table_and_plot(tmp_path):
    doc = _doc()
    fp = doc["results"][0]
    assert fp["speedup_vs"] == pytest.approx({"sdpa-cudnn": 0.5, "sdpa-fa2": 0.6})
    assert fp["graph_speedup_vs"] == pytest.approx({"sdpa-cudnn": 1.6})   # fa2's capture failed: no ratio
    table = report.gpu_table(doc["results"])
    assert "sdpa-cudnn:0.50 (1.60)" in table
    assert "0.05 20 200%" in table                     # graph ms, GB/s, share of copy
    assert "0.12* " in table and "graph capture failed: boom" in table   # eager stand-in is marked
    path = tmp_path / "d.png"
    report.plot_gpu(doc, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_probe_reference_is_exact_attention():
    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gpu" / "gpu_decode_probe.py"
    spec = importlib.util.spec_from_file_location("gpu_decode_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(18, 1, 8, 16, generator=g), torch.randn(18, 37, 2, 16, generator=g), \
        torch.randn(18, 37, 2, 16, generator=g)
    want, _ = materialized_attention(q, k, v, scale=16 ** -0.5, compute_dtype=torch.float64)
    torch.testing.assert_close(probe.reference(q, k, v), want.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit, match="needs CUDA"):
        if torch.cuda.is_available():
            pytest.skip("CUDA present: the probe would run")
        probe.main(["--out", "/nonexistent/x.json"])


def test_suite_checkpoints_after_every_shape(monkeypatch):
    """A GPU suite cut short by a time limit keeps what it measured: run_suite hands the entries so far,
    with ratios, to the checkpoint after each shape (the CLI rewrites the JSON there)."""
    from flashport.bench.shapes import gpu_suite
    shapes = gpu_suite("standard", quick=True)[:3]

    def fake_dense(suite, shape, impls, device, ceil, tick):
        return [gpu._entry(suite, shape, i, "fwd", status="ok", ms=1.0 if i == gpu.FLASHPORT else 2.0) for i in impls]
    monkeypatch.setattr(gpu, "_dense", fake_dense)
    seen = []
    entries = gpu.run_suite("standard", shapes, [gpu.FLASHPORT, "sdpa-cudnn"], "cpu", {}, lambda: None,
                            checkpoint=lambda done: seen.append([dict(e) for e in done]))
    assert [len(s) for s in seen] == [2, 4, 6] and len(entries) == 6
    assert seen[0][0]["speedup_vs"] == {"sdpa-cudnn": 2.0}
