import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

# `pytest -n 2` on a 2-core box: two workers with 2 OpenMP threads each oversubscribe the cores, and
# OpenMP's spinning barriers then make mid-sized ops up to 100x slower.  One thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


import pytest  # noqa: E402

# The suite must not read the developer's own ~/.config/flashport/config.toml; tests that need a config
# file point FLASHPORT_CONFIG at their own.
os.environ.setdefault("FLASHPORT_CONFIG", os.path.join(os.path.dirname(__file__), "no-such-config.toml"))
# blockwise's compiled CPU tile steps cost seconds of compile per process: off for the suite (and its subprocesses);
# tests/test_tile_steps.py turns them on to check them against the eager steps.
os.environ.setdefault("FLASHPORT_CPU_COMPILE", "0")


@pytest.fixture(autouse=True)
def _fresh_selection():
    """Dispatch memoises its choices per call description; a test that patches a backend must not see
    a choice memoised before the patch (nor leave one behind)."""
    from flashport import dispatch, env, monitor, rollout, table
    dispatch.clear_cache()
    table.reload()
    env.reload_config()
    yield
    rollout._setting[0] = None
    rollout._acc[0] = 0.0
    rollout.release_quarantine()
    monitor.reset_stats()
    env.reload_config()
    dispatch.clear_cache()
    table.reload()


@pytest.fixture
def without_sdpa_cpu(monkeypatch):
    """Auto on CPU as before `sdpa-cpu` (PyTorch's own CPU kernel) existed: blockwise.  For tests of selection,
    counters, the guard and the examples, whose subject is flashport's own path (served by SDPA's kernel, a
    comparison against SDPA would be trivial)."""
    from flashport import dispatch
    monkeypatch.setattr(dispatch, "_REGISTRY", {n: b for n, b in dispatch._REGISTRY.items() if n != "sdpa-cpu"})
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()
