"""`flashport tune` / `bench --auto-vs-best` measurement logic (issue [6]), on CPU with a fake clock."""
import pytest
import torch

from flashport import tune
from flashport.bench.shapes import Shape


def test_interleaved_rounds_retime_only_contenders(monkeypatch):
    # each maker's callable returns its own "time"; the fake clock reads it
    clock = {"a": [1.0, 1.1, 0.9], "b": [1.05, 1.0, 1.2], "c": [3.0], "auto": [1.02, 1.0, 1.01]}
    calls = {n: 0 for n in clock}

    def fake_ms(fn, device, rep=100):
        n = fn()
        t = clock[n][calls[n]]
        calls[n] += 1
        return t

    monkeypatch.setattr(tune, "_ms", fake_ms)
    errors = {}
    makers = {n: (lambda n=n: (lambda: n)) for n in clock}
    med, samples = tune.interleaved(makers, torch.device("cpu"), 3, errors)
    assert calls == {"a": 3, "b": 3, "c": 1, "auto": 3}      # c is > 15% behind after round 1: timed once
    assert med == {"a": 1.0, "b": 1.05, "c": 3.0, "auto": 1.01}
    assert samples["a"] == [1.0, 1.1, 0.9] and not errors


def test_interleaved_drops_a_failing_backend(monkeypatch):
    monkeypatch.setattr(tune, "_ms", lambda fn, device, rep=100: fn())

    def broken():
        raise RuntimeError("no kernel for this shape")

    errors = {}
    med, _ = tune.interleaved({"ok": lambda: (lambda: 2.0), "bad": broken}, torch.device("cpu"), 3, errors)
    assert med == {"ok": 2.0} and "no kernel" in errors["bad"]


def test_step_cells_compare_whole_training_plans():
    row = {"label": "x", "fwd": {"g": 1.0, "s": 1.2}, "bwd": {"t": 3.0, "s": 2.9},
           "plans": [["g", "t"], ["s", "s"]],
           "auto": {"plan_fwd": "g", "fwd": 1.0, "plan_bwd": "g/t", "bwd": 3.0, "fwd_train": 1.0}}
    cells = {c["mode"]: c for c in tune.auto_vs_best([row])}
    assert cells["fwd"]["ratio"] == 1.0 and cells["fwd"]["choice_ratio"] == 1.0
    # the backward alone is best on s (which needs its own forward) ...
    assert cells["bwd"]["best"] == "s" and cells["bwd"]["choice_ratio"] == pytest.approx(2.9 / 3.0)
    # ... but the step g/t (4.0) beats s's pair (4.1): the training plan is right
    assert cells["step"]["best"] == "g/t" and cells["step"]["ratio"] == 1.0
    assert cells["step"]["measured"] == {"g/t": 4.0, "s": pytest.approx(4.1)}


def test_measure_shape_times_auto_with_the_backends_on_cpu():
    shape = Shape("t", 1, 32, 32, 2, 2, 16, causal=True, dtype="float32")
    r = tune.measure_shape(shape, torch.device("cpu"), with_auto=True, rounds=2)
    assert "blockwise" in r["fwd"] and "blockwise" in r["bwd"] and not r["errors"]
    assert r["auto"]["plan_fwd"] == "blockwise" and r["auto"]["fwd"] > 0 and r["auto"]["fwd_train"] > 0
    modes = {c["mode"] for c in tune.auto_vs_best([r])}
    assert modes == {"fwd", "bwd", "step"}
