"""`flashport tune` / `bench --auto-vs-best` measurement logic (issue [6]), on CPU with a fake timer."""
import json

import pytest
import torch

from flashport import tune
from flashport.bench.shapes import Shape

# CPU auto as blockwise: these tests are about flashport's own path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("without_sdpa_cpu")



def test_interleaved_rounds_retime_only_contenders():
    # each callable returns its name; the fake timer hands out that name's next "time"
    clock = {"a": [1.0, 1.1, 0.9], "b": [1.05, 1.0, 1.2], "c": [3.0], "auto": [1.02, 1.0, 1.01]}
    rounds = []

    def timer(fns, iters):
        rounds.append(sorted(fns))
        if len(rounds) == 1:
            return {}
        return {n: [clock[fn()].pop(0)] for n, fn in fns.items()}

    errors = {}
    makers = {n: (lambda n=n: (lambda: n)) for n in clock}
    med, samples = tune.interleaved(makers, torch.device("cpu"), 3, errors, timer=timer)
    # c is > 15% behind after round 1: timed once; auto is always timed
    # round 1 is preceded by a discarded pass
    assert rounds == [["a", "auto", "b", "c"]] * 2 + [["a", "auto", "b"], ["a", "auto", "b"]]
    assert med == {"a": 1.0, "b": 1.05, "c": 3.0, "auto": 1.01}
    assert samples["a"] == [1.0, 1.1, 0.9] and not errors


def test_interleaved_drops_a_failing_backend():
    def broken():
        raise RuntimeError("no kernel for this shape")

    errors = {}
    timer = lambda fns, iters: {n: [2.0] * iters for n in fns}  # noqa: E731
    med, _ = tune.interleaved({"ok": lambda: (lambda: None), "bad": broken}, torch.device("cpu"), 3, errors,
                              timer=timer)
    assert med == {"ok": 2.0} and "no kernel" in errors["bad"]


def test_paired_timer_rotates_the_order():
    from flashport.bench.timing import paired_ms
    order = []
    got = paired_ms({n: (lambda n=n: order.append(n)) for n in "xyz"}, 3, "cpu")
    assert order == list("xyzyzxzxy") and all(len(t) == 3 for t in got.values())


def test_step_cells_compare_whole_training_plans():
    row = {"label": "x", "fwd": {"g": 1.0, "s": 1.2}, "fwd_train": {"g": 1.0, "s": 1.2}, "bwd": {"t": 3.0, "s": 2.9},
           "plans": [["g", "t"], ["s", "s"]],
           "auto": {"plan_fwd": "g", "fwd": 1.0, "plan_bwd": "g/t", "bwd": 3.0, "fwd_train": 1.0}}
    cells = {c["mode"]: c for c in tune.auto_vs_best([row])}
    assert cells["fwd"]["ratio"] == 1.0 and cells["fwd"]["choice_ratio"] == 1.0
    # the backward alone is best on s (which needs its own forward) ...
    assert cells["bwd"]["best"] == "s" and cells["bwd"]["choice_ratio"] == pytest.approx(2.9 / 3.0)
    # ... but the step g/t (4.0) beats s's pair (4.1): the training plan is right
    assert cells["bwd"]["coupled"] is True        # so the backward cell is judged by the step
    assert cells["step"]["best"] == "g/t" and cells["step"]["ratio"] == 1.0
    assert cells["step"]["measured"] == {"g/t": 4.0, "s": pytest.approx(4.1)}


def test_measure_shape_times_auto_with_the_backends_on_cpu():
    shape = Shape("t", 1, 32, 32, 2, 2, 16, causal=True, dtype="float32")
    r = tune.measure_shape(shape, torch.device("cpu"), with_auto=True, rounds=2)
    assert all("blockwise" in r[role] for role in ("fwd", "fwd_train", "bwd")) and not r["errors"]
    assert r["auto"]["plan_fwd"] == "blockwise" and r["auto"]["fwd"] > 0 and r["auto"]["fwd_train"] > 0
    modes = {c["mode"] for c in tune.auto_vs_best([r])}
    assert modes == {"fwd", "bwd", "step"}


def test_measure_shape_tunes_packed_varlen_calls_on_cpu():
    """A varlen shape is timed through attention_varlen and lands in a varlen bucket (so backend=None's varlen calls
    find their measurements)."""
    shape = Shape("t", 1, 48, 48, 2, 1, 16, causal=True, dtype="float32", kind="varlen", docs=(30, 1, 17))
    r = tune.measure_shape(shape, torch.device("cpu"), with_auto=True, rounds=1)
    assert r["bucket"].startswith("varlen|d16|dv16|float32|causal|g2|q5|k5|") and not r["errors"]
    assert all(r[role] for role in ("fwd", "fwd_train", "bwd")) and r["auto"]["bwd"] > 0
    assert {c["mode"] for c in tune.auto_vs_best([r])} == {"fwd", "bwd", "step"}


def test_training_calls_are_chosen_by_their_training_forward(monkeypatch, tmp_path):
    from flashport import dispatch, table
    from flashport.spec import dense_spec
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    spec = dense_spec(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_p=0.0, deterministic=False, return_lse=False)[0]
    plans = [dispatch.Plan(dispatch.get("blockwise"), dispatch.get("blockwise")),
             dispatch.Plan(dispatch.get("reference"), dispatch.get("blockwise"))]
    # reference's inference forward is faster, but its training forward is not
    entry = {"fwd": {"blockwise": 2.0, "reference": 1.0}, "fwd_train": {"blockwise": 2.0, "reference": 5.0},
             "bwd": {"blockwise": 1.0}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": table.FORMAT, "key": table.machine_key("cpu"),
                                "buckets": {table.bucket(spec): entry}}))
    monkeypatch.setenv("FLASHPORT_TABLE", str(path))
    table.reload()
    assert table.best(spec, plans) is plans[0]


def test_tune_never_overwrites_another_cards_table(tmp_path):
    """`flashport tune --out` on a table measured on another card refuses (naming the argument and both cards)
    before measuring anything, and leaves the file as it was; a table of this machine is merged into."""
    from flashport import table
    path = tmp_path / "selection-nvidia-h200.json"
    doc = {"format": table.FORMAT, "key": {**table.machine_key("cpu"), "gpu": "NVIDIA H200"},
           "buckets": {"dense|d64": {"fwd": {"triton": 1.0}}}}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="out: .*NVIDIA H200"):
        tune.tune([Shape("tiny", 1, 16, 16, 2, 2, 16)], "cpu", path=str(path), rounds=1)
    assert json.loads(path.read_text()) == doc
    assert table.card_of(tmp_path / "missing.json") is None and table.card_of(path) == "NVIDIA H200"
    (tmp_path / "odd.json").write_text(json.dumps({"format": table.FORMAT, "key": "H200"}))
    assert table.card_of(tmp_path / "odd.json") is None
