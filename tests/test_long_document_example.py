"""CPU run of examples/long_document.py at a tiny size: every length prints its line (time, TFLOP/s, peak memory,
what the materialised scores would need), the sampled rows agree with float32 math, and the JSON and the plot
are written."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "long_document.py"


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("flashport_example_long_document", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def test_long_document_on_cpu(example, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = example.parse_args(["--device", "cpu", "--forward", "1024", "--train", "256", "512", "--heads", "2",
                            "--kv-heads", "1", "--head-dim", "32", "--out", str(tmp_path)])
    assert a.dtype == "fp32" and a.causal and a.repeats == 1
    results = example.run(a, progress=False)
    assert [(r["seqlen"], r["backward"]) for r in results] == [(1024, False), (256, True), (512, True)]
    for r in results:
        assert r["fwd_s"] > 0 and r["fwd_tflops"] > 0 and r["max_abs_err_sampled_rows"] < 1e-5
        assert r["materialised_bytes"] == 2 * r["seqlen"] ** 2 * 4      # B=1, H=2, fp32 scores
        assert r["backends"], "no flashport call was counted"
        if r["backward"]:
            assert r["bwd_s"] > 0 and r["bwd_tflops"] > 0
            assert all(b > 0 for _, b in r["backends"].values())
    # FLOPs by the FlashAttention convention: 4*B*H*S^2*D, halved for causal
    assert example.flops(a, 1024, False) == 4 * 2 * 1024 ** 2 * 32 / 2
    log = json.loads((tmp_path / "long_document.json").read_text())
    assert [r["seqlen"] for r in log["results"]] == [1024, 256, 512]
    png = (tmp_path / "long_document.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = capsys.readouterr().out
    assert "S=    1,024  forward" in out and "materialised scores would need 8.0 MiB" in out
    assert out.count("backward") >= 2
