"""CPU run of examples/rollout.py: the example's defective candidate backend is quarantined by the
guard mid-run, later calls go to blockwise, and the stats show the check that caught it."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import flashport
import pytest

# CPU auto as blockwise: these tests are about flashport's own path (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("without_sdpa_cpu")

ROLLOUT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "rollout.py"


def test_rollout_example_quarantines_the_candidate(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spec = importlib.util.spec_from_file_location("flashport_example_rollout", ROLLOUT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        res = mod.main(["--steps", "260"])
    finally:
        sys.modules.pop(spec.name, None)
    st = res["stats"]
    assert res["quarantined_at"] is not None and 0 < res["quarantined_at"] < 260
    assert "candidate" in flashport.quarantined()
    cand, bw = st["candidate"], st["blockwise"]
    assert cand["guard_failures"] == 1 and cand["guard_max_error_ratio"] > 1
    assert bw["guard_failures"] == 0 and bw["calls"] > 0 and bw["fallbacks"] == bw["calls"]
    # both layers' forward and backward: 2 layers x steps calls in all, every one of them served
    assert cand["calls"] + bw["calls"] == 2 * 260
    out = capsys.readouterr().out
    assert "quarantined at step" in out and "guard error ratio" in out
    assert "candidate" not in [b.name for b in flashport.backends()]
