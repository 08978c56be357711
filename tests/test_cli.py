"""The command line (`python -m flashport info | check | bench`) and the benchmark harness pieces
that CI can run without a GPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

import flashport
from flashport import dispatch
from flashport.backend.reference import ReferenceBackend
from flashport.bench import gpu, report
from flashport.bench.shapes import Shape, flops, gpu_suite, kv_bytes
from flashport.check import GridCase, check_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, env=None, timeout=240):
    e = {k: v for k, v in os.environ.items() if k not in ("FLASHPORT_BACKEND", "TRITON_INTERPRET")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "flashport", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_info_lists_every_backend():
    p = _run("info")
    assert p.returncode == 0, p.stderr
    for b in flashport.backends():
        assert b.name in p.stdout
    assert "torch" in p.stdout and "device" in p.stdout
    d = json.loads(_run("info", "--json").stdout)
    assert d["device"] in ("cpu", "cuda") and d["torch"] == torch.__version__
    assert [b["name"] for b in d["backends"]] == [b.name for b in flashport.backends()]


def test_check_is_green_on_cpu():
    p = _run("check")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "PASS" in p.stdout and " FAIL" not in p.stdout
    assert "sdpa" in p.stdout and "SKIP" in p.stdout        # sdpa skips with its reasons
    assert "sdpa does not expose lse" not in p.stdout        # ... but is run without lse where it can


class _Perturbed(ReferenceBackend):
    """A backend that is wrong by 1e-3 in the output: check must catch it."""
    name = "perturbed"
    auto = False

    def run(self, spec, inputs):
        out, lse = super().run(spec, inputs)
        return out + 1e-3, lse


def test_check_fails_a_wrong_backend(monkeypatch, capsys):
    monkeypatch.setitem(dispatch._REGISTRY, "perturbed", _Perturbed())
    r = check_case("perturbed", GridCase("basic", b=2, hq=4, hkv=2), torch.float32, "cpu")
    assert r.status == "FAIL" and r.err > r.bound
    from flashport.cli import main
    assert main(["check", "--backend", "perturbed"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_cpu_quick_writes_json_and_png(tmp_path):
    # TRITON_INTERPRET=1 in the caller's environment must not leak into the CPU job's workers.
    p = _run("bench", "--quick", "--out", str(tmp_path), env={"TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_cpu_quick.json").read_text())
    assert "bench" in doc["command"] and "--quick" in doc["command"]
    assert doc["environment"]["torch"] == torch.__version__ and doc["environment"]["card"]
    assert doc["timestamp"] and doc["suite"] == "cpu"
    res = doc["results"]
    # rows: forward, forward+backward causal, a sliding window, packed documents; peers: SDPA-CPU, blockwise, naive
    assert {e["impl"] for e in res} == {"flashport", "sdpa-cpu", "blockwise", "naive"} and len(res) == 16
    assert {e["mode"] for e in res} == {"fwd", "fwd+bwd"}
    for e in res:
        if e["impl"] == "sdpa-cpu" and (e["window"] != [-1, -1] or e["docs"]):
            assert e["status"] == "not-served" and ("window" in e["error"] or "documents" in e["error"])
            continue
        assert e["status"] == "ok", e
        assert e["time_s"] > 0 and e["runs"] >= 1 and "peak_extra_mb" in e and e["threads"] >= 1
        assert e["max_err_vs_fp64"] < 1e-5 and e["max_diff_vs_naive"] < 1e-5
        assert "naive" in e["speedup_vs"] or e["impl"] == "naive"
    # backend=None takes PyTorch's CPU kernel on every row, the window and the documents included (masked bands)
    assert {e["backend"] for e in res if e["impl"] == "flashport"} == {"sdpa-cpu"}
    summ = doc["cpu_summary"]
    assert summ["threads"] and summ["min_auto_vs_sdpa"] is not None and summ["min_blockwise_vs_sdpa"] is not None
    assert any(r.get("sdpa_reason") for r in summ["rows"])
    png = (tmp_path / "bench_cpu_quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_gpu_suite_without_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    p = _run("bench", "--suite", "standard", "--out", "/nonexistent")
    assert p.returncode == 2 and "CUDA" in p.stdout


def test_flop_and_byte_conventions():
    s = Shape("x", 2, 1024, 1024, 8, 8, 64)
    assert flops(s, "fwd") == 4 * 2 * 8 * 1024 * 1024 * 64
    assert flops(Shape("x", 2, 1024, 1024, 8, 8, 64, causal=True), "fwd") == flops(s, "fwd") / 2
    assert flops(s, "bwd") == 2.5 * flops(s, "fwd")
    d = Shape("d", 16, 1, 8192, 32, 8, 128, kind="decode")
    assert kv_bytes(d) == 16 * 8192 * 8 * 128 * 2 * 2
    std = gpu_suite("standard")
    assert len(std) == 36 and all(x.b * x.sq == 16384 and x.hq * x.d == 2048 for x in std)
    with pytest.raises(ValueError):
        gpu_suite("nope")


def _fake_gpu_doc():
    entries = []
    for shape in (Shape("standard", 16, 1024, 1024, 16, 16, 128), Shape("standard", 4, 4096, 4096, 16, 16, 128)):
        for impl, ms in (("flashport-triton", 1.0), ("sdpa-fa2", 1.5), ("flex", None)):
            for mode in shape.modes:
                e = gpu._entry("standard", shape, impl, mode, status="ok" if ms else "failed")
                if ms:
                    e.update(ms=ms, tflops=flops(shape, mode) / ms / 1e9,
                             host_us=987.6 if impl == "flashport-triton" else None)
                else:
                    e["error"] = "RuntimeError: boom"
                entries.append(e)
    ceil = {"matmul_bf16_tflops": 700.0, "copy_gbps": 4000.0}
    gpu.add_ratios(entries, ceil)
    return {"suite": "standard", "ceilings": ceil, "environment": {"card": "fake"}, "results": entries}


def test_gpu_ratios_table_and_plot_from_synthetic_results(tmp_path):
    doc = _fake_gpu_doc()
    fp = [e for e in doc["results"] if e["impl"] == "flashport-triton"]
    assert all(e["speedup_vs"] == {"sdpa-fa2": 1.5} for e in fp)       # failed peers get no ratio
    assert all(0 < e["mfu"] == e["tflops"] / 700.0 for e in fp)
    table = report.gpu_table(doc["results"])
    assert "failed" in table and "boom" in table and "sdpa-fa2:1.50" in table
    head, _, first = table.splitlines()[:3]
    col = head.index("host us")
    assert first[col:].split()[0] == "988"                               # host µs per call, its own column
    path = tmp_path / "g.png"
    report.plot_gpu(doc, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_host_us_times_unsynchronised_calls(monkeypatch):
    """host_us: the median over batches of (wall time of `calls` calls) / calls, with a sync only around each
    batch, so that what is timed is the host's own work (the GPU may run behind)."""
    from flashport.bench import timing
    syncs, clock, calls = [], [0.0], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(len(calls)))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def fn():   # 5, 7 and 6 us per call in the three batches
        calls.append(1)
        clock[0] += (5e-6, 7e-6, 6e-6)[(len(calls) - 1) // 10]
    assert timing.host_us(fn, calls=10, batches=3) == pytest.approx(6.0)
    assert len(calls) == 30 and syncs == [0, 10, 20, 30]
