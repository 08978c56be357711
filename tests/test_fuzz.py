"""CPU tier of the fuzzer (flashport.fuzz): the generator is a pure function of (seed, index), cases
round-trip through JSON, small random cases pass on `blockwise` and `reference`, and a broken backend
(wrong output, wrong dropout keep-mask) is caught with a reproduction command."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flashport.backend import blockwise
from flashport.fuzz import FuzzCase, cli, draw_case, run_fuzz
from flashport.fuzz.cases import FULL, SMALL, recipe_pool
from flashport.fuzz.execute import Outcome
from flashport.fuzz.variants import variant_class

DTYPES = ("float16", "bfloat16", "float32")
ENTRIES = {"attention", "varlen", "kvcache", "merge"}


def _run(**kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("size", "small")
    kw.setdefault("dtypes", DTYPES)
    kw.setdefault("verbose", False)
    kw.setdefault("workers", 1)
    return run_fuzz(out=lambda *a: None, **kw)


def _failing(summary):
    return {s: n for s, n in summary["status"].items() if s not in ("PASS", "SKIP")}


# ----------------------------------------------------------------------------- the generator
@pytest.mark.parametrize("size", ["small", "full"])
def test_draw_is_a_pure_function_of_seed_and_index(size):
    for i in range(60):
        a, b = draw_case(7, i, size, DTYPES), draw_case(7, i, size, DTYPES)
        assert a == b
        assert FuzzCase.from_json(a.to_json()) == a      # the log's description reproduces the case
        assert FuzzCase.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    assert draw_case(7, 0, size, DTYPES) != draw_case(7, 1, size, DTYPES)
    assert draw_case(7, 0, size, DTYPES) != draw_case(8, 0, size, DTYPES)


@pytest.mark.parametrize("size", ["small", "full"])
def test_draws_stay_inside_the_contract_and_the_work_bound(size):
    prof = {"small": SMALL, "full": FULL}[size]
    entries = set()
    for i in range(400):
        c = draw_case(3, i, size, DTYPES)
        entries.add(c.entry)
        assert c.hq % c.hkv == 0 and c.hq <= prof.max_hq
        left, right = c.window
        assert left >= -1 and right >= -1 and (not c.causal or right in (-1, 0))
        assert c.dtype in DTYPES and 0 <= c.dropout_p < 1 and c.softcap >= 0
        if c.entry == "attention":
            work = prof.dropout_work if c.dropout_p else prof.work
            assert c.b * c.hq * c.sq * c.sk <= work, c
            assert max(c.sq, c.sk) <= prof.max_len
        elif c.entry == "varlen":
            assert c.hq * sum(a * b for a, b in c.seqs) <= prof.work
            if c.dropout_p:     # the dense keep-mask the check draws
                assert c.b * c.hq * max(a for a, _ in c.seqs) * max(b for _, b in c.seqs) <= prof.dropout_work
            assert (sum(a for a, _ in c.seqs) + c.tail) % 16 == 0 or (sum(a for a, _ in c.seqs) + c.tail) % 2 == 1
        elif c.entry == "kvcache":
            assert c.dropout_p == 0 and not c.grads
            if not c.whole_cache:
                assert len(c.seqs) == c.b and all(0 <= n and n + c.new <= c.sk for n in c.seqs), c
            if c.page:
                assert c.sk % c.page == 0
        else:
            assert sum(c.parts) == c.sk and len(c.parts) >= 1
    assert entries == ENTRIES


def test_recipe_pools_spread_head_dims_masks_and_features():
    pool = recipe_pool(0, "full", DTYPES)
    general = [r for r in pool["attention"] + pool["varlen"] if r.regime == "general"]
    dims = {(r.d, r.dv) for r in general}
    for d in (40, 72, 80, 96, 192, 256):
        assert (d, d) in dims
    assert any(r.d != r.dv for r in general)
    assert {r.mask for r in general} == {"none", "causal", "both", "left", "right"}
    assert any(r.softcap for r in general) and any(r.dropout_p for r in general)
    assert {r.alibi for r in general} >= {"head", "batch_head"}
    assert {r.layout for r in general} >= {"contiguous", "padded8", "padded16", "transposed"}
    assert {r.dtype for r in general} == set(DTYPES)
    assert {r.regime for r in pool["attention"]} >= {"gluon_fwd", "gluon_bwd", "gate"}
    assert {r.page for r in pool["kvcache"]} >= {0, 1, 256}
    assert recipe_pool(1, "full", DTYPES) != pool     # another seed, another pool


def test_the_hopper_focus_draws_only_the_gluon_recipes():
    """--entries hopper: attention calls from the Gluon kernels' recipes alone (windows, ALiBi, 80 / 96 among them),
    a pure function of (seed, index) like every draw; unknown names and a focus without recipes (size small) are
    ValueErrors naming the entries."""
    cases = [draw_case(5, i, "full", DTYPES, ("hopper",)) for i in range(300)]
    assert all(c.entry == "attention" and c.regime in ("gluon_fwd", "gluon_bwd", "gate") for c in cases)
    assert any(c.window != (-1, -1) for c in cases) and any(c.alibi for c in cases)
    assert {c.d for c in cases} >= {64, 128}
    assert cases[7] == draw_case(5, 7, "full", DTYPES, ("hopper",))
    with pytest.raises(ValueError, match="entries"):
        draw_case(5, 0, "small", DTYPES, ("hopper",))
    with pytest.raises(ValueError, match="entries"):
        draw_case(5, 0, "full", DTYPES, ("decode",))
    with pytest.raises(ValueError, match="entries"):
        _run(n=1, entries=["attn"])
    with pytest.raises(ValueError, match="entries \\['hopper'\\]: no recipes"):   # before any case is drawn
        _run(n=2, entries=["attention", "hopper"])
    assert _run(n=2, entries="merge")[1]["status"].get("PASS") == 2          # a comma-separated string too


def test_gluon_hits_name_the_switched_variants(monkeypatch):
    """A served Gluon call is also counted under each switched variant it ran (gluon_bwd:window, ...:alibi, ...:split,
    the backward's m128 and group_loop where their switches are on), so a GPU run shows hits per variant."""
    from flashport.fuzz.variants import gluon_features
    from flashport.spec import dense_spec

    def spec(d, hq, hkv, **kw):
        q, k = torch.zeros(1, 256, hq, d), torch.zeros(1, 256, hkv, d)
        args = dict(causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    dropout_p=0.0, deterministic=False, return_lse=False)
        return dense_spec(q, k, k, **{**args, **kw})[0]

    assert gluon_features(spec(128, 4, 4), backward=True) == []
    assert gluon_features(spec(96, 8, 2, window_size=(64, 0), alibi_slopes=torch.ones(8)), backward=False) == [
        "window", "alibi", "split"]
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_M128", "1")
    monkeypatch.setenv("FLASHPORT_HOPPER_BWD_GROUP_LOOP", "1")
    assert gluon_features(spec(64, 8, 2), backward=True) == ["m128", "group_loop"]
    assert gluon_features(spec(64, 8, 2), backward=False) == []
    assert variant_class("gluon_bwd:window") == "gluon_bwd"


# ----------------------------------------------------------------------------- the checks
def test_blockwise_small_cases_pass():
    results, summary = _run(n=150, seed=5, backend="blockwise")
    assert not _failing(summary), [(r["index"], r["note"], r["worst"]) for r in results if r["status"] != "PASS"]
    assert summary["ran"] == 150
    assert set(summary["by_entry"]) == ENTRIES
    assert sum(v["cases"] for v in summary["by_entry"].values()) == 150
    assert set(summary["by_dtype"]) == set(DTYPES)
    assert summary["by_variant"]["backend:blockwise"]["cases"] >= 150 - summary["by_entry"]["merge"]["cases"]
    assert summary["variant_classes"]["merge_torch"]["cases"] == summary["by_entry"]["merge"]["cases"]
    # every checked quantity is logged with its error and bound
    checked = {n for r in results for n in r["quantities"]}
    assert checked >= {"out", "lse", "dq", "dk", "dv", "det", "append"}
    assert any(r["case"]["dropout_p"] > 0 and "dq" in r["quantities"] for r in results)


def test_compiled_entry_points_pass_the_fuzzer():
    """The fuzzer through torch.compile(fullgraph=True): the custom ops, their fake implementations and their
    registered autograd on random calls of the whole contract (dynamo's graph count proves they were traced)."""
    from torch._dynamo.utils import counters
    from flashport.fuzz import execute
    counters.clear()
    try:
        results, summary = _run(n=150, seed=11, compiled=True)
    finally:
        execute.use_compiled(False)
    assert not _failing(summary), [(r["index"], r["note"], r["worst"]) for r in results if r["status"] != "PASS"]
    traced = sum(v["cases"] for e, v in summary["by_entry"].items() if e != "merge")
    assert counters["stats"]["unique_graphs"] >= traced // 4, (counters["stats"], traced)
    assert all("--compiled" in r["repro"] for r in results)


def test_reference_backend_passes():
    _, summary = _run(n=60, seed=9, backend="reference")
    assert not _failing(summary)


@pytest.mark.parametrize("bias", [1e-2, 0.25])
def test_a_wrong_output_is_caught_with_a_reproduction_command(monkeypatch, bias):
    real = blockwise.BlockwiseBackend.run

    def broken(self, spec, inputs):
        out, lse = real(self, spec, inputs)
        return out + bias, lse
    monkeypatch.setattr(blockwise.BlockwiseBackend, "run", broken)
    results, summary = _run(n=20, seed=5, backend="blockwise", entries=("attention", "varlen", "kvcache"))
    # +1e-2 is below bf16's rounding at these sizes (the same-dtype math path errs by 2e-2 - 7e-2 there),
    # not below fp32's; +0.25 is above every dtype's
    must = [r for r in results if bias > 0.1 or r["dtype"] == "float32"]
    assert len(must) >= 5 and all(r["status"] == "FAIL" for r in must)
    f = summary["failures"][0]
    assert f["worst"]["name"] == "out" and f["worst"]["err"] > f["worst"]["bound"]
    assert f"--seed 5 --case {f['index']} " in f["repro"] and "--backend blockwise" in f["repro"]
    assert "--entries attention,varlen,kvcache" in f["repro"]


def test_a_wrong_dropout_mask_is_caught(monkeypatch):
    # the backend applies one keep-mask and exposes another (half its entries flipped): the exact dropout
    # check must notice wherever a row sees a key
    real = blockwise.dropout_mask

    def exposed(rng, p, batch, heads_q, sq, sk):
        flip = (torch.arange(sq)[:, None] + torch.arange(sk)[None, :]) % 2 == 0
        return real(rng, p, batch, heads_q, sq, sk) ^ flip.to(rng.device)
    monkeypatch.setattr(blockwise, "dropout_mask", exposed)
    results, _ = _run(n=150, seed=5, backend="blockwise", entries=("attention", "varlen"))
    seen = [r for r in results if r["case"]["dropout_p"] > 0 and
            (r["case"]["sq"] * r["case"]["sk"] if r["entry"] == "attention" else
             sum(a * b for a, b in r["case"]["seqs"]))]
    assert len(seen) >= 5 and all(r["status"] == "FAIL" for r in seen), \
        [(r["index"], r["quantities"]) for r in seen if r["status"] != "FAIL"]
    assert all(r["status"] != "FAIL" for r in results if r["case"]["dropout_p"] == 0)


def test_outcome_statuses():
    o = Outcome()
    o.quantities = {"out": (1e-3, 2e-3)}
    assert o.status() == "PASS"
    o.badref = ["dq"]
    o.quantities["dq"] = (0.1, math.inf)          # the math path overflowed: the generator's defect
    assert o.status() == "BADREF"
    o.quantities["dk"] = (math.inf, math.inf)     # a non-finite value from the backend fails regardless
    assert o.status() == "FAIL"
    assert variant_class("fwd:128x64w8s3") == "triton_fwd" and variant_class("gluon_bwd_declined") is None


# ----------------------------------------------------------------------------- the driver
def test_one_case_reproduces_and_the_log_has_header_cases_summary(tmp_path):
    log = tmp_path / "fuzz.jsonl"
    results, _ = _run(n=12, seed=4, backend="blockwise", log=str(log))
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[-1]["type"] == "summary"
    assert [x["index"] for x in lines[1:-1]] == list(range(12))
    again, _ = _run(case=7, seed=4, backend="blockwise")
    assert again[0]["case"] == results[7]["case"] and again[0]["status"] == results[7]["status"]
    assert again[0]["quantities"] == results[7]["quantities"]


def test_cli_exit_codes(tmp_path, monkeypatch, capsys):
    args = ["--n", "6", "--seed", "2", "--backend", "blockwise", "--size", "small", "--device", "cpu",
            "--dtype", "float32,float16", "--log", str(tmp_path / "a.jsonl")]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "entry point" in out and "status: PASS 6" in out
    real = blockwise.BlockwiseBackend.run
    monkeypatch.setattr(blockwise.BlockwiseBackend, "run",
                        lambda self, spec, inputs: (lambda o, l: (o * 1.01 + 1e-2, l))(*real(self, spec, inputs)))
    assert cli(args + ["--entries", "attention"]) == 1
    assert "python -m flashport.fuzz --seed 2 --case" in capsys.readouterr().out


def test_max_seconds_stops_drawing():
    results, summary = _run(n=50, seed=1, backend="blockwise", max_seconds=1e-9)
    assert summary["ran"] == len(results) < 50 and summary["not_run"] == 50 - summary["ran"]


def test_spawned_workers_agree_with_one_process():
    one, _ = _run(n=10, seed=6, backend="blockwise")
    two, summary = _run(n=10, seed=6, backend="blockwise", workers=2)
    assert summary["workers"] == 2 and summary["ran"] == 10
    assert [(r["index"], r["status"], r["case"]) for r in one] == [(r["index"], r["status"], r["case"]) for r in two]


def test_a_crashed_worker_is_replaced_and_its_case_reported(monkeypatch):
    monkeypatch.setenv("FLASHPORT_FUZZ_TEST_CRASH", "3")     # the worker running case 3 exits there
    results, summary = _run(n=8, seed=6, backend="blockwise", workers=2)
    assert [r["index"] for r in results] == list(range(8))
    assert [r["index"] for r in results if r["status"] == "CRASH"] == [3]
    assert summary["status"]["PASS"] == 7 and summary["failures"][0]["index"] == 3
