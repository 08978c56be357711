"""blockwise's compiled CPU tile steps (flashport/backend/tile_steps.py): the same results as the eager steps and
the float64 reference, forward and backward, on full and partial (masked) tiles, GQA and edge tiles, one compile
reused across lengths; and a compile that fails falls back to the eager steps with one warning."""
import pytest
import torch

import flashport
from flashport.backend import blockwise, tile_steps

CASES = [dict(causal=True), dict(window_size=(5, 2)), dict()]


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setenv("FLASHPORT_CPU_COMPILE", "1")
    monkeypatch.setattr(blockwise, "BLOCK_M", 16)
    monkeypatch.setattr(tile_steps, "BLOCK_M", 16)
    monkeypatch.setattr(blockwise, "BLOCK_N", 32)
    monkeypatch.setattr(tile_steps, "_failed", [])
    yield


def _run(backend, sq, sk, hq=4, hkv=2, **kw):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q = torch.randn(2, sq, hq, 16, generator=g, requires_grad=True)
    k = torch.randn(2, sk, hkv, 16, generator=g, requires_grad=True)
    v = torch.randn(2, sk, hkv, 16, generator=g, requires_grad=True)
    out, lse = flashport.attention(q, k, v, backend=backend, return_lse=True, **kw)
    do = torch.randn(out.shape, generator=g)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), do))


@pytest.mark.parametrize("kw", CASES, ids=str)
def test_compiled_steps_match_the_reference(compiled, kw):
    assert tile_steps.steps(torch.device("cpu"), 1)[2]
    for sq, sk in ((40, 72), (72, 40), (33, 33)):   # edge tiles, rows that see nothing, keys nobody sees
        got = _run("blockwise", sq, sk, **kw)
        ref = _run("reference", sq, sk, **kw)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert tile_steps._failed == []


def test_auto_compiles_only_large_calls(monkeypatch):
    monkeypatch.setenv("FLASHPORT_CPU_COMPILE", "auto")
    cpu = torch.device("cpu")
    assert not tile_steps.steps(cpu, tile_steps.AUTO_MIN_SCORES - 1)[2]
    assert tile_steps.steps(cpu, tile_steps.AUTO_MIN_SCORES)[2]
    assert not tile_steps.steps(torch.device("meta"), tile_steps.AUTO_MIN_SCORES)[2]   # CPU only
    monkeypatch.setenv("FLASHPORT_CPU_COMPILE", "0")
    assert not tile_steps.steps(cpu, 1 << 40)[2]


def test_a_failing_compile_warns_once_and_runs_eagerly(compiled, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(tile_steps, "_compiled", {"forward": broken, "backward": broken})
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        got = _run("blockwise", 40, 40, causal=True)
    ref = _run("reference", 40, 40, causal=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert "eager" in tile_steps.status()
