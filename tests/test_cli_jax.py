"""The command line's JAX frontend on a CPU (fast: in-process, a few grid cases, the bench's two smoke shapes):
`info` lists the JAX backends, `check --frontend jax` reports PASS / FAIL / SKIP per backend and fails on FAIL,
`bench --frontend jax --quick` writes the harness's JSON and PNG."""
import json

import pytest

pytest.importorskip("jax")

from flashport import cli  # noqa: E402
from flashport.check import Result  # noqa: E402


def test_info_lists_the_jax_backends(capsys):
    import flashport.jax as fj
    d = cli.info_dict()["jax"]
    assert d["installed"] and d["jax"] and d["platform"] == "cpu"
    assert [b["name"] for b in d["backends"]] == [b.name for b in fj.backends()]
    cudnn = next(b for b in d["backends"] if b["name"] == "cudnn")
    assert not cudnn["available"] and "no GPU" in cudnn["reasons"][0] and "dtypes" in cudnn["capabilities"]
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"JAX: jax {d['jax']}" in out and "JAX backends" in out
    for b in fj.backends():
        assert f"  {b.name} " in out
    assert "unavailable: no GPU" in out


def test_info_without_jax_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "import_jax_frontend", lambda: None)
    assert cli.jax_info() == {"installed": False, "hint": "pip install flashport[jax]"}
    cli.print_jax_info(cli.jax_info())
    assert capsys.readouterr().out.strip() == "JAX: not installed (pip install flashport[jax])"
    assert cli.main(["check", "--frontend", "jax"]) == 2
    assert "JAX: not installed" in capsys.readouterr().out


def test_check_frontend_jax_reports_per_backend(capsys):
    rc = cli.main(["check", "--frontend", "jax", "--backend", "xla", "--backend", "cudnn", "--match", "^plain$"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "xla      plain-float32" in out and "PASS" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ") and len(ln.split()) > 1}
    assert "PASS: 1 passed, 0 failed, 0 skipped" in lines["xla"]
    assert "SKIP" in lines["cudnn"] and "no GPU" in lines["cudnn"]
    assert "not run" in lines["pallas-tpu"] and "not run" in lines["blockwise"]
    assert "1 passed, 0 failed, 1 skipped" in out


def test_check_frontend_jax_fails_on_fail(monkeypatch, capsys):
    import flashport.jax as fj
    monkeypatch.setattr(fj, "check", lambda *a, **k: [Result("xla", "plain-float32", "FAIL", note="boom")])
    assert cli.main(["check", "--frontend", "jax", "--backend", "xla"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 0 passed, 1 failed" in out


@pytest.mark.parametrize("argv, msg", [(["--backend", "triton"], "unknown JAX backend"),
                                       (["--device", "cpu"], "--device does not apply"),
                                       (["--dtype", "float64"], "float64")])
def test_check_frontend_jax_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--frontend", "jax", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_bench_frontend_jax_quick_writes_json_and_png(tmp_path, capsys):
    assert cli.main(["bench", "--suite", "standard", "--frontend", "jax", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "jax-xla" in out and "jax-blockwise" in out and "flashport (torch, auto)" in out
    doc = json.loads((tmp_path / "bench_standard_jax_quick.json").read_text())
    assert doc["frontend"] == "jax" and doc["suite"] == "standard" and doc["jax_platform"] == "cpu"
    assert doc["jax"]["jax"] and doc["environment"]["card"] and "partial" not in doc
    assert {b["name"] for b in doc["jax_backends"]} >= {"cudnn", "xla", "blockwise"}
    res = doc["results"]
    assert {e["impl"] for e in res} == {"jax-xla", "jax-blockwise", "flashport"}
    assert len(res) == 2 * 3 * 2                          # 2 shapes x 3 implementations x fwd / bwd
    from flashport.bench.shapes import Shape, flops
    for e in res:
        assert e["status"] == "ok", e
        assert e["tflops"] == pytest.approx(flops(Shape(**e["shape"]), e["mode"]) / e["ms"] / 1e9)
        if e["impl"].startswith("jax-"):
            assert e["vs_torch"] == pytest.approx(e["speedup_vs"]["flashport"]) and e["jax_auto"] == "xla"
    blockwise_fwd = [e for e in res if e["impl"] == "jax-blockwise" and e["mode"] == "fwd"]
    assert all(e["max_abs_diff"] < 1e-5 for e in blockwise_fwd)    # against jax-xla on the same inputs
    png = (tmp_path / "bench_standard_jax_quick.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_frontend_jax_records_refusals_and_memory_limits(monkeypatch):
    """A backend that refuses a shape and an xla call over the memory budget are entries with their reasons."""
    from flashport.bench.shapes import Shape
    from flashport.jax import bench
    monkeypatch.setattr(bench, "memory_budget", lambda: 1)
    shape = Shape("standard-cpu", 1, 128, 128, 2, 2, 64, causal=True, dtype="float32")
    res = bench.bench_shape(shape, ["cudnn", "xla"], torch_device=None, reps=1, warmup=0)
    by = {(e["impl"], e["mode"]): e for e in res}
    assert by["jax-cudnn", "fwd"]["status"] == "n/a" and "no GPU" in by["jax-cudnn", "fwd"]["error"]
    assert by["jax-xla", "bwd"]["status"] == "n/a" and "budget" in by["jax-xla", "bwd"]["error"]
    assert "n/a" in bench.table(res) and "budget" in bench.table(res)
